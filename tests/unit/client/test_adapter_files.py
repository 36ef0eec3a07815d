"""Adapters trained through symbiosis are ordinary PEFT files, and the reverse; adapter directories are read
from safetensors only, and nothing in the package can unpickle a file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import save_file

import symbiosis
from symbiosis.client.generate import load_adapter
from helpers import assert_close, batch
from matrix import peft_config

METHODS = ["lora", "ia3", "prompt", "prefix", "loha", "dora"]
PACKAGE = Path(symbiosis.__file__).parent


def _train(model, arch, steps=2):
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        model(**batch(arch, seed=step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.mark.parametrize("method", METHODS)
def test_symbiosis_adapter_loads_in_plain_peft_and_back(method, checkpoints, tmp_path):
    arch = "llama"
    path, auto_class = checkpoints(arch)
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    probe = batch(arch, seed=9)

    # symbiosis -> plain PEFT
    split = _train(get_peft_model(symbiosis.from_pretrained(path, executor, auto_class=auto_class),
                                  peft_config(method, arch)), arch)
    split.save_pretrained(tmp_path / "ours")
    assert (tmp_path / "ours" / "adapter_config.json").is_file()
    assert (tmp_path / "ours" / "adapter_model.safetensors").is_file()
    plain = PeftModel.from_pretrained(auto_class.from_pretrained(path, dtype=torch.float64), tmp_path / "ours")
    with torch.no_grad():
        assert_close(plain(**probe).logits, split(**probe).logits, "plain PEFT on symbiosis' adapter")

    # plain PEFT -> symbiosis
    reference = _train(get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64),
                                      peft_config(method, arch)), arch)
    reference.save_pretrained(tmp_path / "theirs")
    loaded = PeftModel.from_pretrained(symbiosis.from_pretrained(path, executor, auto_class=auto_class),
                                       tmp_path / "theirs")
    with torch.no_grad():
        assert_close(loaded(**probe).logits, reference(**probe).logits, "symbiosis on plain PEFT's adapter")


def test_sequence_classification_head_trained_via_modules_to_save(checkpoints, tmp_path):
    """SEQ_CLS makes PEFT train a copy of the classifier, a base layer: the copy is a real client layer."""
    path, auto_class = checkpoints("bert")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    split = _train(get_peft_model(symbiosis.from_pretrained(path, executor, auto_class=auto_class),
                                  peft_config("lora", "bert")), "bert")
    trained_head = split.base_model.model.classifier.modules_to_save["default"]
    assert type(trained_head) is torch.nn.Linear and trained_head.weight.requires_grad
    split.save_pretrained(tmp_path / "cls")
    plain = PeftModel.from_pretrained(auto_class.from_pretrained(path, dtype=torch.float64), tmp_path / "cls")
    probe = batch("bert", seed=3)
    with torch.no_grad():
        assert_close(plain(**probe).logits, split(**probe).logits, "classifier logits")


def _pickled_adapters(checkpoints, tmp_path) -> dict[str, Path]:
    """Adapter directories that each hold a pickle somewhere, beside a good config."""
    path, auto_class = checkpoints("llama")
    good = tmp_path / "good"
    get_peft_model(auto_class.from_pretrained(path), peft_config("lora", "llama")).save_pretrained(good)
    made = {}
    for name, build in {
        "bin only": lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"),
        "pt beside safetensors": lambda d: (d / "extra.pt").write_bytes(b"\x80\x04K\x01."),
        "zip under another name": lambda d: (d / "weights.data").write_bytes(b"PK\x03\x04rest"),
        "raw pickle in a subdirectory": lambda d: ((d / "sub").mkdir(), (d / "sub" / "state").write_bytes(b"\x80\x02}q\x00.")),
    }.items():
        directory = tmp_path / name.replace(" ", "_")
        directory.mkdir()
        for file in good.iterdir():
            (directory / file.name).write_bytes(file.read_bytes())
        build(directory)
        made[name] = directory
    return made


def test_an_adapter_directory_holding_a_pickle_is_refused_everywhere(checkpoints, tmp_path, monkeypatch):
    """PEFT's and transformers' loaders fall back to `adapter_model.bin`; on a split model every entry point
    refuses a directory with a pickle in it before anything reads it, and says to convert it."""
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    for name, directory in _pickled_adapters(checkpoints, tmp_path).items():
        loaders = {
            "PeftModel.from_pretrained": lambda: PeftModel.from_pretrained(
                symbiosis.from_pretrained(path, executor, auto_class=auto_class), directory),
            "PeftModel.load_adapter": lambda: get_peft_model(
                symbiosis.from_pretrained(path, executor, auto_class=auto_class), peft_config("lora", "llama"),
            ).load_adapter(directory, adapter_name="second"),
            "transformers' load_adapter": lambda: symbiosis.from_pretrained(
                path, executor, auto_class=auto_class).load_adapter(directory),
            "symbiosis load_adapter": lambda: load_adapter(
                symbiosis.from_pretrained(path, executor, auto_class=auto_class), directory),
        }
        for loader, load in loaders.items():
            try:
                load()
            except symbiosis.AdapterError as e:
                assert "a pickle" in str(e) and "convert it" in str(e), f"{loader} on {name}: {e}"
            else:
                pytest.fail(f"{loader} loaded an adapter directory with {name}")


def test_a_safetensors_adapter_still_loads_with_the_check(checkpoints, tmp_path):
    path, auto_class = checkpoints("llama")
    reference = get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64), peft_config("lora", "llama"))
    reference.save_pretrained(tmp_path)
    save_file({"x": torch.zeros(1)}, tmp_path / "unrelated.safetensors")  # safetensors is never a pickle
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    loaded = PeftModel.from_pretrained(symbiosis.from_pretrained(path, executor, auto_class=auto_class), tmp_path)
    probe = batch("llama", seed=4)
    with torch.no_grad():
        assert_close(loaded(**probe).logits, reference(**probe).logits, "logits")


UNPICKLERS = {"torch.load", "torch.serialization.load", "torch.jit.load", "pickle.load", "pickle.loads",
              "pickle.Unpickler", "numpy.load", "np.load", "joblib.load", "dill.load", "dill.loads",
              "marshal.load", "marshal.loads", "shelve.open"}
UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "joblib", "shelve", "marshal"}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def test_nothing_in_the_package_can_unpickle():
    """No call of torch.load (or any unpickler), no import of a pickling module, anywhere in src/symbiosis."""
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            if isinstance(node, (ast.Attribute, ast.Name)) and _dotted(node) in UNPICKLERS:
                found.append(f"{file.relative_to(PACKAGE)}:{node.lineno}: {_dotted(node)}")
            elif isinstance(node, ast.Import):
                found += [f"{file.relative_to(PACKAGE)}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] in UNPICKLING_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLING_MODULES | {"torch"}:
                names = {f"{node.module}.{a.name}" for a in node.names}
                if node.module.split(".")[0] in UNPICKLING_MODULES or names & UNPICKLERS or \
                        any(a.name == "load" for a in node.names):
                    found.append(f"{file.relative_to(PACKAGE)}:{node.lineno}: from {node.module} import ...")
    assert len(list(PACKAGE.rglob("*.py"))) > 20  # the scan saw the package
    assert not found, "unpickling code in the package:\n" + "\n".join(found)


def test_pattern_keys_are_module_names_matched_as_peft_matches_them():
    import random

    from peft.utils.other import get_pattern_key

    from symbiosis.client.adapter_files import check_pattern_keys, pattern_value

    for hostile in ("(.|.)*Z", "q_proj(", ".*", "a" * 257, ""):
        with pytest.raises(ValueError, match="not a module name"):
            check_pattern_keys({hostile: 1.0}, "alpha_pattern")
    with pytest.raises(ValueError, match="more than 1024 keys"):
        check_pattern_keys({f"layers.{i}.q_proj": 1.0 for i in range(1025)}, "alpha_pattern")
    modules = [f"model.layers.{i}.{part}" for i in (0, 1, 10, 11) for part in
               ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj", "mlp.up_proj")]
    pieces = ["q_proj", "v_proj", "down_proj", "self_attn", "mlp", "layers", "1", "10", "model", "q.proj", "mlp.up.proj",
              "x_proj", "0", "layers.1", "s.lf_attn", "."]
    generator = random.Random(0)
    for _ in range(2000):
        keys = [".".join(generator.sample(pieces, generator.randint(1, 3))) for _ in range(generator.randint(1, 4))]
        patterns = {key: float(i + 1) for i, key in enumerate(keys)}
        check_pattern_keys(patterns, "alpha_pattern")
        for module in modules:
            assert pattern_value(patterns, module, 0.0) == patterns.get(get_pattern_key(patterns.keys(), module), 0.0), \
                (patterns, module)
