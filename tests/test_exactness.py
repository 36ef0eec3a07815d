"""Split execution equals plain transformers+PEFT in float64: logits, loss, every trainable gradient, and the
adapter weights after 3 AdamW steps, for every architecture x PEFT method that PEFT itself supports."""

from __future__ import annotations

import peft
import pytest
import torch
from peft import get_peft_model, get_peft_model_state_dict

import symbiosis
from conftest import VOCAB

RTOL = 1e-9
SEQ_CLS = {"bert"}
ATTENTION = {"llama": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"], "granite": ["q_proj", "v_proj"],
             "qwen2": ["q_proj", "v_proj"], "opt": ["q_proj", "v_proj"], "gpt2": ["c_attn"],
             "gpt_bigcode": ["c_attn"], "bert": ["query", "value"]}
FEEDFORWARD = {"llama": "down_proj", "gemma2": "down_proj", "granite": "down_proj", "qwen2": "down_proj",
               "opt": "fc2", "gpt2": "mlp.c_proj", "gpt_bigcode": "mlp.c_proj", "bert": "output.dense"}
# transformers' eager Gemma2 attention yields NaN for a whole left-padded row in float64 (plain model too).
NAN_WHEN_PADDED_IN_FP64 = {"gemma2"}
CORE_ARCHS = ["llama", "gpt2", "gpt_bigcode", "gemma2", "granite", "bert"]


def peft_config(method: str, arch: str):
    task = "SEQ_CLS" if arch in SEQ_CLS else "CAUSAL_LM"
    attn, ff = ATTENTION[arch], FEEDFORWARD[arch]
    make = {
        "lora": lambda: peft.LoraConfig(task_type=task, r=4, lora_alpha=8, target_modules=attn,
                                        init_lora_weights=False),
        "rslora_all_linear": lambda: peft.LoraConfig(task_type=task, r=4, lora_alpha=8, use_rslora=True,
                                                     target_modules="all-linear", init_lora_weights=False),
        "lora_attn_mlp": lambda: peft.LoraConfig(task_type=task, r=2, lora_alpha=4, target_modules=attn + [ff],
                                                 lora_dropout=0.1),
        "ia3": lambda: peft.IA3Config(task_type=task, target_modules=attn + [ff], feedforward_modules=[ff]),
        "adalora": lambda: peft.AdaLoraConfig(task_type=task, init_r=6, target_r=3, tinit=0, tfinal=0, deltaT=1,
                                              total_step=4, target_modules=attn),
        "prefix": lambda: peft.PrefixTuningConfig(task_type=task, num_virtual_tokens=4),
        "prompt": lambda: peft.PromptTuningConfig(task_type=task, num_virtual_tokens=4),
        "ptuning": lambda: peft.PromptEncoderConfig(task_type=task, num_virtual_tokens=4, encoder_hidden_size=32),
        "loha": lambda: peft.LoHaConfig(task_type=task, r=4, target_modules=attn, init_weights=False),
        "lokr": lambda: peft.LoKrConfig(task_type=task, r=4, target_modules=attn, init_weights=False),
    }
    return make[method]()


METHODS = ["lora", "rslora_all_linear", "lora_attn_mlp", "ia3", "adalora", "prefix", "prompt", "ptuning",
           "loha", "lokr"]


def batch(arch: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    if arch not in NAN_WHEN_PADDED_IN_FP64:
        mask[0, :3] = 0  # left padding in one row: masks must flow through the split model too
    labels = torch.randint(0, 3, (3,), generator=g) if arch in SEQ_CLS else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def assert_close(ours: torch.Tensor, reference: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    assert ours.shape == reference.shape, what
    assert not reference.isnan().any(), f"{what}: the reference itself is NaN"
    scale = reference.abs().max().item()
    err = (ours - reference).abs().max().item()
    assert err <= rtol * scale or err == 0.0, f"{what}: max abs error {err:.3e}, scale {scale:.3e}"


@pytest.fixture(scope="module")
def executors(checkpoints):
    made = {}

    def get(arch):
        if arch not in made:
            path, _ = checkpoints(arch)
            made[arch] = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
            # A second attached client: every call then takes the executor path (autograd Function, batcher),
            # not the single-client direct path, which test_single_client_direct_path covers.
            made[arch].attach(made[arch].fingerprint, "bystander")
        return made[arch]

    return get


def build_pair(arch, method, checkpoints, executors):
    """(reference PeftModel on the full model, symbiosis PeftModel on the split model), same adapter init."""
    path, auto_class = checkpoints(arch)
    reference = auto_class.from_pretrained(path, dtype=torch.float64)
    torch.manual_seed(1234)
    try:
        reference = get_peft_model(reference, peft_config(method, arch))
        reference(**batch(arch))
    except (ValueError, TypeError, NotImplementedError, AttributeError, RuntimeError) as e:
        pytest.skip(f"plain PEFT does not support {method} on {arch}: {type(e).__name__}: {e}")
    split = symbiosis.from_pretrained(path, executors(arch), auto_class=auto_class, dtype=torch.float64)
    torch.manual_seed(1234)
    split = get_peft_model(split, peft_config(method, arch))
    return reference, split


def train_step(model, arch: str, step: int) -> torch.Tensor:
    torch.manual_seed(100 + step)  # identical dropout masks on both sides
    out = model(**batch(arch, seed=step))
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


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_activation_checkpointing_is_exact_and_saves_a_fraction(arch, reentrant, checkpoints, executors):
    """transformers' gradient checkpointing on a split model: backward recomputes each decoder layer's
    forward (its executor calls included); loss and every adapter gradient equal plain PEFT's without
    checkpointing, and the client keeps a fraction of the activations for backward (what caps how many
    tenants fit next to one base)."""
    reference, split = build_pair(arch, "rslora_all_linear", checkpoints, executors)
    split.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for model in (reference, split):
        model.train()
    (ref_out, ref_saved), (our_out, our_saved) = saved_for_backward(reference, arch), saved_for_backward(split, arch)
    assert our_saved < ref_saved / 4, f"checkpointed split model saved {our_saved} bytes, plain PEFT {ref_saved}"
    ref_out.loss.backward()
    our_out.loss.backward()
    assert_close(our_out.loss, ref_out.loss, "loss")
    ref_params = dict(reference.named_parameters())
    for name, param in split.named_parameters():
        if param.requires_grad:
            assert_close(param.grad, ref_params[name].grad, f"grad of {name}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", CORE_ARCHS)
def test_split_equals_plain_peft(arch, method, checkpoints, executors):
    reference, split = build_pair(arch, method, checkpoints, executors)
    for model in (reference, split):
        model.train()
    ref_out, our_out = train_step(reference, arch, 0), train_step(split, arch, 0)
    assert_close(our_out.logits, ref_out.logits, "logits")
    assert_close(our_out.loss, ref_out.loss, "loss")
    ref_params = dict(reference.named_parameters())
    trainable = [(n, p) for n, p in split.named_parameters() if p.requires_grad]
    assert trainable and {n for n, _ in trainable} == {n for n, p in ref_params.items() if p.requires_grad}
    for name, param in trainable:
        assert param.grad is not None, f"no gradient reached {name}"
        assert_close(param.grad, ref_params[name].grad, f"grad of {name}")

    # Three AdamW steps (AdaLoRA reallocates ranks after each), then the adapters must still agree.
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                  for m in (reference, split)]
    for step in range(3):
        for model, optimizer in zip((reference, split), optimizers):
            if step:
                train_step(model, arch, step)
            optimizer.step()
            if method == "adalora":
                model.base_model.update_and_allocate(step)
            optimizer.zero_grad()
    ours, theirs = get_peft_model_state_dict(split), get_peft_model_state_dict(reference)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert_close(ours[key], theirs[key], f"adapter tensor {key} after 3 AdamW steps")


@pytest.mark.parametrize("arch", ["qwen2", "opt"])
def test_other_architectures_just_work(arch, checkpoints, executors):
    reference, split = build_pair(arch, "lora", checkpoints, executors)
    ref_out, our_out = train_step(reference, arch, 0), train_step(split, arch, 0)
    assert_close(our_out.logits, ref_out.logits, "logits")
    ref_params = dict(reference.named_parameters())
    for name, param in split.named_parameters():
        if param.requires_grad:
            assert_close(param.grad, ref_params[name].grad, f"grad of {name}")


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_greedy_generate_matches(arch, checkpoints, executors):
    reference, split = build_pair(arch, "lora", checkpoints, executors)
    prompt = batch(arch)
    kwargs = dict(input_ids=prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=6,
                  do_sample=False, pad_token_id=0)
    assert torch.equal(split.generate(**kwargs), reference.generate(**kwargs))


def test_dora_is_refused_with_an_explanation(checkpoints, executors):
    path, auto_class = checkpoints("llama")
    split = symbiosis.from_pretrained(path, executors("llama"), auto_class=auto_class, dtype=torch.float64)
    with pytest.raises(symbiosis.UnsupportedAdapter, match="DoRA"):
        get_peft_model(split, peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))


def test_single_client_direct_path(checkpoints):
    """Alone on an in-process executor, a client runs the executor's GEMMs itself with native autograd; the
    numbers are the same, and no activation is saved for base layers."""
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    model = symbiosis.from_pretrained(path, executor, auto_class=auto_class)
    torch.manual_seed(1234)
    split = get_peft_model(model, peft_config("lora", "llama"))
    layer = split.base_model.model.model.layers[0].mlp.up_proj
    assert layer.session.direct(layer.layer_id, torch.zeros(1, 64, dtype=torch.float64)) is not None
    reference = auto_class.from_pretrained(path, dtype=torch.float64)
    torch.manual_seed(1234)
    reference = get_peft_model(reference, peft_config("lora", "llama"))
    calls = lambda: executor.stats_snapshot()["per_layer"]["model.layers.0.mlp.up_proj:forward"]["calls"]  # noqa: E731
    before = calls()
    ours, theirs = train_step(split, "llama", 0), train_step(reference, "llama", 0)
    assert calls() == before + 1  # counted by the executor
    assert_close(ours.logits, theirs.logits, "logits")
    reference_params = dict(reference.named_parameters())
    for name, param in split.named_parameters():
        if param.requires_grad:
            assert_close(param.grad, reference_params[name].grad, name)
    up = executor.weights.layers["model.layers.0.mlp.up_proj"].weight
    assert not up.requires_grad and up.grad is None
