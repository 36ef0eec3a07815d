"""Mixture-of-experts models on a split model: each expert's projections are base layers of the executor (one
copy of every expert, views of transformers' fused tensors), the router and the routing are the client's.
Exact against plain transformers (its eager experts) + PEFT in float64: logits, loss with the router's auxiliary
loss, every adapter gradient, 3 AdamW steps; greedy generation identical."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import matrix
import symbiosis
from helpers import assert_close, assert_trains_as_plain_peft, batch
from matrix import peft_config
from symbiosis.client.virtual import VirtualWeight


def moe_pair(arch, method, checkpoints, executors):
    path, auto_class = checkpoints(arch)
    # transformers' default experts kernel (grouped_mm) has no float64; its eager loop is the reference
    reference = auto_class.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    split = symbiosis.from_pretrained(path, executors(arch), auto_class=auto_class, dtype=torch.float64)
    models = []
    for model in (reference, split):
        torch.manual_seed(1234)
        models.append(get_peft_model(model, peft_config(method, arch)))
    return tuple(models)


@pytest.mark.parametrize("arch,method", [(a, m) for a in matrix.MOE for m in matrix.MOE_METHODS])
def test_split_moe_trains_as_plain_peft(arch, method, checkpoints, executors):
    reference, split = moe_pair(arch, method, checkpoints, executors)
    assert_trains_as_plain_peft(reference, split, arch)


@pytest.mark.parametrize("arch,method", [(a, m) for a in matrix.MOE for m, why in matrix.MOE_NOT_RUN.items()
                                         if why.startswith("PEFT")])
def test_plain_peft_itself_fails_what_the_moe_table_says_it_does(arch, method, checkpoints):
    path, auto_class = checkpoints(arch)
    with pytest.raises((ValueError, RuntimeError)):
        model = get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64, experts_implementation="eager"),
                               peft_config(method, arch))
        model(**batch(arch)).loss.backward()


@pytest.mark.parametrize("arch", matrix.MOE)
def test_router_auxiliary_loss_and_its_gradient_match(arch, checkpoints, executors):
    reference, split = moe_pair(arch, "lora_router", checkpoints, executors)
    outputs = []
    for model in (reference, split):
        model.train()
        out = model(**batch(arch))
        assert out.aux_loss is not None and out.aux_loss > 0
        out.aux_loss.backward()  # reaches the router's LoRA only
        outputs.append((out, {n: p.grad for n, p in model.named_parameters() if "gate.lora" in n}))
    (ref_out, ref_grads), (our_out, our_grads) = outputs
    assert_close(our_out.aux_loss, ref_out.aux_loss, "router auxiliary loss")
    assert ref_grads and ref_grads.keys() == our_grads.keys()
    for name in ref_grads:
        assert_close(our_grads[name], ref_grads[name], f"aux-loss gradient of {name}")


@pytest.mark.parametrize("arch", matrix.MOE)
def test_greedy_generation_is_identical(arch, checkpoints, executors):
    reference, split = moe_pair(arch, "lora_router", checkpoints, executors)
    prompt = batch(arch)
    kwargs = dict(input_ids=prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=6,
                  do_sample=False, pad_token_id=0,
                  output_router_logits=False)  # transformers' aux loss fails in generate (mask vs one new token)
    assert torch.equal(split.generate(**kwargs), reference.generate(**kwargs))


@pytest.mark.parametrize("arch", matrix.MOE)
def test_client_holds_no_expert_and_the_executor_each_expert_once(arch, checkpoints, executors):
    path, auto_class = checkpoints(arch)
    executor = executors(arch)
    split = symbiosis.from_pretrained(path, executor, auto_class=auto_class, dtype=torch.float64)
    plain = auto_class.from_pretrained(path, dtype=torch.float64)
    expert_names = [n for n, p in plain.named_parameters() if p.dim() == 3]
    assert expert_names, "the tiny model has no fused experts"
    ours = dict(split.named_parameters())
    for name in expert_names:  # same names and shapes as transformers', but no values on the client
        assert isinstance(ours[name], VirtualWeight) and ours[name].shape == plain.get_parameter(name).shape
    real = sum(p.numel() for p in split.parameters() if not isinstance(p, VirtualWeight))
    assert real < sum(plain.get_parameter(n).numel() for n in expert_names) / 4

    experts = [layer for layer in executor.weights.layers.values() if layer.spec.expert is not None]
    assert len(experts) == sum(plain.get_parameter(n).shape[0] for n in expert_names)
    by_tensor = {}
    for layer in experts:  # every expert a view of its one fused tensor
        by_tensor.setdefault(layer.spec.weight_name, set()).add(layer.weight.untyped_storage().data_ptr())
    assert len(by_tensor) == len(expert_names) and all(len(ptrs) == 1 for ptrs in by_tensor.values())
    base_bytes = sum(p.numel() * 8 for n, p in plain.named_parameters()
                     if p.dim() == 3 or n.endswith(("proj.weight", "lm_head.weight")))
    assert executor.weights.nbytes == base_bytes  # nothing held twice
    # and the executor refuses to fuse experts into a group (which would copy them)
    ids = [layer.spec.layer_id for layer in experts[:2]]
    assert executor.weights.get("+".join(ids)) is None


def test_lora_on_a_linear_layers_base_weight_is_refused_clearly(checkpoints, executors):
    """target_parameters on the fused experts runs (test above); on an attention layer's weight, which a split
    model holds only in the executor, it is refused when get_peft_model runs, naming the parameter."""
    path, auto_class = checkpoints("qwen3_moe")
    split = symbiosis.from_pretrained(path, executors("qwen3_moe"), auto_class=auto_class, dtype=torch.float64)
    before = {name: type(module) for name, module in split.named_modules()}
    config = LoraConfig(r=4, target_modules=[], target_parameters=["experts.gate_up_proj", "q_proj.weight"])
    with pytest.raises(symbiosis.UnsupportedAdapter, match=r"target_parameters on a linear .*self_attn\.q_proj\.weight"):
        get_peft_model(split, config)
    assert {name: type(module) for name, module in split.named_modules()} == before  # nothing injected


def test_a_projection_is_one_call_and_two_clients_calls_are_regrouped_by_expert(checkpoints):
    """In process, each fused projection is ONE executor call (rows grouped by expert, rows per expert); calls of
    two clients for it run as one batch, regrouped by expert, each client getting exactly its own rows back."""
    path, auto_class = checkpoints("mixtral")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy="lockstep")
    a, b = executor.register(executor.fingerprint, "a"), executor.register(executor.fingerprint, "b")
    group_id = next(iter(executor.weights.experts))
    group = executor.weights.experts[group_id]
    torch.manual_seed(0)
    calls = {a: [2, 0, 3, 1], b: [0, 4, 1, 2]}
    inputs = {c: torch.randn(sum(counts), group.spec.in_features, dtype=torch.float64) for c, counts in calls.items()}
    futures = {c: executor.submit_experts(c, "forward", group_id, inputs[c], calls[c]) for c in calls}
    for client, counts in calls.items():  # each expert's rows through that expert's own layer
        expected, start = [], 0
        for expert, rows in enumerate(counts):
            layer = executor.weights.layers[f"{group_id}.{expert}"]
            expected.append(layer.forward(inputs[client][start:start + rows]))
            start += rows
        # (float64 rounding only: a GEMM of more rows may take another blocking)
        assert_close(futures[client].result(timeout=10), torch.cat(expected), f"client {client}'s rows", rtol=1e-12)
    key = f"{group_id}:forward"
    assert executor.stats_snapshot()["per_layer"][key]["calls"] == 2
    assert executor.stats_snapshot()["per_layer"][key]["batches"] == 1
    with pytest.raises(symbiosis.BadCall, match="counts must be 4 non-negative integers"):
        executor.submit_experts(a, "forward", group_id, inputs[a], [6, 0, 0, -0.5])
    executor.close()


def test_through_a_session_without_grouped_calls_each_expert_is_a_call_of_its_own(checkpoints, executors,
                                                                                  monkeypatch):
    """Over a transport (or noise masking) a chosen expert is one call per projection under its own layer id, which
    the executor batches per expert like a dense layer; the numbers are the same."""
    from symbiosis.transport.inprocess import InProcessSession

    monkeypatch.setattr(InProcessSession, "expert_group", property(lambda self: None), raising=True)
    reference, split = moe_pair("olmoe", "lora_experts", checkpoints, executors)
    assert_trains_as_plain_peft(reference, split, "olmoe")
    per_layer = executors("olmoe").stats_snapshot()["per_layer"]
    assert any(key.endswith(".gate_up_proj.0:forward") and figures["calls"] for key, figures in per_layer.items())


@pytest.mark.gpu
def test_on_the_gpu_the_grouped_gemm_equals_one_gemm_per_expert():
    """torch's grouped GEMM (Hopper, bf16) against the per-expert loop, forward and backward, linear and
    transposed (conv1d) layouts, with an expert that has no rows."""
    from symbiosis.executor.store import ExpertGroup, _grouped_mm_fits
    from symbiosis.model.partition import BaseLayerSpec

    torch.manual_seed(0)
    counts = [5, 0, 17, 3]
    x = torch.randn(sum(counts), 64, device="cuda", dtype=torch.bfloat16)
    for kind, shape in (("linear", (4, 96, 64)), ("conv1d", (4, 64, 96))):
        spec = BaseLayerSpec("e.0", kind, 64, 96, "e", "b", 0)
        group = ExpertGroup(spec, torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / 8,
                            torch.randn(4, 96, device="cuda", dtype=torch.bfloat16))
        if not _grouped_mm_fits(x, group.weight):
            pytest.skip("this GPU or torch has no grouped GEMM")
        y = group.forward(x, counts)
        g = torch.randn_like(y)
        grad = group.backward(g, counts)
        loop = ExpertGroup(spec, group.weight.float(), group.bias.float())  # float32: the loop path
        assert_close(y.float(), loop.forward(x.float(), counts), f"{kind} forward", rtol=2e-2)
        assert_close(grad.float(), loop.backward(g.float(), counts), f"{kind} backward", rtol=2e-2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_with_the_groups_offsets_on_the_device_the_experts_equal_the_host_counted_path(arch, checkpoints, monkeypatch):
    """A client alone on an in-process executor runs each projection as one grouped GEMM whose groups' offsets stay
    on the device (no host synchronization). torch's grouped GEMM, here its CPU kernel in float32, against the
    host-counted path: the same logits and adapter gradients, and an expert-parallel sentinel id adds nothing."""
    from symbiosis.executor import store

    path, auto_class = checkpoints(arch)
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(symbiosis.from_pretrained(path, executor, auto_class=auto_class, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    inputs = batch(arch)
    grouped = []
    monkeypatch.setattr(store.ExpertGroup, "forward_by_offsets", _recording(store.ExpertGroup.forward_by_offsets,
                                                                            grouped))
    results = {}
    for on_device in (True, False):
        monkeypatch.setattr(store, "_grouped_mm_fits", lambda x, w, on=on_device: on and x.dtype == torch.float32)
        model.zero_grad()
        out = model(**inputs)
        out.loss.backward()
        results[on_device] = (out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                    if p.requires_grad})
        assert bool(grouped) == on_device
        grouped.clear()
    (logits, grads), (host_logits, host_grads) = results[True], results[False]
    assert_close(logits, host_logits, "logits", rtol=1e-5)
    for name, grad in grads.items():
        assert_close(grad, host_grads[name], name, rtol=1e-4)

    experts = next(m for m in model.modules() if "symbiosis_expert_groups" in m.__dict__)
    torch.manual_seed(0)
    hidden = torch.randn(5, model.config.hidden_size)
    chosen = torch.randint(0, experts.num_experts, (5, 2))
    weights = torch.rand(5, 2)
    sentinel = chosen.clone()
    sentinel[1, 0] = sentinel[3, 1] = experts.num_experts  # pairs routed to another rank add nothing
    outputs = {}
    for on_device in (True, False):
        monkeypatch.setattr(store, "_grouped_mm_fits", lambda x, w, on=on_device: on and x.dtype == torch.float32)
        with torch.no_grad():
            outputs[on_device] = (experts(hidden, sentinel, weights), experts(hidden, chosen, weights))
    assert_close(outputs[True][0], outputs[False][0], "with sentinel ids", rtol=1e-5)
    assert not torch.allclose(outputs[True][0], outputs[True][1])  # the sentinel pairs did drop out
    executor.close()


def _recording(method, calls: list):
    def recorded(self, *args, **kwargs):
        calls.append(self)
        return method(self, *args, **kwargs)
    return recorded


@pytest.mark.parametrize("scheme", ["tcp", "gloo"])
def test_over_tcp_and_nccl_each_projection_is_one_call_too(scheme, checkpoints):
    """tcp:// and nccl:// (here gloo://) carry a projection's rows per expert in the call's header: one call per
    projection, as in process; the numbers are an in-process client's."""
    from helpers import assert_same_step_on
    from symbiosis.transport.server import ExecutorServer

    path, auto_class = checkpoints("qwen3_moe")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    server = ExecutorServer(executor, "tcp://127.0.0.1:0").start()
    try:
        url = server.url if scheme == "tcp" else server.url.replace("tcp://", "gloo://")
        remote = symbiosis.connect(url, timeout=20)
        assert remote.attach(executor.fingerprint, "probe").expert_group(next(iter(executor.weights.experts))) == 4
        # (tcp:// hands the executor a tensor in a message buffer, whose alignment may change BLAS's rounding)
        assert_same_step_on(path, auto_class, [executor, remote], "lora_experts", "qwen3_moe", rtol=1e-12)
        per_layer = executor.stats_snapshot()["per_layer"]
        assert any(key.endswith("experts.gate_up_proj:backward") for key in per_layer)  # grouped calls...
        assert not any(".gate_up_proj.0:" in key for key in per_layer)  # ...never one per expert
    finally:
        server.stop()
        executor.close()


def test_noise_masking_covers_the_expert_calls(checkpoints, executors):
    """With NoiseMasking every activation that leaves the client is masked, the experts' included (they are then
    called one by one, each masked like a dense layer's call): the logits are still plain transformers'."""
    path, auto_class = checkpoints("mixtral")
    masked = symbiosis.from_pretrained(path, executors("mixtral"), auto_class=auto_class, dtype=torch.float64,
                                       privacy=symbiosis.NoiseMasking(pool=2, rows=64, seed=3))
    plain = auto_class.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    inputs = {k: v for k, v in batch("mixtral").items() if k != "labels"}
    with torch.no_grad():
        assert_close(masked(**inputs).logits, plain(**inputs).logits, "masked MoE logits", rtol=1e-9)
    session = masked.model.layers[0].mlp.experts.symbiosis_session
    assert getattr(session, "expert_group", None) is None  # a masked session has no grouped calls: per expert


def test_the_chunked_loss_is_the_models_own_or_refused(checkpoints, executors):
    """causal_lm_loss on a MoE model: the cross-entropy alone equals transformers' loss without the router's
    auxiliary loss; with the auxiliary loss in the model's loss (output_router_logits) it is refused, not
    computed without it."""
    path, auto_class = checkpoints("olmoe")
    split = symbiosis.from_pretrained(path, executors("olmoe"), auto_class=auto_class, dtype=torch.float64)
    inputs = batch("olmoe")
    with pytest.raises(symbiosis.UnsupportedAdapter, match="auxiliary loss"):
        symbiosis.causal_lm_loss(split, **inputs)
    split.config.output_router_logits = False
    with torch.no_grad():  # (transformers computes its loss from float32 logits, whatever the model's dtype)
        assert_close(symbiosis.causal_lm_loss(split, chunk_tokens=7, **inputs), split(**inputs).loss.double(),
                     "chunked loss", rtol=1e-6)
