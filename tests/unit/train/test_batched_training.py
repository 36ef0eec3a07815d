"""Hosted training: several adapters trained in one pass each step equal each adapter trained alone with plain
PEFT (float64: losses, target log-probabilities and every matrix, over several AdamW steps)."""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiosis
from symbiosis.train import HostedLora, LoraSpec, Trainer, Work
from symbiosis.train.trainer import Datum
from matrix import make_checkpoint

ADAM = dict(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "base"
    make_checkpoint("llama", path)
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    return path, Trainer(path, executor)


def _datum(generator, length, loss_fn):
    tokens = torch.randint(0, 128, (length,), generator=generator).tolist()
    targets = torch.randint(0, 128, (length,), generator=generator)
    if loss_fn == "cross_entropy":
        inputs = {"weights": (torch.rand(length, generator=generator) > 0.3).double()}
    else:
        inputs = {"logprobs": -torch.rand(length, generator=generator, dtype=torch.float64) * 5 - 1,
                  "advantages": torch.randn(length, generator=generator, dtype=torch.float64)}
    return Datum(tokens, {"target_tokens": targets, **inputs})


def _reference(path, lora: HostedLora):
    """Plain transformers + PEFT with this adapter's initial matrices, and its AdamW (a MoE model's experts by
    transformers' eager loop: its default kernel has no float64)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    config = peft.LoraConfig(r=lora.spec.rank, lora_alpha=32, target_modules=[t.module for t in lora.targets])
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in lora.named_tensors().items():
            params[name.replace(".weight", ".default.weight")].copy_(tensor)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]),
                                  eps=ADAM["eps"], weight_decay=ADAM["weight_decay"])
    return model, trainable, optimizer


def _reference_step(model, trainable, optimizer, work):
    losses, logprobs = [], []
    total = 0
    for datum in work.datums:
        logits = model(input_ids=torch.tensor([datum.tokens])).logits[0].log_softmax(-1)
        lp = logits.gather(1, datum.inputs["target_tokens"][:, None])[:, 0]
        loss = symbiosis.train.losses.LOSSES[work.loss_fn](lp, datum.inputs, work.config)
        total = total + loss
        losses.append(float(loss.detach()))
        logprobs.append(lp.detach())
    total.backward()
    torch.nn.utils.clip_grad_norm_(trainable, ADAM["grad_clip_norm"])
    optimizer.step()
    optimizer.zero_grad()
    return losses, logprobs


def test_three_adapters_in_one_pass_train_as_each_alone(trainer):
    path, trainer = trainer
    _train_as_each_alone(path, trainer, [LoraSpec(rank=2, seed=1), LoraSpec(rank=4, seed=2, train_mlp=False),
                                         LoraSpec(rank=8, seed=3, train_unembed=False, train_attn=False)])


def test_adapters_of_one_layout_train_as_each_alone_from_one_gathered_buffer(trainer, monkeypatch):
    """Adapters of one rank and parts: a pass gathers their flat buffers once and each layer's stacks are views of
    that (train/model.py `_gathered`); still exactly plain PEFT's training of each (datums 2, 1 and 3 an adapter)."""
    path, trainer = trainer
    from symbiosis.train import model

    gathered = []
    original = model._gathered
    monkeypatch.setattr(model, "_gathered", lambda *args: gathered.append(original(*args)) or gathered[-1])
    _train_as_each_alone(path, trainer, [LoraSpec(rank=4, seed=seed) for seed in (1, 2, 3)])
    assert gathered and all(g is not None and g.shape[0] == 6 for g in gathered)


def test_an_adapters_rows_apart_in_one_pass_sum_in_its_gathered_gradient(trainer, monkeypatch):
    """Two requests of one adapter with another's between them (its datums rows 0 and 2): the pass's gathered
    gradient [B, F] is added into each adapter's flat gradient once, an adapter's rows summed (`_scatter`), equal
    to the per-layer path's (adapters of mixed layouts take it) to float64's rounding."""
    _, trainer = trainer
    from symbiosis.train import model

    outcomes = []
    for gather in (True, False):
        if not gather:
            monkeypatch.setattr(model, "_gathered", lambda *args: None)
        a, b = (HostedLora(LoraSpec(rank=4, seed=seed), trainer.targets, trainer.device, trainer.dtype)
                for seed in (1, 2))
        with torch.no_grad():
            for lora in (a, b):
                lora.flat.copy_(torch.randn(lora.flat.shape, generator=torch.Generator().manual_seed(9)) * 0.1)
        data = [_datum(torch.Generator().manual_seed(i), 7, "cross_entropy") for i in range(3)]
        works = [Work(a, [data[0]], "cross_entropy"), Work(b, [data[1]], "cross_entropy"),
                 Work(a, [data[2]], "cross_entropy")]
        for work in works:
            trainer.check(work)
        results = trainer.run(works)
        outcomes.append(([r.loss for r in results], a.flat_grad.clone(), b.flat_grad.clone()))
    (losses, grad_a, grad_b), (losses_eager, grad_a_eager, grad_b_eager) = outcomes
    assert losses == pytest.approx(losses_eager, rel=1e-12)
    torch.testing.assert_close(grad_a, grad_a_eager, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_b, grad_b_eager, rtol=1e-10, atol=1e-12)
    assert float(grad_a.abs().sum()) > 0 and not torch.allclose(grad_a, grad_b)


def test_on_a_mixture_of_experts_base_attention_adapters_train_as_each_alone(tmp_path):
    """Qwen3-MoE: the experts are the executor's (called per projection, grouped); attention and head adapters
    train exactly as plain PEFT trains each (the loss is Tinker's, the router's auxiliary loss is not in it).
    LoRA on the experts is refused when the adapter is made, naming them."""
    make_checkpoint("qwen3_moe", tmp_path, output_router_logits=False)
    trainer = Trainer(tmp_path, symbiosis.Executor.from_pretrained(tmp_path, dtype=torch.float64))
    _train_as_each_alone(tmp_path, trainer, [LoraSpec(rank=2, seed=1, train_mlp=False),
                                             LoraSpec(rank=4, seed=2, train_mlp=False, train_unembed=False),
                                             LoraSpec(rank=8, seed=3, train_mlp=False, train_attn=False)])
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj: .*mixture of 4 experts"):
        HostedLora(LoraSpec(rank=2), trainer.targets, trainer.device, trainer.dtype)


def _train_as_each_alone(path, trainer, specs):
    generator = torch.Generator().manual_seed(3)
    loras = [HostedLora(spec, trainer.targets, trainer.device, trainer.dtype) for spec in specs]
    with torch.no_grad():  # B starts at zero (PEFT's init): give it values so the first step's gradients differ
        for lora in loras:
            for _, b in lora.layers.values():
                b.normal_(0, 0.1, generator=generator)
    references = [_reference(path, lora) for lora in loras]
    plans = [("cross_entropy", [5, 9]), ("importance_sampling", [12]), ("ppo", [3, 7, 4])]
    for step in range(3):
        works = [Work(lora, [_datum(generator, n, loss_fn) for n in lengths], loss_fn)
                 for lora, (loss_fn, lengths) in zip(loras, plans)]
        for work in works:
            trainer.check(work)
        results = trainer.run(works)
        for lora, work, result, reference in zip(loras, works, results, references):
            expected_losses, expected_logprobs = _reference_step(*reference, work)
            assert result.losses == pytest.approx(expected_losses, rel=1e-10, abs=1e-10), f"step {step}"
            for ours, theirs in zip(result.logprobs, expected_logprobs):
                torch.testing.assert_close(ours.double(), theirs, rtol=1e-10, atol=1e-10)
            lora.step(**ADAM)
    for lora, (model, _, _) in zip(loras, references):
        params = dict(model.named_parameters())
        for name, tensor in lora.named_tensors().items():
            torch.testing.assert_close(tensor.detach(), params[name.replace(".weight", ".default.weight")].detach(),
                                       rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("ranks, lengths", [((2, 4, 2), (6, 6)), ((2, 4, 2), (5, 9)), ((4, 4, 4), (7,))],
                         ids=["one length", "padded", "a datum each, one rank"])
def test_datums_of_several_adapters_through_one_frozen_head_call_equal_each_adapter_alone(trainer, ranks, lengths):
    """The frozen head runs once for every datum of a loss in the pass (chunks across datums, adapters): each
    adapter's losses, log-probabilities and gradients are those of its datums in a pass alone (ranks padded or
    not, one datum an adapter or several)."""
    path, trainer = trainer

    def adapters():
        generator = torch.Generator().manual_seed(11)
        loras = [HostedLora(LoraSpec(rank=r, seed=i, train_unembed=False), trainer.targets, trainer.device,
                            trainer.dtype) for i, r in enumerate(ranks)]
        with torch.no_grad():
            for lora in loras:
                lora.flat.normal_(0, 0.1, generator=generator)
        works = [Work(lora, [_datum(generator, n, "importance_sampling") for n in lengths], "importance_sampling")
                 for lora in loras]
        return loras, works

    loras, works = adapters()
    together = trainer.run(works)
    alone_loras, alone_works = adapters()
    alone = [trainer.run([work])[0] for work in alone_works]
    for ours, theirs, lora, alone_lora in zip(together, alone, loras, alone_loras):
        assert ours.losses == pytest.approx(theirs.losses, rel=1e-12)
        for a, b in zip(ours.logprobs, theirs.logprobs):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lora.flat_grad, alone_lora.flat_grad, rtol=1e-10, atol=1e-12)
        assert lora.flat_grad.abs().sum() > 0


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
def test_the_frozen_heads_gradient_is_the_checkpointed_ones(trainer, monkeypatch, loss_fn):
    """A head the adapter does not train gives d loss / d hidden in its forward (no logits kept, nothing
    recomputed): the same gradients as running it under checkpointing, in chunks smaller than a datum, for K
    targets a position too (cross_entropy's top-K distillation)."""
    _, trainer = trainer
    monkeypatch.setattr(trainer, "chunk_rows", lambda: 3)
    grads = []
    for frozen in (True, False):
        generator = torch.Generator().manual_seed(9)
        lora = HostedLora(LoraSpec(rank=4, seed=7, train_unembed=False), trainer.targets, trainer.device, trainer.dtype)
        with torch.no_grad():
            for _, b in lora.layers.values():
                b.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        datums = [_datum(torch.Generator().manual_seed(2), 8, loss_fn), _datum(torch.Generator().manual_seed(3), 5, loss_fn)]
        if loss_fn == "cross_entropy":  # K = 3 targets a position, soft weights
            for datum in datums:
                n = len(datum.tokens)
                datum.inputs = {"target_tokens": torch.randint(0, 128, (n, 3), generator=generator),
                                "weights": torch.rand(n, 3, generator=generator, dtype=torch.float64)}
        if not frozen:  # the head as if it trained (a zero LoRA): checkpointed chunks, autograd through them
            lora.layers[trainer.head.layer_id] = (torch.zeros(4, trainer.head.base.spec.in_features, dtype=torch.float64),
                                                   torch.zeros(trainer.vocab, 4, dtype=torch.float64))
        work = Work(lora, datums, loss_fn)
        trainer.check(work)
        result = trainer.run([work])[0]
        lora.layers.pop(trainer.head.layer_id, None)
        grads.append(({name: t.grad.clone() for name, t in lora.named_tensors().items()}, result))
    (frozen_grads, frozen_result), (checkpointed_grads, checkpointed_result) = grads
    assert frozen_result.losses == pytest.approx(checkpointed_result.losses, rel=1e-12)
    for name, grad in frozen_grads.items():
        torch.testing.assert_close(grad, checkpointed_grads[name], rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_a_pass_does_not_wait_for_the_gpu_per_layer_or_per_datum(tmp_path):
    """The host queues a pass ahead of the GPU: the synchronizations CUDA's sync debug mode reports in a pass of
    eight datums of four adapters (of one length: no mask to check) are the read-back's, not one per LoRA layer (a
    scale copied to the device) or per datum (its loss inputs)."""
    import warnings

    path = tmp_path / "base"
    make_checkpoint("llama", path)
    executor = symbiosis.Executor.from_pretrained(path, device="cuda", dtype=torch.float32)
    trainer = Trainer(path, executor)
    generator = torch.Generator().manual_seed(0)
    loras = [HostedLora(LoraSpec(rank=4, seed=i), trainer.targets, trainer.device, trainer.dtype) for i in range(4)]
    works = [Work(lora, [_datum(generator, 16, "cross_entropy") for _ in range(2)], "cross_entropy") for lora in loras]
    for work in works:
        trainer.check(work)
    trainer.run(works)  # warm: the first pass's allocations and lazy initializations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.run(works)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    lora_layers = len(next(iter(loras)).layers)
    assert lora_layers >= 8
    assert len(syncs) <= 2, f"{len(syncs)} synchronizations in one pass ({lora_layers} LoRA layers, 8 datums): {syncs}"


@pytest.mark.gpu
def test_in_bfloat16_the_lora_runs_in_bfloat16_and_follows_float32(tmp_path):
    """A bfloat16 base: the LoRA's products run in bfloat16 (mixed precision; matrices and gradients float32). Losses
    and gradients follow a float32 pass of the same datums and adapters (ranks differ, several datums an adapter)."""
    path = tmp_path / "base"
    make_checkpoint("llama", path)
    outcomes = {}
    for dtype in (torch.float32, torch.bfloat16):
        trainer = Trainer(path, symbiosis.Executor.from_pretrained(path, device="cuda", dtype=dtype))
        generator = torch.Generator().manual_seed(0)
        loras = [HostedLora(LoraSpec(rank=r, seed=i), trainer.targets, trainer.device, dtype)
                 for i, r in enumerate((4, 8, 4))]
        with torch.no_grad():
            for lora in loras:
                lora.flat.copy_(torch.randn(lora.flat.shape, generator=generator) * 0.05)
        works = [Work(lora, [_datum(generator, 24, "cross_entropy") for _ in range(2)], "cross_entropy")
                 for lora in loras]
        results = trainer.run(works)
        assert all(lora.flat.dtype == lora.flat_grad.dtype == torch.float32 for lora in loras)
        outcomes[dtype] = ([r.loss for r in results], [lora.flat_grad.clone() for lora in loras])
    (losses32, grads32), (losses16, grads16) = outcomes[torch.float32], outcomes[torch.bfloat16]
    assert losses16 == pytest.approx(losses32, rel=2e-2)
    for ours, theirs in zip(grads16, grads32):
        assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99
        assert float(ours.norm()) == pytest.approx(float(theirs.norm()), rel=0.1)



def test_llamas_rmsnorms_run_fused_and_other_forms_are_left_alone(trainer):
    """Every RMSNorm of the trainer's Llama runs by torch's rms_norm (the exactness tests above run through them); a
    norm of another formula (Gemma's 1 + weight) keeps its own code."""
    from symbiosis.train.model import _fuse_norms

    _, trainer = trainer
    layers = trainer.model.config.num_hidden_layers
    assert trainer.state.fused_norms == 2 * layers + 1

    class OnePlusWeightNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(8)), 1e-6

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)
                    ).to(x.dtype)

    norm = OnePlusWeightNorm()
    assert _fuse_norms(torch.nn.Sequential(norm)) == 0 and "forward" not in vars(norm)


def test_over_a_base_split_between_devices_micro_batches_train_as_each_alone(tmp_path):
    """A base whose layers are spread over two devices (executor/peers.py: CPUs here, GPUs in use): each decoder
    layer runs where its base layers are, a pass runs in micro-batches of its datums, and every adapter still
    trains exactly as plain PEFT trains it alone."""
    from symbiosis.executor.peers import on_devices

    from symbiosis.train.model import TrainLinear

    make_checkpoint("llama", tmp_path)
    executor = on_devices(tmp_path, ["cpu", "cpu"], dtype=torch.float64)
    trainer = Trainer(tmp_path, executor)
    on_peer = {m.layer_id: m.base for m in trainer.model.modules()
               if isinstance(m, TrainLinear) and m.layer_id in executor.weights.remote}
    assert on_peer and all(base is executor.weights.remote[i].layer for i, base in on_peer.items())  # run there
    trainer.micro_batch_tokens = 24  # 6 datums padded to 12 tokens: 3 micro-batches of 2
    _train_as_each_alone(tmp_path, trainer, [LoraSpec(rank=2, seed=1), LoraSpec(rank=4, seed=2, train_mlp=False),
                                             LoraSpec(rank=8, seed=3, train_unembed=False, train_attn=False)])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_over_two_gpus_a_pass_follows_the_one_gpu_pass(tmp_path):
    """The base's layers over two GPUs: decoder layers run on the GPU of their base layers (the head's too), the
    pass in micro-batches on streams of its own, a second pass after an optimizer step; losses and every adapter's
    gradients equal a one-GPU pass's (float64: in float32 the two passes' different GEMM shapes round differently,
    and gradients made of large terms that cancel differ by more than any tolerance a race could not pass)."""
    from symbiosis.executor.peers import on_devices

    make_checkpoint("llama", tmp_path)
    outcomes = []
    for executor in (symbiosis.Executor.from_pretrained(tmp_path, device="cuda:0", dtype=torch.float64),
                     on_devices(tmp_path, ["cuda:0", "cuda:1"], dtype=torch.float64)):
        trainer = Trainer(tmp_path, executor)
        if trainer.micro_batch_tokens:
            trainer.micro_batch_tokens = 48  # 6 datums of 24 tokens: 3 micro-batches
        generator = torch.Generator().manual_seed(0)
        loras = [HostedLora(LoraSpec(rank=r, seed=i), trainer.targets, trainer.device, torch.float64)
                 for i, r in enumerate((4, 8, 4))]
        with torch.no_grad():
            for lora in loras:
                lora.flat.copy_(torch.randn(lora.flat.shape, generator=generator, dtype=torch.float64) * 0.05)
        losses = []
        for _ in range(2):  # the second pass after an optimizer step (default streams) that the first one's feeds
            works = [Work(lora, [_datum(generator, 24, "cross_entropy") for _ in range(2)], "cross_entropy")
                     for lora in loras]
            losses += [r.loss for r in trainer.run(works)]
            grads = [lora.flat_grad.clone() for lora in loras]
            for lora in loras:
                lora.step(**ADAM)
        outcomes.append((trainer, losses, grads))
    (_, losses1, grads1), (split, losses2, grads2) = outcomes
    assert len(split.state.devices) == 2 and split.micro_batch_tokens and len(split.pass_streams) == 2
    layers = {p.device for layer in split.model.get_decoder().layers for p in layer.parameters()}
    assert layers == {torch.device("cuda:0"), torch.device("cuda:1")}
    assert losses2 == pytest.approx(losses1, rel=1e-9)
    for ours, theirs in zip(grads2, grads1):
        torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-9)
