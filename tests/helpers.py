"""What many tests share: batches, comparisons, pairs of a plain and a split model trained side by side,
and executor and tenant processes (tests/matrix.py says which architectures and methods)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import peft
import pytest
import torch
from peft import get_peft_model, get_peft_model_state_dict

import symbiosis
from matrix import SEQ_CLS, VOCAB, peft_config

RTOL = 1e-9
# transformers' eager Gemma2 attention yields NaN for a whole left-padded row in float64 (plain model too).
NAN_WHEN_PADDED_IN_FP64 = {"gemma2"}


def batch(arch: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    if arch not in NAN_WHEN_PADDED_IN_FP64:
        mask[0, :3] = 0  # left padding in one row: masks must flow through the split model too
    labels = torch.randint(0, 3, (3,), generator=g) if arch in SEQ_CLS else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


ATOL = 1e-14  # float64 rounding of a quantity that is zero in exact arithmetic (a key bias's gradient: softmax
# ignores a shift shared by all keys), where a relative error means nothing; the tensors here are of order 1


def assert_close(ours: torch.Tensor, reference: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    assert ours.shape == reference.shape, what
    assert not reference.isnan().any(), f"{what}: the reference itself is NaN"
    scale = reference.abs().max().item()
    err = (ours - reference).abs().max().item()
    assert err <= max(rtol * scale, ATOL), f"{what}: max abs error {err:.3e}, scale {scale:.3e}"


def build_pair(arch, method, checkpoints, executors, make_config=None, prepare=None, base_config=None):
    """(reference PeftModel on the full model, symbiosis PeftModel on the split model), same adapter init.
    `make_config` (default: the core method's), `prepare(peft_model)`, `base_config`: model config settings."""
    make_config = make_config or (lambda: peft_config(method, arch))
    path, auto_class = checkpoints(arch)
    reference = auto_class.from_pretrained(path, dtype=torch.float64)
    split = symbiosis.from_pretrained(path, executors(arch), auto_class=auto_class, dtype=torch.float64)
    models = []
    for model in (reference, split):
        for key, value in (base_config or {}).items():
            setattr(model.config, key, value)
        torch.manual_seed(1234)
        model = get_peft_model(model, make_config())
        if prepare is not None:
            prepare(model)
        models.append(model)
    return tuple(models)


def assert_trains_as_plain_peft(reference, split, arch: str, extra=lambda batch: {}, rtol: float = RTOL) -> None:
    """One training step (logits, loss, every trainable gradient), then three AdamW steps (the adapters)."""
    for model in (reference, split):
        model.train()
    ref_out, our_out = train_step(reference, arch, 0, extra), train_step(split, arch, 0, extra)
    assert_close(our_out.logits, ref_out.logits, "logits", rtol)
    assert_close(our_out.loss, ref_out.loss, "loss", rtol)
    ref_params = dict(reference.named_parameters())
    trainable = [(n, p) for n, p in split.named_parameters() if p.requires_grad]
    assert trainable and {n for n, _ in trainable} == {n for n, p in ref_params.items() if p.requires_grad}
    for name, param in trainable:
        assert (param.grad is None) == (ref_params[name].grad is None), f"gradient of {name} reached one side only"
        if param.grad is not None:
            assert_close(param.grad, ref_params[name].grad, f"grad of {name}", rtol)
    assert any(p.grad is not None and p.grad.abs().max() > 0 for _, p in trainable), "no adapter gradient at all"

    adalora = isinstance(split.peft_config[split.active_adapter], peft.AdaLoraConfig)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                  for m in (reference, split)]
    for step in range(3):
        for model, optimizer in zip((reference, split), optimizers):
            if step:
                train_step(model, arch, step, extra)
            optimizer.step()
            if adalora:  # AdaLoRA reallocates ranks after each step
                model.base_model.update_and_allocate(step)
            optimizer.zero_grad()
    ours, theirs = get_peft_model_state_dict(split), get_peft_model_state_dict(reference)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert_close(ours[key], theirs[key], f"adapter tensor {key} after 3 AdamW steps", rtol)


def assert_same_step_on(path, auto_class, sources: list, method: str = "lora", arch: str = "llama",
                        rtol: float = 0.0) -> None:
    """A split model's LoRA training step on each executor in `sources` (in-process, remote, sharded...): the same
    logits, loss and adapter gradients, to the bit (`rtol` 0), or within float64 rounding."""
    results = []
    for source in sources:
        model = symbiosis.from_pretrained(path, source, auto_class=auto_class, dtype=torch.float64)
        torch.manual_seed(1234)
        model = get_peft_model(model, peft_config(method, arch))
        model.train()
        out = model(**batch(arch))
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
        model.base_model.model.symbiosis_session.close()
    (reference, reference_grads), *others = results
    same = (lambda ours, theirs, what: torch.equal(ours, theirs) or pytest.fail(what)) if rtol == 0 else \
        (lambda ours, theirs, what: assert_close(ours, theirs, what, rtol))
    for out, grads in others:
        same(out.logits, reference.logits, "logits")
        same(out.loss, reference.loss, "loss")
        assert grads.keys() == reference_grads.keys()
        for name, grad in reference_grads.items():
            same(grads[name], grad, f"gradient of {name}")


def train_step(model, arch: str, step: int, extra=lambda batch: {}) -> torch.Tensor:
    torch.manual_seed(100 + step)  # identical dropout masks on both sides
    inputs = batch(arch, seed=step)
    out = model(**inputs, **extra(inputs))
    out.loss.backward()
    return out


def saved_for_backward(model, arch: str):
    """(output of a training forward, bytes of the tensors autograd saved for backward meanwhile)."""
    saved = 0

    def count(tensor):
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    torch.manual_seed(100)
    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        out = model(**batch(arch))
    return out, saved


# --- processes ------------------------------------------------------------------------------------------

HERE = Path(__file__).parent
TOKEN = "fault-test-token"


class ExecutorLog:
    """What an executor says it did ("serving", "attached X", "detached X"), line by line, for tests to wait on
    instead of sleeping or polling its stats: an executor process's stderr (echoed to ours), or the log of
    one in this process."""

    def __init__(self):
        self.lines: list[str] = []
        self.ended = False
        self._changed = threading.Condition()

    @classmethod
    def reading(cls, stream) -> "ExecutorLog":
        said = cls()
        threading.Thread(target=said._read, args=(stream,), daemon=True, name="executor-log").start()
        return said

    @classmethod
    @contextlib.contextmanager
    def listening(cls, name: str = "symbiosis.executor"):
        said, logger, handler = cls(), logging.getLogger(name), logging.Handler(logging.INFO)
        handler.emit = lambda record: said._add(record.getMessage())
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            yield said
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)

    def _read(self, stream) -> None:
        for line in stream:
            sys.stderr.write(line)
            self._add(line)
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def _add(self, line: str) -> None:
        with self._changed:
            self.lines.append(line)
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 20.0) -> str:
        """The first line matching `pattern`, once the executor has written it; fails after `timeout` seconds or
        when the executor's stderr ends without it."""
        regex = re.compile(pattern)

        def found():
            return next((line for line in self.lines if regex.search(line)), None)

        with self._changed:
            self._changed.wait_for(lambda: found() is not None or self.ended, timeout)
            line = found()
        assert line is not None, f"the executor never said {pattern!r} ({'exited' if self.ended else 'timed out'})"
        return line


def start_executor(model_dir, url, tmp_path, policy="opportunistic", client_timeout=2.0, device="cpu",
                   dtype="float64", tenants: dict[str, str] | None = None, *extra: str,
                   descriptors: int | None = None) -> subprocess.Popen:
    """An executor process, returned once it serves, its stderr in `.log` (an ExecutorLog); `tenants`
    (name -> token) beside the admin, whose token is TOKEN; `descriptors`: its hard limit of open files."""
    token_file = tmp_path / "tenants"
    token_file.write_text("".join(f"{name} {token}\n" for name, token in {"admin": TOKEN, **(tenants or {})}.items()))
    process = subprocess.Popen([sys.executable, "-m", "symbiosis.cli", "executor", "--model", str(model_dir),
                                "--listen", url, "--device", device, "--dtype", dtype, "--policy", policy,
                                "--max-wait-ms", "50", "--client-timeout", str(client_timeout),
                                "--token-file", str(token_file), *extra], stderr=subprocess.PIPE, text=True,
                               preexec_fn=None if descriptors is None else partial(
                                   resource.setrlimit, resource.RLIMIT_NOFILE, (descriptors, descriptors)))
    process.log = ExecutorLog.reading(process.stderr)
    try:
        process.log.wait_for(r"^\[executor\] serving ", timeout=90)
    except AssertionError:
        process.kill()
        raise
    return process


def start_tenant(model_dir, url, method, seed, out, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "tenant_process.py"), str(model_dir), url, TOKEN, method,
                             str(seed), str(out), *extra], env={**os.environ, "OMP_NUM_THREADS": "1"})


class StalledGroup:
    """A client's process group whose sends never go (the header does, the tensor never), around the real one,
    which still posts the result's receive (and aborts): a tenant that stalls mid-call."""

    def __init__(self, group):
        self.group = group

    def send(self, tensors, dst, tag):
        return self

    def recv(self, tensors, src, tag):
        return self.group.recv(tensors, src, tag)

    def wait(self):
        return True

    def abort(self):
        self.group.abort()
