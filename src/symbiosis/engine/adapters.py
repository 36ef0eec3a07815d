"""Hosted LoRA adapters in three tiers (HMI's design): every adapter is a PEFT directory on disk; those read lately
stay in host memory (pinned on a GPU engine) under a byte budget; those in use sit in device slots. Each memory
tier evicts its least recently used adapter when full; an adapter that a running request uses is never evicted
from its slot. Whichever tier an adapter comes from, the same bytes reach the slot: output does not depend on it.

Reading (`AdapterStore.load`, any thread): safetensors only (no pickle anywhere in the directory), LoRA only (other
methods run exactly on a split client: `symbiosis.from_pretrained` + PEFT), every tensor named, shaped and finite as
the base model's layer needs, rank at most the store's `max_rank`, the base model's fingerprint where the directory
records one (`symbiosis.json`, written by `save_adapter`). The result is one host buffer holding every matrix (one
pinned allocation on a GPU engine, not one per tensor), kept in the host tier until its budget evicts it.

Placing (`acquire`, the engine's thread): each base layer that some adapter targets has device pools
    a[S, R, in], b[S, out, R], scale[S, 1]    (S slots, R = max_rank; a rank-r adapter fills rows/columns :r,
                                               zero beyond)
read by the SGMV kernels; the layers of a fused group (q/k/v, gate/up: engine/layers.py) share pools, side by side:
    a[S, G*R, in] (member g's rows g*R ..), b[S, out_1 + .. + out_G, R] (its output rows), scale[S, G].
The input embedding, when targeted, has a[S, vocab, R] and b[S, R, dim].

Copies run on a side stream, in up to PLACEMENT_WAVES waves of layers in the model's order (one per WAVE_BYTES of
the adapter), each as long as all before it (1, 1, 2, 4, .. parts: `wave_bounds`), so a wave's copy has its
predecessors' layers to compute behind, and the first, the one nothing hides, is short. An adapter's host buffer
holds its layers in that order, so a wave is one range of it: one host-to-device copy into a staging buffer on the
device, then one fused device copy into every pool row of the wave (`_Wave`, its views made once per slot and
adapter layout; on a GPU replayed from a CUDA graph recorded once per slot, layout and wave): a handful of calls
on the engine's thread per placement, not one per tensor. Each wave's copies are followed by an event
(`Pools.ready`, one `_Ready` shared by the wave's pools): an eagerly run step waits, at the first layer of each
wave, only for that wave's copy, so later waves land while earlier layers compute (layer-wise prefetch). A step
replayed from a CUDA graph cannot wait inside the graph: it waits for every pending copy first (`wait_all`).

A placement waits only for the steps that read its slot (`read_by`: the engine records an event after each step
for the slots it reads), not for the whole stream of steps: evicting an adapter whose last request has ended
while the step in flight still runs a row of it is safe, and a new adapter's copies run beside that step. The
evicted adapter's scales that the new one does not overwrite are zeroed on the copy stream too, behind the same
wait (they must add zero), and the pools they are in wait for that; an adapter of the evicted one's layout zeroes
nothing.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from symbiosis.client.adapter_files import check_adapter_directory, check_pattern_keys, pattern_value, read_json
from symbiosis.client.generate import check_base_fingerprint
from symbiosis.errors import AdapterError, UnsupportedAdapter
from symbiosis.model.partition import GROUP_SEPARATOR, BaseLayerSpec

PREFIX = "base_model.model."
SPLIT_CLIENT_HINT = ("the engine runs LoRA adapters; run this one exactly on a split client instead "
                     "(symbiosis.from_pretrained(model_dir, executor) + PeftModel.from_pretrained)")
# LoraConfig fields whose non-default value changes the math beyond plain LoRA
PLACEMENT_WAVES = 6  # a placement's LoRA copies go in up to this many waves, in model order, each with its event:
#                     layer i computes while later waves land, for a handful of launches per wave
WAVE_BYTES = 16 << 20  # at least this much of an adapter a wave (~0.6 ms over PCIe): a smaller adapter's copy is too
#                        short to overlap layers with, and each wave costs the engine's thread its launches
WAVE_CACHE = 4096  # waves whose views are kept: (slot, adapter layout, wave) triples
REFUSED_OPTIONS = ("use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "target_parameters",
                   "layer_replication", "use_qalora", "bias")
PLAIN = (None, False, "none", [], {})  # what those fields hold in a plain LoRA config
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what an adapter's tensors may hold


# Where one layer's LoRA lies in its adapter's host buffer, a plain tuple (offset, rank, in_features, out_features,
# scale): A [rank, in] from element `offset`, B [out, rank] right after it (`HostAdapter.lora` makes the views).
# Plain numbers in a plain tuple, and a dict of those, are nothing the cyclic collector walks once it has seen them.
# As a dataclass holding two tensor views a layer was ~3 tracked objects: 10,000 adapters of 32 layers in the host
# tier made each full collection walk ~1 M more objects (~260 ms more on two CPU cores, the GIL held throughout, so
# the engine's thread stopped); with spans an adapter is ~4 (docs/PERFORMANCE.md section 12).
LoraSpan = tuple[int, int, int, int, float]
# A bottleneck's: (offset, size r, out_features, scale, act): down [r, out], down_bias [r], up [out, r], up_bias
# [out] one after another from `offset` (`HostAdapter.bottleneck`); act an index in kernels.bottleneck.ACTIVATIONS.
BottleneckSpan = tuple[int, int, int, float, int]


def lora_parts(span: LoraSpan) -> tuple[tuple[int, tuple[int, int]], tuple[int, tuple[int, int]]]:
    """Where A and B of the LoRA at `span` lie in its buffer (and in the staging buffer, which holds the buffer's
    layout): ((element offset, shape), ..) of A [rank, in], then of B [out, rank]."""
    offset, rank, in_features, out_features, _ = span
    return (offset, (rank, in_features)), (offset + rank * in_features, (out_features, rank))


def span_end(span: LoraSpan) -> int:
    """Where the LoRA at `span` ends in its buffer (elements)."""
    offset, rank, in_features, out_features, _ = span
    return offset + rank * (in_features + out_features)


def _view(buffer: torch.Tensor, at: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The `shape` tensor of `buffer` from element `at`."""
    return buffer[at:at + math.prod(shape)].view(shape)


class LoraLayout:
    """What a placement's views depend on: an adapter's layers and their ranks, ((layer id, rank), ..) in the
    model's order. Made when an adapter is read (off the engine's thread) and shared by adapters alike
    (`AdapterStore._layouts`); hashed once, since the placing caches are keyed by it (hashing the tuple of a Llama
    adapter's 112 layers costs ~2 us each time). `members`: the (pool id, member) pairs its layers fill, worked out
    at its first placement (a set of a Llama adapter's 112 pairs made at every placement cost the host 12-58 us)."""
    __slots__ = ("layers", "_hash", "members", "__weakref__")

    def __init__(self, layers: tuple):
        self.layers, self._hash, self.members = layers, hash(layers), None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, LoraLayout) and self._hash == other._hash
                                 and self.layers == other.layers)


@dataclass
class HostAdapter:
    """One adapter, checked, in host memory. `key` changes when its files change."""
    name: str
    key: tuple
    layers: dict[str, LoraSpan]  # base layer id -> its LoRA, in the model's order
    embedding: LoraSpan | None  # a [r, vocab], b [dim, r]
    nbytes: int = 0  # of its one host buffer
    bottlenecks: dict[str, BottleneckSpan] = field(default_factory=dict)  # base layer id -> its bottleneck
    # Its one host buffer: every layer's A then B in the model's order (a run of layers is one range of it), then
    # the embedding's and the bottlenecks' tensors; and every layer's scale, float32 [layers (+ embedding), 1]
    buffer: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    layout: LoraLayout | None = None

    def lora(self, span: LoraSpan) -> tuple[torch.Tensor, torch.Tensor]:
        """A [rank, in] and B [out, rank] of the LoRA at `span`: views of the buffer."""
        return tuple(_view(self.buffer, at, shape) for at, shape in lora_parts(span))

    def bottleneck(self, span: BottleneckSpan) -> tuple[torch.Tensor, ...]:
        """down [r, out], down_bias [r], up [out, r], up_bias [out] of the bottleneck at `span`: views of the
        buffer."""
        at, r, out, _, _ = span
        views = []
        for shape in ((r, out), (r,), (out, r), (out,)):
            views.append(_view(self.buffer, at, shape))
            at += math.prod(shape)
        return tuple(views)


@dataclass
class _Wave:
    """One wave of placing adapters of one layout into one slot (`AdapterStore._wave`): what to copy where."""
    copies: list[tuple[list, list]]  # (pool views, staging views): the dense ones, then the strided ones
    zeros: list  # pool rows beyond each layer's rank
    # the first wave's: every layer's scale and its staged value (a few bytes: two calls for all, with the first
    # wave, whose event and the later ones' all come after them)
    scale_targets: list
    scale_sources: list
    pools: list  # the pools written, each once
    span: tuple[int, int]  # where the wave's tensors are in an adapter's buffer (elements)
    # on a GPU, the wave's device copies (staging -> pools) recorded once as a CUDA graph, by whether they zero
    # the rows beyond each rank: replaying one costs the host ~30 us, where the fused copies over a wave's tens of
    # tensors cost it 40-60 us (H200, docs/PERFORMANCE.md section 12)
    graphs: dict = field(default_factory=dict)


class _Ready:
    """An event on the copy stream after a wave's copies (or an eviction's zeroing), shared by every pool they
    write: a step's stream waits for it once, at the first of those pools' layers, not once per pool (a wave of a
    Llama adapter on all seven projections is 5-8 pools a decoder layer; each wait costs the engine's thread ~10 us).
    """
    __slots__ = ("event", "waited")

    def __init__(self, stream: torch.cuda.Stream):
        self.event = torch.cuda.Event()
        self.event.record(stream)
        self.waited = False

    def wait(self, device: torch.device) -> None:
        if not self.waited:
            torch.cuda.current_stream(device).wait_event(self.event)
            self.waited = True


class _Copied:
    """Device pools that adapter copies write on the side stream."""
    ready: _Ready | None = None  # after the latest copy into these pools, until a step waits

    def wait(self, device: torch.device) -> None:
        """Make `device`'s current stream wait for the latest copy into these pools (once)."""
        if self.ready is not None:
            self.ready.wait(device)
            self.ready = None


@dataclass
class Pools(_Copied):
    """One layer's (or fused group's) LoRA pools, made when a first adapter targets it: a [S, G*R, in],
    b [S, out, R], scales float32 [S, G]. The engine's layers hold this object, so a pool made later is seen."""
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    ready: _Ready | None = None


@dataclass
class BottleneckPools(_Copied):
    """One layer's bottleneck pools (kernels/bottleneck.py): down [S, R, out], down_bias [S, R], up [S, out, R],
    up_bias [S, out], scales float32 [S], acts int32 [S]."""
    down: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    up: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    acts: torch.Tensor | None = None
    ready: _Ready | None = None


@dataclass
class Slot:
    adapter: HostAdapter
    users: int = 0
    members: set = field(default_factory=set)  # (pool id, member) that the adapter's layers fill


@dataclass
class TierStats:
    """Where adapters came from, counted since the store was made."""
    disk_reads: int = 0  # requests whose adapter was read from disk (first use, or evicted from host memory)
    host_hits: int = 0  # ... found in host memory
    device_hits: int = 0  # ... found in a device slot when the request was scheduled
    placements: int = 0  # copies from host memory into a slot


class AdapterStore:
    def __init__(self, modules: dict[str, BaseLayerSpec], embedding: tuple[str, int, int] | None, fingerprint: str,
                 device: torch.device, dtype: torch.dtype, max_rank: int = 64, slots: int = 8,
                 host_bytes: int = 4 << 30, vocabulary_weights: dict[str, torch.Tensor] | None = None,
                 groups: list[tuple[str, ...]] = (), device_bytes: int | None = None):
        """`modules`: module name -> base layer spec (in the model's order); `groups`: the layer ids of each fused
        group, in their order; `embedding`: (module name, vocab, dim) of the input embedding; `slots`: adapters on
        the device at once, or as many as `device_bytes` holds when given (each slot costs `slot_bytes`);
        `host_bytes`: the host tier's budget; `vocabulary_weights`: module name -> weight of the input embedding and
        the output head, which PEFT saves beside an adapter that targets them (accepted when they are the base
        model's own)."""
        self.vocabulary_weights = vocabulary_weights or {}
        if not 1 <= max_rank <= 1024 or host_bytes < 0:
            raise ValueError(f"max_rank must be in 1..1024 and host_bytes >= 0 (got {max_rank}, {host_bytes})")
        self.modules, self.embedding_module, self.fingerprint = modules, embedding, fingerprint
        self.specs = {spec.layer_id: spec for spec in modules.values()}  # layer id -> spec
        # layer id -> (pool id, member, first output row in the pool); pool id -> (in features, member widths)
        self.placement = {layer_id: (layer_id, 0, 0) for layer_id in self.specs}
        self.pool_shapes = {layer_id: (spec.in_features, (spec.out_features,)) for layer_id, spec in self.specs.items()}
        for group in groups:
            pool_id, first = GROUP_SEPARATOR.join(group), 0
            for member, layer_id in enumerate(group):
                self.placement[layer_id] = (pool_id, member, first)
                first += self.specs[layer_id].out_features
                del self.pool_shapes[layer_id]
            self.pool_shapes[pool_id] = (self.specs[group[0]].in_features,
                                         tuple(self.specs[layer_id].out_features for layer_id in group))
        self.device, self.dtype, self.max_rank, self.num_slots = device, dtype, max_rank, slots
        self.pools = {pool_id: Pools() for pool_id in self.pool_shapes}
        # bottlenecks go on the outputs of layers that share no input with a sibling (o_proj, down_proj)
        self.bottleneck_pools = {layer_id: BottleneckPools() for layer_id in self.specs if layer_id in self.pools}
        if device_bytes is not None:
            self.num_slots = slots = device_bytes // self.slot_bytes
        if slots < 1:
            raise ValueError(f"no adapter slot: {slots} slots" if device_bytes is None else
                             f"{device_bytes} bytes hold no adapter slot of {self.slot_bytes} bytes")
        self.embedding_pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.pools_version = 0  # how many pools have been made (a recorded decode graph reads those it saw)
        self._slots: OrderedDict[int, Slot] = OrderedDict()  # least recently used first
        self._by_key: dict[tuple, int] = {}
        self._host: OrderedDict[tuple, HostAdapter] = OrderedDict()  # least recently used first
        self._host_budget, self.host_bytes = host_bytes, 0
        self.stats = TierStats()
        self.layerwise = True  # False: a step waits for every pending copy before it starts (to measure prefetch)
        self.embedding_ready: _Ready | None = None  # as Pools.ready, for the embedding pool
        self._pending: list[_Copied] = []  # pools with a copy event since the last wait_all
        self._readers: dict[int, torch.cuda.Event] = {}  # slot -> recorded after the latest step queued that reads it
        # slots a placement failed in part way (freed, but holding what it and the evicted adapter left): every scale
        # in them is zeroed before the next placement there
        self._dirty: set[int] = set()
        self._lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._capture_stream = None  # where the waves' graphs are recorded (`_record`)
        self._rows_cache: dict[tuple, object] = {}  # (slot, layer id, rank) -> _rows; ("scale", slot, pool, member)
        self._waves: OrderedDict[tuple, _Wave] = OrderedDict()  # (slot, layout, wave) -> its lists, least recent first
        self._clears: OrderedDict[tuple, tuple] = OrderedDict()  # (slot, layout, bottlenecks) -> (scales, pools) to zero
        self._rows_version = 0
        self._layouts: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # layers -> LoraLayout, shared
        # where a placement's tensors land first, on the device: one host-to-device copy a wave, not one a tensor
        self._staging = torch.empty(0, device=device, dtype=dtype)
        self._staging_scales = torch.empty(0, 1, device=device, dtype=torch.float32)

    @property
    def host_budget(self) -> int:
        return self._host_budget

    @host_budget.setter
    def host_budget(self, budget: int) -> None:
        with self._lock:
            self._host_budget = budget
            self._trim_host()

    def _trim_host(self) -> None:
        while self.host_bytes > self._host_budget and self._host:  # the newest too, if it alone is over
            self.host_bytes -= self._host.popitem(last=False)[1].nbytes

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot once every LoRA and bottleneck pool exists (the input embedding's aside, made
        only for adapters that have embedding LoRA): what a slot costs at most."""
        r, size = self.max_rank, self.dtype.itemsize
        lora = sum((len(widths) * r * in_features + sum(widths) * r) * size + 4 * len(widths)
                   for in_features, widths in self.pool_shapes.values())
        bottleneck = sum((2 * r * out + r + out) * size + 8 for out in
                         (self.specs[layer_id].out_features for layer_id in self.bottleneck_pools))
        return lora + bottleneck

    def tiers(self) -> dict:
        """Each tier's occupancy and the hit counts (for /metrics and benchmarks)."""
        with self._lock:
            host = {"adapters": len(self._host), "bytes": self.host_bytes, "budget_bytes": self._host_budget}
        return {"device": {"slots": self.num_slots, "used": len(self._slots), "slot_bytes": self.slot_bytes},
                "host": host, **vars(self.stats)}

    # -- reading (any thread) --

    def load(self, name: str, directory: str | os.PathLike) -> HostAdapter:
        directory = Path(directory)
        try:  # the files as they are now: an adapter rewritten in place is read again
            key = (str(directory.resolve()),) + tuple((s.st_mtime_ns, s.st_size) for s in (
                (directory / "adapter_model.safetensors").stat(), (directory / "adapter_config.json").stat()))
        except OSError:
            key = None  # (check_adapter_directory says what is missing)
        with self._lock:
            if key in self._host:
                self._host.move_to_end(key)
                self.stats.host_hits += 1
                return self._host[key]
        directory = check_adapter_directory(directory)  # walked once, when read (not on every request)
        if key is None:
            raise AdapterError(f"{directory}: its adapter files changed while it was read")
        adapter = self._read(name, directory, key)
        with self._lock:
            self.stats.disk_reads += 1
            if key not in self._host:
                self._host[key] = adapter
                self.host_bytes += adapter.nbytes
            self._trim_host()
        return adapter

    def _read(self, name: str, directory: Path, key: tuple) -> HostAdapter:
        config = _read_config(directory / "adapter_config.json")
        check_base_fingerprint(directory, self.fingerprint)
        try:
            tensors = load_file(directory / "adapter_model.safetensors")
        except (SafetensorError, OSError, ValueError) as e:
            raise AdapterError(f"adapter {name!r}: adapter_model.safetensors is not a readable safetensors file ({e})") from e
        if config["peft_type"] == "BOTTLENECK":
            return self._pack(name, key, [], self._bottlenecks(name, tensors, config))
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, tensor in tensors.items():
            module = tensor_name.removeprefix(PREFIX).removesuffix(".base_layer.weight")
            if module in self.vocabulary_weights and tensor_name.endswith(".base_layer.weight"):
                self._check_saved_base(name, module, tensor)
                continue
            module, _, part = tensor_name.removeprefix(PREFIX).rpartition(".lora_")
            if not tensor_name.startswith(PREFIX) or part not in ("A.weight", "B.weight", "embedding_A", "embedding_B"):
                raise UnsupportedAdapter(f"adapter {name!r}: tensor {tensor_name!r} is not a LoRA A or B matrix; "
                                         + SPLIT_CLIENT_HINT)
            pairs.setdefault(module, {})[part] = tensor
        checked = []  # (module, embedded, a, b, scale)
        for module, parts in sorted(pairs.items()):
            embedded = "embedding_A" in parts or "embedding_B" in parts
            a, b = (parts.get("embedding_A"), parts.get("embedding_B")) if embedded else (parts.get("A.weight"), parts.get("B.weight"))
            if a is None or b is None or len(parts) != 2:
                raise AdapterError(f"adapter {name!r}: {module!r} lacks its LoRA A or B matrix")
            _check_dtypes(name, module, a, b)
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
                raise AdapterError(f"adapter {name!r}: {module!r} has LoRA matrices of shapes {list(a.shape)} and "
                                   f"{list(b.shape)}, which are not a rank-r pair")
            r = a.shape[0]
            if r > self.max_rank:
                raise AdapterError(f"adapter {name!r}: {module!r} has rank {r}, above this engine's limit of "
                                   f"{self.max_rank} (--max-lora-rank)")
            if embedded:
                if self.embedding_module is None or module != self.embedding_module[0]:
                    raise AdapterError(f"adapter {name!r}: {module!r} is not this base model's input embedding")
                expected = ([r, self.embedding_module[1]], [self.embedding_module[2], r])
            else:
                spec = self.modules.get(module)
                if spec is None:
                    raise AdapterError(f"adapter {name!r}: {module!r} is not a linear layer of this base model")
                expected = ([r, spec.in_features], [spec.out_features, r])
            if [list(a.shape), list(b.shape)] != list(expected):
                raise AdapterError(f"adapter {name!r}: {module!r} has LoRA matrices of shapes {list(a.shape)} and "
                                   f"{list(b.shape)}; this base model needs {expected[0]} and {expected[1]} "
                                   "(an adapter for another base model?)")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterError(f"adapter {name!r}: {module!r} holds NaN or Inf values")
            alpha = pattern_value(config["alpha_pattern"], module, config["lora_alpha"])
            scale = alpha / math.sqrt(r) if config["use_rslora"] else alpha / r
            checked.append((module, embedded, a, b, float(scale)))
        if not checked:
            raise AdapterError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA matrices")
        return self._pack(name, key, checked, {})

    def _pack(self, name: str, key: tuple, loras: list[tuple], bottlenecks: dict[str, tuple]) -> HostAdapter:
        """One host buffer for all of an adapter's tensors: one (pinned) allocation, so thousands of adapters
        cost thousands of allocations, not hundreds of thousands. `loras`: (module, embedded, a, b, scale);
        `bottlenecks`: layer id -> (down, down_bias, up, up_bias, scale, act)."""
        order = {layer_id: i for i, layer_id in enumerate(self.specs)}  # layers in the model's order, the embedding last
        loras = sorted(loras, key=lambda lora: len(order) if lora[1] else order[self.modules[lora[0]].layer_id])
        tensors = [t for _, _, a, b, _ in loras for t in (a, b)] + [t for b in bottlenecks.values() for t in b[:4]]
        buffer = torch.empty(sum(t.numel() for t in tensors), dtype=self.dtype, pin_memory=self.device.type == "cuda")
        offsets, at = [], 0
        for tensor in tensors:
            offsets.append(at)
            buffer[at:at + tensor.numel()].view(tensor.shape).copy_(tensor)
            at += tensor.numel()
        scales = torch.tensor([scale for *_, scale in loras], dtype=torch.float32).reshape(-1, 1)
        bottleneck_scales = torch.tensor([b[4] for b in bottlenecks.values()], dtype=self.dtype)
        # finite as read, yet maybe not in the engine's dtype (a float64 B of 1e200, a lora_alpha of 1e300)
        if not (torch.isfinite(buffer).all() and torch.isfinite(scales).all() and torch.isfinite(bottleneck_scales).all()):
            raise AdapterError(f"adapter {name!r}: values beyond the range of {str(self.dtype).removeprefix('torch.')}, "
                               "this engine's dtype (Inf once cast): its weights, alpha or scaling are too large")
        scales = scales.pin_memory() if self.device.type == "cuda" and len(loras) else scales
        layers, embedding = {}, None
        for index, (module, embedded, a, b, scale) in enumerate(loras):  # (A at offsets[2 * index], B after it)
            span = (offsets[2 * index], a.shape[0], a.shape[1], b.shape[0], scale)
            if embedded:
                embedding = span
            else:
                layers[self.modules[module].layer_id] = span
        placed = {layer_id: (offsets[2 * len(loras) + 4 * index], down.shape[0], down.shape[1], scale, act)
                  for index, (layer_id, (down, _, _, _, scale, act)) in enumerate(bottlenecks.items())}
        in_order = lambda found: {i: found[i] for i in self.specs if i in found}  # noqa: E731 -- the model's order
        layers = in_order(layers)
        return HostAdapter(name, key, layers, embedding, buffer.numel() * buffer.element_size(), in_order(placed),
                           buffer, scales, self._layout(tuple((i, span[1]) for i, span in layers.items())))

    def _layout(self, layers: tuple) -> LoraLayout:
        with self._lock:
            layout = self._layouts.get(layers)
            if layout is None:
                layout = self._layouts[layers] = LoraLayout(layers)
            return layout

    def _bottlenecks(self, name: str, tensors: dict[str, torch.Tensor], config: dict) -> dict[str, tuple]:
        """layer id -> (down [r, out], down_bias [r], up [out, r], up_bias [out], scale, act), checked."""
        from symbiosis.client.bottleneck import PARTS

        parts: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, tensor in tensors.items():
            module, _, part = tensor_name.removeprefix(PREFIX).rpartition(".bottleneck.")
            if not tensor_name.startswith(PREFIX) or part not in PARTS:
                raise AdapterError(f"adapter {name!r}: tensor {tensor_name!r} is not a bottleneck's down or up "
                                   "weight or bias")
            parts.setdefault(module, {})[part] = tensor
        checked = {}
        for module, found in sorted(parts.items()):
            spec = self.modules.get(module)
            if spec is None:
                raise AdapterError(f"adapter {name!r}: {module!r} is not a linear layer of this base model")
            if spec.layer_id not in self.bottleneck_pools:
                raise AdapterError(f"adapter {name!r}: {module!r} shares its input with sibling layers, which run "
                                   "fused; a bottleneck goes on a layer's output that no sibling shares (the "
                                   "attention's output projection, the MLP's)")
            if set(found) != set(PARTS):
                raise AdapterError(f"adapter {name!r}: {module!r} lacks its bottleneck's {sorted(set(PARTS) - set(found))}")
            _check_dtypes(name, module, *found.values())
            r, out = found["down.weight"].shape[0], spec.out_features
            shapes = {"down.weight": [r, out], "down.bias": [r], "up.weight": [out, r], "up.bias": [out]}
            if any(list(found[p].shape) != shapes[p] for p in PARTS):
                raise AdapterError(f"adapter {name!r}: {module!r}'s bottleneck tensors have shapes "
                                   f"{[list(found[p].shape) for p in PARTS]}; this base model needs "
                                   f"{[shapes[p] for p in PARTS]}")
            if r > self.max_rank:
                raise AdapterError(f"adapter {name!r}: {module!r} has a bottleneck of {r}, above this engine's limit "
                                   f"of {self.max_rank} (--max-lora-rank)")
            if not all(torch.isfinite(found[p]).all() for p in PARTS):
                raise AdapterError(f"adapter {name!r}: {module!r} holds NaN or Inf values")
            checked[spec.layer_id] = (*(found[p].to(self.dtype) for p in PARTS), config["scaling"], config["act"])
        if not checked:
            raise AdapterError(f"adapter {name!r}: adapter_model.safetensors holds no bottleneck")
        return checked

    def _check_saved_base(self, name: str, module: str, tensor: torch.Tensor) -> None:
        base = self.vocabulary_weights[module]
        if tensor.shape != base.shape or not torch.equal(tensor.to(base.device, base.dtype), base):
            raise UnsupportedAdapter(f"adapter {name!r} carries its own {module!r} weights (a resized or retrained "
                                     "vocabulary), not the base model's; " + SPLIT_CLIENT_HINT)

    # -- placing (the engine's thread) --

    def acquire(self, adapter: HostAdapter) -> int | None:
        """The slot holding `adapter`, pinned for one more user; placed now if it was not (evicting the least
        recently used unpinned adapter). None when every slot is pinned: the request waits."""
        slot = self._by_key.get(adapter.key)
        if slot is None:
            free = self._free_slot()
            if free is None:
                return None
            slot, evicted = free
            self._place(slot, adapter, evicted)
        else:
            self.stats.device_hits += 1
        entry = self._slots[slot]
        entry.users += 1
        self._slots.move_to_end(slot)
        return slot

    def placed(self, adapter: HostAdapter) -> bool:
        """Whether `adapter` is in a device slot now (a hint from any thread: the engine's may change it next)."""
        return adapter.key in self._by_key

    def release(self, slot: int) -> None:
        self._slots[slot].users -= 1

    def prefetch(self, adapters: list[HostAdapter], until=None) -> int:
        """Place the adapters of requests about to be admitted (in their order) while the step just launched runs,
        into free slots or those of unpinned adapters that none of them is (least recently used first): their
        copies and the host's issuing them then come before the next step's launch, not on its path. Nothing is
        pinned (admission's `acquire` finds them in their slots). `until()`, asked before each placement: stop.
        Returns how many were placed."""
        wanted, placed = {adapter.key for adapter in adapters}, 0
        for adapter in adapters:
            if adapter.key in self._by_key:
                continue
            if until is not None and until():
                break
            free = self._free_slot(keep=wanted)
            if free is None:
                break
            slot, evicted = free
            self._place(slot, adapter, evicted)
            placed += 1
        return placed

    def read_by(self, slots) -> None:
        """The steps queued so far on the current stream read `slots`: a placement into one of them waits for those
        steps (and for nothing else)."""
        if self._copy_stream is not None and slots:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            for slot in slots:
                self._readers[slot] = event

    def wait_all(self) -> None:
        """Make the current stream wait for every pending copy (before a step that cannot wait layer by layer)."""
        for pools in self._pending:  # those a layer already waited on are no-ops
            pools.wait(self.device)
        self._pending.clear()
        self.wait_embedding()

    def wait_embedding(self) -> None:
        if self.embedding_ready is not None:
            self.embedding_ready.wait(self.device)
            self.embedding_ready = None

    @property
    def resident(self) -> dict[str, int]:
        return {entry.adapter.name: slot for slot, entry in self._slots.items()}

    def _free_slot(self, keep: set = frozenset()) -> tuple[int, Slot | None] | None:
        """A slot to place into and the adapter evicted from it (None if it was empty; never one pinned or whose key
        is in `keep`); None if there is none."""
        if len(self._slots) < self.num_slots:
            return next(i for i in range(self.num_slots) if i not in self._slots), None
        for slot, entry in self._slots.items():  # least recently used first
            if entry.users == 0 and entry.adapter.key not in keep:
                del self._slots[slot], self._by_key[entry.adapter.key]
                return slot, entry
        return None

    def _clear(self, slot: int, evicted: Slot, adapter: HostAdapter, stream) -> None:
        """Zero the scales in `slot` of `evicted`'s layers that `adapter`, placed there next, does not write (they
        must add zero for it); on a GPU on the copy stream, the pools zeroed then waiting for it. An adapter of the
        evicted one's layout zeroes nothing: its own scales overwrite every one (a step reading the slot waits for
        them)."""
        self._fresh_views()
        key = (slot, evicted.adapter.layout, tuple(evicted.adapter.bottlenecks), adapter.layout,
               tuple(adapter.bottlenecks))  # what the members to zero depend on
        views = self._clears.get(key)
        if views is None:  # made once per slot and pair of layouts, as the waves' views (~1 us of CPU a member)
            written = {tuple(self.placement[layer_id][:2]) for layer_id in adapter.layers}
            written |= {(layer_id, "bottleneck") for layer_id in adapter.bottlenecks}
            scales, cleared = [], {}
            for pool_id, member in evicted.members - written:
                if member == "bottleneck":
                    pools = self.bottleneck_pools[pool_id]
                    scales.append(pools.scales[slot:slot + 1])
                else:
                    pools = self.pools[pool_id]
                    scales.append(self._scale_view(slot, pool_id, member))
                cleared[id(pools)] = pools
            views = self._clears[key] = (scales, list(cleared.values()))
            while len(self._clears) > WAVE_CACHE:
                self._clears.popitem(last=False)
        self._clears.move_to_end(key)
        scales, cleared = views
        if scales:
            torch._foreach_zero_(scales)
        embedding = evicted.adapter.embedding is not None and adapter.embedding is None
        if embedding:
            self.embedding_pool[2][slot] = 0.0
        if cleared or embedding:  # (a wave of this placement may set a later event: copy-stream order keeps both)
            self._ready_after(stream, cleared, embedding)

    def _pool(self, pool_id: str) -> Pools:
        pools = self.pools[pool_id]
        if pools.a is None:
            (in_features, widths), s, r = self.pool_shapes[pool_id], self.num_slots, self.max_rank
            pools.a = torch.zeros(s, len(widths) * r, in_features, device=self.device, dtype=self.dtype)
            pools.b = torch.zeros(s, sum(widths), r, device=self.device, dtype=self.dtype)
            pools.scales = torch.zeros(s, len(widths), device=self.device, dtype=torch.float32)
            self.pools_version += 1
        return pools

    def _bottleneck_pool(self, layer_id: str) -> BottleneckPools:
        pools = self.bottleneck_pools[layer_id]
        if pools.down is None:
            s, r, out = self.num_slots, self.max_rank, self.specs[layer_id].out_features
            zeros = lambda *shape, dtype=self.dtype: torch.zeros(*shape, device=self.device, dtype=dtype)  # noqa: E731
            pools.down, pools.down_bias, pools.up, pools.up_bias = zeros(s, r, out), zeros(s, r), zeros(s, out, r), \
                zeros(s, out)
            pools.scales, pools.acts = zeros(s, dtype=torch.float32), zeros(s, dtype=torch.int32)
            self.pools_version += 1
        return pools

    def _fresh_views(self) -> None:
        """Drop cached views once a pool is made (a view of an older pool may be stale)."""
        if self._rows_version != self.pools_version:
            self._rows_cache.clear()
            self._waves.clear()
            self._clears.clear()
            self._rows_version = self.pools_version

    def _rows(self, slot: int, layer_id: str, r: int) -> tuple:
        """Where a rank-r LoRA of `layer_id` goes in `slot`: (A rows [r, in], B columns [out, r], the rest of the
        slot's rows to zero); views made once (making a view costs microseconds of CPU, and a placement needs
        hundreds)."""
        key = (slot, layer_id, r)
        rows = self._rows_cache.get(key)
        if rows is None:
            pool_id, member, first = self.placement[layer_id]
            pools = self.pools[pool_id]
            a_rows = pools.a[slot, member * self.max_rank:(member + 1) * self.max_rank]     # [R, in]
            b_rows = pools.b[slot, first:first + self.specs[layer_id].out_features]         # [out, R]
            rest = [a_rows[r:], b_rows[:, r:]] if r < self.max_rank else []
            rows = self._rows_cache[key] = (a_rows[:r], b_rows[:, :r], rest)
        return rows

    def _scale_view(self, slot: int, pool_id: str, member: int) -> torch.Tensor:
        """A LoRA's scale in `slot` of its pool [1], made once."""
        key = ("scale", slot, pool_id, member)
        view = self._rows_cache.get(key)
        if view is None:
            view = self._rows_cache[key] = self.pools[pool_id].scales[slot, member:member + 1]
        return view

    def _wave(self, slot: int, adapter: HostAdapter, index: int, first: int, end: int) -> "_Wave":
        """The copies of layers first..end of `adapter` (a wave) into `slot`: from the staging buffers to the
        pools' rows, as views made once per (slot, layout, wave) and kept (least recently used out past
        WAVE_CACHE)."""
        key = (slot, adapter.layout, index)
        wave = self._waves.get(key)
        if wave is not None:
            self._waves.move_to_end(key)
            return wave
        dense, strided, zeros, pools = ([], []), ([], []), [], {}
        layers = list(adapter.layers.items())[first:end]
        for layer_id, span in layers:
            pool_id, member, _ = self.placement[layer_id]
            a_target, b_target, rest = self._rows(slot, layer_id, span[1])
            for target, (at, shape) in zip((a_target, b_target), lora_parts(span)):  # (the buffer's layout)
                group = dense if target.is_contiguous() else strided  # the fused copy takes dense tensors only
                group[0].append(target)
                group[1].append(_view(self._staging, at, shape))
            zeros += rest
            pools[pool_id] = self.pools[pool_id]
        buffer_range = (layers[0][1][0], span_end(layers[-1][1]))
        scale_targets, scale_sources = [], []
        if index == 0:
            for i, layer_id in enumerate(adapter.layers):
                scale_targets.append(self._scale_view(slot, *self.placement[layer_id][:2]))
                scale_sources.append(self._staging_scales[i])
        wave = self._waves[key] = _Wave([g for g in (dense, strided) if g[0]], zeros, scale_targets, scale_sources,
                                        list(pools.values()), buffer_range)
        while len(self._waves) > WAVE_CACHE:
            self._waves.popitem(last=False)
        return wave

    def _stage(self, adapter: HostAdapter) -> None:
        """Staging buffers large enough for `adapter` (made on the copy stream: only its copies use them)."""
        if self._staging.numel() < adapter.buffer.numel() or self._staging_scales.shape[0] < adapter.scales.shape[0]:
            self._staging = torch.empty(max(self._staging.numel(), adapter.buffer.numel()), device=self.device,
                                        dtype=self.dtype)
            self._staging_scales = torch.empty(max(self._staging_scales.shape[0], adapter.scales.shape[0]), 1,
                                               device=self.device, dtype=torch.float32)
            self._waves.clear()  # their sources were views of the old buffers

    def _place_wave(self, adapter: HostAdapter, wave: "_Wave", stream, zeroed: bool) -> None:
        """One wave of a placement: its range of the adapter's buffer to the device in one copy (the first wave
        every scale too), then from there to the pools (`_scatter`; on a GPU replayed from the wave's graph), then
        one event that the wave's pools wait on."""
        lo, hi = wave.span
        self._staging[lo:hi].copy_(adapter.buffer[lo:hi], non_blocking=True)
        if wave.scale_targets:
            self._staging_scales[:len(wave.scale_sources)].copy_(adapter.scales[:len(wave.scale_sources)],
                                                                 non_blocking=True)
        zero = bool(wave.zeros) and not zeroed
        if stream is None:
            _scatter(wave, zero)
        else:
            graph = wave.graphs.get(zero)
            if graph is None:
                graph = wave.graphs[zero] = self._record(wave, zero)
            graph.replay()
        self._ready_after(stream, wave.pools)  # (a fused group's pool once)

    def _record(self, wave: "_Wave", zero: bool) -> torch.cuda.CUDAGraph:
        """`_scatter(wave, zero)` recorded as a CUDA graph (on a stream of its own: nothing runs while recording;
        thread_local: the process's other threads go on launching their work meanwhile)."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._capture_stream):
            # no shared memory pool: the copies allocate nothing, and a shared pool dies with the last graph of it
            # (the waves' graphs are dropped with their views), after which recording into it fails
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                _scatter(wave, zero)
            finally:
                graph.capture_end()
        return graph

    def _place(self, slot: int, adapter: HostAdapter, evicted: Slot | None = None) -> None:
        """Copy `adapter` into `slot`'s rows of its pools, layer by layer in the model's order, after zeroing what
        `evicted` left there; on a GPU on the copy stream, each pool's copy followed by its `ready` event."""
        try:
            self._place_into(slot, adapter, evicted)
        except BaseException:
            self._dirty.add(slot)  # (it is free: `_free_slot` took it out before)
            raise

    def _zero_scales(self, slot: int, stream) -> None:
        """Every scale of `slot` zeroed (a failed placement's leftovers add nothing), its pools then waiting."""
        written = [pools for pools in self.pools.values() if pools.scales is not None] + \
            [pools for pools in self.bottleneck_pools.values() if pools.scales is not None]
        for pools in written:
            pools.scales[slot].zero_()
        if self.embedding_pool is not None:
            self.embedding_pool[2][slot] = 0.0
        self._ready_after(stream, written, self.embedding_pool is not None)

    def _ready_after(self, stream, pools: list, embedding: bool = False) -> None:
        """On a GPU, one event after what the copy stream was just given, which `pools` (and the embedding pool, if
        `embedding`) wait for at their next use (`_Copied.wait`, `wait_all`)."""
        if stream is None:
            return
        ready = _Ready(stream)
        for each in pools:
            each.ready = ready
        self._pending += pools
        if embedding:
            self.embedding_ready = ready

    def _place_into(self, slot: int, adapter: HostAdapter, evicted: Slot | None) -> None:
        stream = self._copy_stream
        reader = self._readers.pop(slot, None)
        if reader is not None:  # steps queued before may still read the slot's old adapter (engine.py overlaps)
            stream.wait_event(reader)
        self.stats.placements += 1
        self._pending = [pools for pools in self._pending if pools.ready is not None]  # eager steps waited on some
        # on the copy stream (set and put back directly: torch.cuda.stream()'s context costs the host ~15 us, most of
        # it finding the current device)
        previous = torch.cuda.current_stream(stream.device_index) if stream is not None else None
        if stream is not None:
            torch.cuda.set_stream(stream)
        try:
            members = self._place_on_stream(slot, adapter, evicted, stream)
        finally:
            if previous is not None:
                torch.cuda.set_stream(previous)
        self._slots[slot] = Slot(adapter, members=members)
        self._by_key[adapter.key] = slot

    def _place_on_stream(self, slot: int, adapter: HostAdapter, evicted: Slot | None, stream) -> frozenset:
        """`_place_into`'s work on the copy stream (`stream`; None: on the CPU, at once): the (pool id, member) pairs
        the adapter fills."""
        if slot in self._dirty:
            self._zero_scales(slot, stream)
            self._dirty.discard(slot)
        if evicted is not None:
            self._clear(slot, evicted, adapter, stream)
        members = self._members(adapter.layout) if adapter.layers else frozenset()
        if (slot, adapter.layout, 0) not in self._waves:  # (a cached wave: its pools were there, and still are)
            for layer_id in adapter.layers:  # every pool made first: making one drops the cached views
                self._pool(self.placement[layer_id][0])
        self._fresh_views()
        if adapter.layers:
            self._stage(adapter)
            # the rows beyond each layer's rank are zero already where the evicted adapter had this layout: its
            # own placement left them so (as every placement does), and nothing else writes a slot's rows
            zeroed = evicted is not None and evicted.adapter.layout == adapter.layout
            for index, (first, end) in enumerate(wave_bounds(len(adapter.layers), adapter.buffer.nbytes)):
                self._place_wave(adapter, self._wave(slot, adapter, index, first, end), stream, zeroed)
        for layer_id, span in adapter.bottlenecks.items():
            pools, (_, r, _, scale, act) = self._bottleneck_pool(layer_id), span
            down, down_bias, up, up_bias = adapter.bottleneck(span)
            for pool, tensor in ((pools.down[slot], down), (pools.down_bias[slot], down_bias)):
                pool[:r].copy_(tensor, non_blocking=True)
                pool[r:].zero_()
            pools.up[slot, :, :r].copy_(up, non_blocking=True)
            pools.up[slot, :, r:].zero_()
            pools.up_bias[slot].copy_(up_bias, non_blocking=True)
            pools.scales[slot], pools.acts[slot] = scale, act
            members = members | {(layer_id, "bottleneck")}
            self._ready_after(stream, [pools])
        if adapter.embedding is not None:
            if self.embedding_pool is None:
                _, vocab, dim = self.embedding_module
                self.embedding_pool = (torch.zeros(self.num_slots, vocab, self.max_rank, device=self.device, dtype=self.dtype),
                                       torch.zeros(self.num_slots, self.max_rank, dim, device=self.device, dtype=self.dtype),
                                       torch.zeros(self.num_slots, device=self.device, dtype=torch.float32))
                self.pools_version += 1
            a_pool, b_pool, scales = self.embedding_pool
            (a, b), (_, r, _, _, scale) = adapter.lora(adapter.embedding), adapter.embedding
            a_pool[slot, :, :r].copy_(a.t(), non_blocking=True)
            a_pool[slot, :, r:].zero_()
            b_pool[slot, :r].copy_(b.t(), non_blocking=True)
            b_pool[slot, r:].zero_()
            scales[slot] = scale
            self._ready_after(stream, [], embedding=True)
        return members

    def _members(self, layout: LoraLayout) -> frozenset:
        """The (pool id, member) pairs that adapters of `layout` fill (worked out once a layout)."""
        if layout.members is None:
            layout.members = frozenset(tuple(self.placement[layer_id][:2]) for layer_id, _ in layout.layers)
        return layout.members


def _scatter(wave: "_Wave", zero: bool) -> None:
    """A wave's device copies, from the staging buffers to the pools: each kind of tensor in one fused call (a copy
    or a launch per tensor would cost the host microseconds each, on the step's path), the rows beyond each layer's
    rank zeroed if `zero`."""
    if wave.scale_targets:
        torch._foreach_copy_(wave.scale_targets, wave.scale_sources)
    for targets, sources in wave.copies:
        torch._foreach_copy_(targets, sources)
    if zero:
        torch._foreach_zero_(wave.zeros)


def wave_bounds(count: int, nbytes: int) -> tuple[tuple[int, int], ...]:
    """A placement's waves over its `count` layers (in the model's order) of `nbytes`: (first, end) each. One per
    WAVE_BYTES, at most PLACEMENT_WAVES, with lengths in parts 1, 1, 2, 4, ..: each wave as long as all before it, so
    while it copies, the layers before it compute (a copy no slower than the layers it feeds is hidden but for the
    first wave), and the first is short (at 335 MB over 32 layers: 1, 1, 2, 4, 8, 16 layers). Worked out once per
    size (it is on every placement's path)."""
    return _wave_bounds(count, nbytes, PLACEMENT_WAVES, WAVE_BYTES)


@functools.lru_cache(maxsize=4096)
def _wave_bounds(count: int, nbytes: int, most: int, wave_bytes: int) -> tuple[tuple[int, int], ...]:
    waves = max(1, min(most, count, nbytes // wave_bytes))
    ends, parts = [], 1 << (waves - 1)
    for index in range(1, waves):
        share = round(count * (1 << (index - 1)) / parts)  # the parts of waves 0..index-1: 1, 2, 4, ..
        ends.append(min(max(share, (ends[-1] if ends else 0) + 1), count - (waves - index)))
    bounds = [0] + ends + [count]
    return tuple(zip(bounds[:-1], bounds[1:]))


def _check_dtypes(name: str, module: str, *tensors: torch.Tensor) -> None:
    """Floating-point tensors of the widths PEFT saves: integers or booleans would be cast into weights silently,
    and float8 has no finiteness check."""
    for tensor in tensors:
        if tensor.dtype not in FLOAT_DTYPES:
            raise AdapterError(f"adapter {name!r}: {module!r} holds {str(tensor.dtype).removeprefix('torch.')} "
                               "values; an adapter's tensors are float16, bfloat16, float32 or float64")


def _read_config(path: Path) -> dict:
    config = read_json(path, "a JSON adapter config")
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: not a JSON object")
    method = config.get("peft_type")
    if method == "BOTTLENECK":
        return _read_bottleneck_config(path, config)
    if method != "LORA":
        raise UnsupportedAdapter(f"{path}: a {method} adapter; " + SPLIT_CLIENT_HINT)
    for option in REFUSED_OPTIONS:
        if config.get(option) not in PLAIN:
            raise UnsupportedAdapter(f"{path}: LoRA with {option}={config[option]!r}; " + SPLIT_CLIENT_HINT)
    try:
        alpha = float(config.get("lora_alpha", 8))
        patterns = config.get("alpha_pattern") or {}
        if not isinstance(patterns, dict):
            raise TypeError("alpha_pattern is not an object")
        alpha_pattern = {k: float(v) for k, v in patterns.items()}
    except (TypeError, ValueError) as e:
        raise AdapterError(f"{path}: lora_alpha / alpha_pattern are not numbers ({e})") from e
    try:
        check_pattern_keys(alpha_pattern, "alpha_pattern")
    except ValueError as e:
        raise AdapterError(f"{path}: {e}") from None
    # (JSON as Python writes it holds NaN and Infinity)
    if not all(math.isfinite(value) for value in (alpha, *alpha_pattern.values())):
        raise AdapterError(f"{path}: lora_alpha / alpha_pattern must be finite")
    return {"peft_type": "LORA", "lora_alpha": alpha, "alpha_pattern": alpha_pattern,
            "use_rslora": bool(config.get("use_rslora", False))}


def _read_bottleneck_config(path: Path, config: dict) -> dict:
    """client/bottleneck.py's format: the activation (an index into ACTIVATIONS) and the scaling."""
    from symbiosis.kernels.bottleneck import ACTIVATIONS

    act, scaling = config.get("non_linearity", "relu"), config.get("scaling", 1.0)
    if act not in ACTIVATIONS:
        raise AdapterError(f"{path}: non_linearity {str(act)[:40]!r} is not one of {', '.join(ACTIVATIONS)}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise AdapterError(f"{path}: scaling must be a finite number")
    return {"peft_type": "BOTTLENECK", "act": ACTIVATIONS.index(act), "scaling": float(scaling)}
