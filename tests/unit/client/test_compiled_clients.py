"""In-process clients that run their executor's GEMMs themselves (alone, or under the `none` policy) can
go through torch.compile and be captured as CUDA graphs: the same training, with less Python per step."""

from __future__ import annotations

import gc
import math
from functools import partial

import pytest
import torch
from peft import get_peft_model, get_peft_model_state_dict

import symbiosis
from symbiosis.errors import SymbiosisError
from helpers import assert_close, batch
from matrix import make_checkpoint, peft_config


def _client(path, executor, device="cpu", seed=1234):
    torch.manual_seed(seed)
    model = get_peft_model(symbiosis.from_pretrained(path, executor, device=device), peft_config("lora", "llama"))
    return model.train()


def _step(model, optimizer, ids, loss_fn=None) -> torch.Tensor:
    """One AdamW step on ids (as labels too), with transformers' loss or loss_fn(input_ids=, labels=)."""
    loss = loss_fn(input_ids=ids, labels=ids) if loss_fn else model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _adam(model, **options):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, **options)


def test_compiled_client_equals_compiled_plain_peft(tmp_path):
    """torch.compile traces a direct client's GEMMs with its own ops (and its tied embedding, the executor's
    tensor) in one graph; it computes what the compiled plain model computes (float64: compiling changes
    rounding alike on both sides)."""
    path, auto_class = tmp_path, make_checkpoint("llama", tmp_path, tie_word_embeddings=True)
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy="none")
    executor.attach(executor.fingerprint, "bystander")  # direct under `none` however many are attached
    split = _client(path, executor)
    torch.manual_seed(1234)
    plain = get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64), peft_config("lora", "llama")).train()
    inputs = batch("llama")
    outputs = [torch.compile(model)(**inputs) for model in (split, plain)]
    for out in outputs:
        out.loss.backward()
    assert_close(outputs[0].logits, outputs[1].logits, "logits")
    plain_grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    for name, param in split.named_parameters():
        if param.requires_grad:
            assert_close(param.grad, plain_grads[name], name)
    assert executor.stats_snapshot()["overall"]["calls"] == 0  # traced calls are not counted (see direct())


def test_compiled_chunked_loss_equals_compiled_plain_peft(tmp_path):
    """causal_lm_loss compiles into one graph (fullgraph: no break) with a direct client's GEMMs, the loss's
    included, and computes what it computes on the compiled plain model."""
    path, auto_class = tmp_path, make_checkpoint("llama", tmp_path, tie_word_embeddings=True)
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy="none")
    torch.manual_seed(1234)
    plain = get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64), peft_config("lora", "llama")).train()
    models = (_client(path, executor), plain)
    inputs = batch("llama")
    losses = [torch.compile(partial(symbiosis.causal_lm_loss, model, chunk_tokens=7), fullgraph=True)(**inputs)
              for model in models]
    for loss in losses:
        loss.backward()
    assert_close(losses[0], losses[1], "loss")
    plain_grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    for name, param in models[0].named_parameters():
        if param.requires_grad:
            assert_close(param.grad, plain_grads[name], name)


def test_captured_step_refuses_what_cannot_be_captured(checkpoints):
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    model = _client(path, executor)
    ids = batch("llama")["input_ids"]
    with pytest.raises(SymbiosisError, match="capturable=True"):
        symbiosis.CapturedStep(lambda x: x, ids, optimizer=_adam(model))
    with pytest.raises(SymbiosisError, match="CUDA device"):
        symbiosis.CapturedStep(lambda x: x, ids, optimizer=_adam(model, capturable=True))


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["transformers", "compiled_chunked"])
def test_captured_step_trains_as_the_eager_step(checkpoints, loss):
    """Replaying a captured step is the eager step: the warm-up runs leave the model and optimizer as they
    were, and each replay takes the new batch. Also with what the 8-tenant benchmark replays:
    causal_lm_loss through torch.compile (against the eager step with transformers' loss)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.float32, policy="none")
    # No attention mask: transformers decides on the CPU whether a given mask can be skipped.
    batches = [batch("llama", seed=s)["input_ids"].cuda() for s in range(4)]
    eager, captured = _client(path, executor, "cuda"), _client(path, executor, "cuda")
    eager_optimizer, captured_optimizer = _adam(eager, capturable=True), _adam(captured, capturable=True)
    loss_fn = None if loss == "transformers" else \
        torch.compile(partial(symbiosis.causal_lm_loss, captured, chunk_tokens=7), fullgraph=True)
    step = symbiosis.CapturedStep(lambda ids: _step(captured, captured_optimizer, ids, loss_fn),
                                  batches[0], optimizer=captured_optimizer)
    for ids in batches:
        expected = _step(eager, eager_optimizer, ids)
        assert_close(step(ids).detach().clone(), expected.detach(), "loss", rtol=1e-5)
    with pytest.raises(symbiosis.BadCall, match="captured for inputs of shapes"):
        step(batches[0][:1])  # one row of the captured three: copying it in would broadcast silently
    ours, theirs = get_peft_model_state_dict(captured), get_peft_model_state_dict(eager)
    for name, value in theirs.items():
        assert_close(ours[name], value, name, rtol=1e-5)


@pytest.mark.gpu
def test_a_captured_step_keeps_what_it_reads_alive(checkpoints):
    """The graph reads the model's and the optimizer's memory by address: a step whose caller keeps neither
    must keep both, or their memory is freed under it (and handed back to the driver by empty_cache)."""
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.float32, policy="none")
    ids = batch("llama")["input_ids"].cuda()

    def captured_step():
        model = _client(path, executor, "cuda")
        optimizer = _adam(model, capturable=True)
        return symbiosis.CapturedStep(lambda x: _step(model, optimizer, x), ids,
                                      optimizer=optimizer)

    steps = [captured_step() for _ in range(2)]
    gc.collect()
    torch.cuda.empty_cache()
    losses = [step(ids).item() for step in steps for _ in range(2)]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[1] < losses[0] and losses[3] < losses[2]  # each replay trains its own client

