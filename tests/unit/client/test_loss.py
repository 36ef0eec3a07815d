"""symbiosis.causal_lm_loss: transformers' causal-LM loss (and every adapter gradient) without whole logits."""

from __future__ import annotations

import peft
import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model

import symbiosis
from helpers import assert_close, batch, build_pair
from matrix import VOCAB, peft_config

CAUSAL_ARCHS = ["llama", "gpt2", "gpt_bigcode", "gemma2", "granite", "qwen2", "opt"]


def reference_loss(model, inputs: dict) -> torch.Tensor:
    """Cross-entropy of the whole float64 logits (transformers' own loss upcasts to float32 only)."""
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), inputs["labels"][:, 1:].reshape(-1))


def trained_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_chunked_loss_equals_the_whole_logits_loss(arch, checkpoints, executors):
    """Split and plain models alike: chunks of 7 tokens (the batch has 30, 3 rows of them ignored) give the
    loss of the whole logits and the same adapter gradients, through Gemma-2's softcap and Granite's scale."""
    reference, split = build_pair(arch, "lora", checkpoints, executors)
    inputs = batch(arch)
    expected = reference_loss(reference, inputs)
    expected.backward()
    expected_grads = trained_grads(reference)
    transformers_loss = reference(**inputs).loss
    for model in (split, reference):
        model.zero_grad(set_to_none=True)
        loss = symbiosis.causal_lm_loss(model, chunk_tokens=7, **inputs)
        loss.backward()
        assert_close(loss, expected, "loss")
        assert_close(loss, transformers_loss.double(), "transformers' loss", rtol=1e-6)
        for name, grad in trained_grads(model).items():
            assert_close(grad, expected_grads[name], name)


@pytest.mark.parametrize("head", ["lora_on_lm_head", "modules_to_save"])
def test_a_trained_head_goes_through_checkpointed_chunks(head, checkpoints):
    """A head with trained weights cannot take the frozen-head path: each chunk is checkpointed, and the
    head's own gradients (LoRA's, or the trained copy's) come out as autograd's. One client: direct path."""
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    if head == "lora_on_lm_head":
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    else:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                 init_lora_weights=False)
    models = []
    for base in (symbiosis.from_pretrained(path, executor, dtype=torch.float64),
                 auto_class.from_pretrained(path, dtype=torch.float64)):
        torch.manual_seed(1234)
        models.append(get_peft_model(base, config))
    split, reference = models
    inputs = batch("llama")
    expected = reference_loss(reference, inputs)
    expected.backward()
    loss = symbiosis.causal_lm_loss(split, chunk_tokens=4, **inputs)
    loss.backward()
    assert_close(loss, expected, "loss")
    expected_grads = trained_grads(reference)
    assert any("lm_head" in name for name in expected_grads)
    for name, grad in trained_grads(split).items():
        assert_close(grad, expected_grads[name], name)


def test_no_tensor_of_vocabulary_width_is_kept_for_backward(checkpoints, executors):
    """What autograd saves from the loss is [tokens, hidden] at most: no logits, no softmax."""
    _, split = build_pair("llama", "lora", checkpoints, executors)
    inputs = batch("llama")
    widths: list[int] = []

    def pack(tensor):
        widths.append(tensor.shape[-1] if tensor.dim() else 0)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        symbiosis.causal_lm_loss(split, **inputs)
    assert widths and VOCAB not in widths
    widths.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        split(**inputs)  # transformers' loss keeps log-softmax [tokens, vocab]: the check can see it
    assert VOCAB in widths


def test_sum_over_num_items_and_evaluation_without_grad(checkpoints, executors):
    reference, split = build_pair("llama", "lora", checkpoints, executors)
    inputs = batch("llama")
    counted = (inputs["labels"][:, 1:] != -100).sum()
    with torch.no_grad():
        expected = reference_loss(reference, inputs) * counted / 50
        loss = symbiosis.causal_lm_loss(split, num_items_in_batch=50, **inputs)
    assert not loss.requires_grad
    assert_close(loss, expected, "loss / num_items_in_batch")


def test_what_it_cannot_compute_is_refused(checkpoints, executors):
    _, prompt_tuned = build_pair("llama", "prompt", checkpoints, executors)
    with pytest.raises(symbiosis.UnsupportedAdapter, match="PROMPT_TUNING"):
        symbiosis.causal_lm_loss(prompt_tuned, **batch("llama"))
    path, auto_class = checkpoints("bert")
    with pytest.raises(symbiosis.UnsupportedAdapter, match="'bert'"):
        symbiosis.causal_lm_loss(auto_class.from_pretrained(path), **batch("llama"))
    with pytest.raises(TypeError, match="labels"):
        symbiosis.causal_lm_loss(prompt_tuned, input_ids=batch("llama")["input_ids"])
    _, split = build_pair("llama", "lora", checkpoints, executors)
    inputs = batch("llama")
    with pytest.raises(symbiosis.BadCall, match="labels of shape"):
        symbiosis.causal_lm_loss(split, input_ids=inputs["input_ids"], labels=inputs["labels"][:, 1:])
    with pytest.raises(symbiosis.BadCall, match="chunk_tokens"):
        symbiosis.causal_lm_loss(split, chunk_tokens=0, **inputs)


def test_a_frozen_head_on_the_direct_path_counts_one_forward_call_per_chunk(checkpoints):
    """A lone in-process client runs the head's GEMMs itself: each chunk is one forward call in the
    executor's stats, and its backward GEMM is not counted as another."""
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    torch.manual_seed(1234)
    split = get_peft_model(symbiosis.from_pretrained(path, executor, dtype=torch.float64),
                           peft_config("lora", "llama"))
    symbiosis.causal_lm_loss(split, chunk_tokens=7, **batch("llama")).backward()  # 30 tokens: 5 chunks
    head_calls = {key: stats["calls"] for key, stats in executor.stats_snapshot()["per_layer"].items()
                  if key.startswith("lm_head")}
    assert head_calls == {"lm_head:forward": 5}
