"""Which checkpoint tensors make each tensor of a model: transformers' own key renaming and conversion.

transformers 5 does not load a checkpoint key by key. `get_model_conversion_mapping(model)` lists, for the
classes the model is built from, *renamings* (GPT-NeoX's `embed_out` is `lm_head`; legacy
`LayerNorm.gamma` is `LayerNorm.weight`) and *converters* (a fused `qkv` chunked into q, k and v; experts
stacked into one tensor), and the loader then adds or strips the base-model prefix. `Layout` runs exactly
those transforms (transformers' `rename_source_key` and each converter's `convert`), in the order
transformers runs them, so both sides of a split model put every tensor where plain transformers puts it.
There is no table of our own to drift from transformers'.

Names. A tensor's *name* is its checkpoint key after transformers' renaming, before the base-model prefix
is added or stripped. It does not depend on which head class reads the checkpoint, so the executor (which
builds the checkpoint's own class) and a client (any Auto class) agree on it: base layer ids derive from
names, and a tied embedding is found in the executor by name.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from symbiosis.errors import CheckpointError
from symbiosis.model.checkpoint import Checkpoint


@dataclass
class _Converted:
    """Tensors one transformers converter makes together (q, k, v out of one fused qkv), from these keys."""

    converter: WeightConverter  # a template: each read converts with a fresh copy (converters keep what they collect)
    first: str  # the name transformers hands the converter (its first target)
    keys: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # source pattern -> keys

    @property
    def targets(self) -> list[str]:
        # How transformers itself names a converter's targets when it reports them (unexpected keys).
        patterns = self.converter.target_patterns
        return [self.first.replace(patterns[0], pattern) for pattern in patterns]


class Layout:
    """How transformers maps one checkpoint onto one model (`model` may live on the meta device).

    `sources`: name -> the checkpoint key holding it, or the converter group that makes it.
    `names`: the model's state-dict key -> name, for every tensor the checkpoint provides.
    """

    def __init__(self, model: PreTrainedModel, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self._model = model
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
        state = model.state_dict()
        prefix = model.base_model_prefix

        def model_key(name: str) -> str:  # the loader's base-model prefix rule, with nothing to rename
            return rename_source_key(name, [], [], prefix, state)[0]

        self.sources: dict[str, str | _Converted] = {}
        groups: dict[str, _Converted] = {}
        for key in sorted(checkpoint.entries, key=dot_natural_key):  # transformers' order (some renamings are stateful)
            name, pattern = rename_source_key(key, renamings, converters)
            if model_key(name) not in state and model_key(key) in state:
                name, pattern = key, None  # as transformers: a key the model has as it is is not renamed
            if pattern is None:
                self.sources.setdefault(name, key)
            else:
                group = groups.setdefault(name, _Converted(converter_of[pattern], name))
                group.keys[pattern].append(key)
        for group in groups.values():
            for target in group.targets:
                self.sources.setdefault(target, group)
        self.names: dict[str, str] = {}
        for name in self.sources:
            key = model_key(name)
            if key in state:
                self.names.setdefault(key, name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """A name's shape as stored, or None when a converter makes it (known once read)."""
        source = self.sources[name]
        return self.checkpoint.entries[source].shape if isinstance(source, str) else None

    def keys(self, name: str) -> list[str]:
        """The checkpoint keys read to make `name`."""
        source = self.sources[name]
        return [source] if isinstance(source, str) else [k for keys in source.keys.values() for k in keys]

    def read(self, wanted: dict[str, torch.dtype | None], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """name -> dtype (None: as stored; integer tensors are never cast) -> the tensors, on `device`.
        A converter group is read and converted once however many of its targets are wanted."""
        converted: dict[int, dict[str, torch.Tensor]] = {}
        tensors = {}
        for name, dtype in wanted.items():
            source = self.sources.get(name)
            if source is None:
                raise CheckpointError(f"{self.checkpoint.path}: no tensor named {name!r}")
            if isinstance(source, str):
                tensors[name] = self._read_key(source, dtype, device)
                continue
            if id(source) not in converted:
                converted[id(source)] = self._convert(source, dtype, device)
            tensors[name] = converted[id(source)][name]
        return tensors

    def _read_key(self, key: str, dtype: torch.dtype | None, device) -> torch.Tensor:
        stored = self.checkpoint.entries[key].dtype
        return self.checkpoint.read(key, dtype=dtype if stored.is_floating_point else None, device=device)

    def _convert(self, group: _Converted, dtype: torch.dtype | None, device) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(group.converter)
        for pattern, keys in group.keys.items():
            for key in keys:  # deferred reads, as transformers' synchronous loading hands them over
                converter.add_tensor(group.first, key, pattern, partial(self._read_key, key, dtype, device))
        try:
            made = converter.convert(group.first, model=self._model, config=self._model.config)
        except Exception as e:  # transformers' own conversion failed on these tensors: say which
            raise CheckpointError(f"{self.checkpoint.path}: transformers cannot convert {self.keys(group.first)} "
                                  f"into {group.targets}: {e}") from e
        made = {name: value[0] if isinstance(value, list) else value for name, value in made.items()}
        if sorted(made) != sorted(group.targets):
            raise CheckpointError(f"{self.checkpoint.path}: transformers converted {self.keys(group.first)} into "
                                  f"{sorted(made)}, expected {group.targets}")
        return made

    def missing(self, model: PreTrainedModel) -> list[str]:
        """The model's state-dict keys that the checkpoint does not provide and that transformers does not make
        by design: not a tied copy of a provided tensor, not matched by the class's
        `_keys_to_ignore_on_load_missing`. (Non-persistent buffers, rotary tables among them, are not in the
        state dict: transformers computes them.)"""
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        ignored = [re.compile(p) for p in (model._keys_to_ignore_on_load_missing or [])]
        return [key for key in model.state_dict()
                if key not in self.names and tied.get(key) not in self.names
                and not any(p.search(key) for p in ignored)]
