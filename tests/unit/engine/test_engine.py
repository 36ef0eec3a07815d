"""The hosted engine against plain transformers + PEFT: every request of a mixed batch (different adapters, none,
different lengths, joining mid-way, chunked, preempted and resumed) makes the tokens that request makes alone, with
the same log-probabilities; seeded sampling repeats; bad requests fail alone."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiosis
from symbiosis.client.bottleneck import attach_bottleneck, random_bottleneck, save_bottleneck
from symbiosis.engine import Engine, GenerationError, SamplingParams, attention, layers
from symbiosis.engine import batch as batch_layout
from symbiosis.engine import compiled as compiled_layers
from symbiosis.errors import AdapterError, BadCall, UnsupportedAdapter

ENGINE_ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2", "gpt_neox"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 39)), [100, 7, 9, 12, 3]]


def _alone(checkpoint, adapter, prompt, max_tokens, dtype=torch.float64):
    """(tokens, log-probabilities of every step's logits) of plain transformers (+ PEFT), this request alone."""
    # transformers' default experts kernel (grouped_mm) has no float64: MoE models run their eager loop
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, experts_implementation="eager")
    if adapter is not None and json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "BOTTLENECK":
        attach_bottleneck(model, adapter)  # hooks: a bottleneck on each targeted layer's output
    elif adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.generation_config.eos_token_id = None
    sequence = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():  # generate() hands out float32 logits: the float64 ones, by one pass over the sequence
        logits = model(sequence[:, :-1]).logits[0, len(prompt) - 1:]
    return sequence[0, len(prompt):].tolist(), logits.log_softmax(-1)


def _check(completion, expected, prompt, rtol=1e-9):
    tokens, logprobs = expected
    assert completion.token_ids == tokens, f"prompt {prompt}"
    ours = torch.tensor([t.logprob for t in completion.logprobs], dtype=torch.float64)
    theirs = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].double()
    assert torch.allclose(ours, theirs, rtol=rtol, atol=rtol), f"prompt {prompt}: {(ours - theirs).abs().max()}"
    for token, alternatives in zip(completion.logprobs, logprobs):
        top = torch.topk(alternatives, 3)
        assert [i for i, _ in token.top_logprobs] == top.indices.tolist()


def _save_random_lora(base, target_modules: list[str], directory) -> None:
    """A rank-4 LoRA on `target_modules` of the checkpoint `base`, large enough to change tokens, saved by PEFT."""
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules,
                                                init_lora_weights=False))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.3)
    model.save_pretrained(directory)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_a_mixed_batch_equals_each_request_alone(models, arch):
    _mixed_batch(models, arch)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_padded_decode_steps_as_graphs_replay_them_change_no_token(models, arch):
    """The layout of graph-replayed decode steps (padding rows on the KV cache's trash slot, contexts padded,
    one segment per request), run eagerly on the CPU."""
    engine = _mixed_batch(models, arch, decode_graphs=True)
    assert engine.graphs.recorded, "no decode step took the padded layout"
    # the steps counted through the graphs (what benchmarks read as the share of decode-only steps) are some of the
    # engine's steps, not all: the prefill steps ran eagerly
    assert 0 < engine.graphs.steps < engine.steps


@pytest.mark.parametrize("arch, decode_graphs", [("llama", True), ("gemma2", True), ("qwen2", False)])
def test_attention_read_in_place_from_the_pool_changes_no_token(models, arch, decode_graphs, monkeypatch):
    """The GPU's attention (flex_attention over the whole pool with the step's block mask: pages per chunk, each
    page's owner and index), evaluated unfused on the CPU for every key of the pool: other requests' pages, stale
    slots and the trash page are all masked."""
    monkeypatch.setattr(attention, "reads_in_place", lambda query: True)
    _mixed_batch(models, arch, decode_graphs=decode_graphs)


@pytest.mark.parametrize("arch, in_place", [("llama", True), ("gemma2", True), ("qwen2", False)])
def test_prefill_chunks_over_several_attention_rows_change_no_token(models, arch, in_place, monkeypatch):
    """A prefill chunk longer than a row of queries (QUERY_BLOCK, 4 here) spans several rows of the step's prefill
    layout, each reading its chunk's pages up to its own last query (Gemma2: within its sliding window too), beside
    the decode layout of the other requests' tokens."""
    monkeypatch.setattr(batch_layout, "QUERY_BLOCK", 4)
    if in_place:
        monkeypatch.setattr(attention, "reads_in_place", lambda query: True)
    engine = _mixed_batch(models, arch, max_batch_tokens=32)
    assert engine.steps > 0


def test_warm_up_makes_every_decode_shape_before_the_first_request_and_leaves_nothing_behind(models):
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, max_running=6,
                                    decode_graphs=True)
    engine.warm_up()
    assert sorted(rows for rows, adapted, _ in engine.graphs.recorded) == [1, 2, 4, 8]
    assert engine.pool.free == engine.pool.num_blocks and not engine.has_work()
    name = "mlp_r8"
    completion = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3),
                                 [(name, adapters[name])])[0]
    _check(completion, _alone(checkpoint, adapters[name], PROMPTS[2], 6), PROMPTS[2])
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="before its thread starts"):
            engine.warm_up()
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_compiled_decoder_layers_change_no_token_and_compile_once_per_step_shape(models, arch):
    """Decode steps through torch.compile'd decoder layers (the CPU's inductor): the same tokens and log-probabilities;
    the layers share their compiled code (Gemma2: one more for its sliding-window layers), whatever their count."""
    import torch._dynamo

    torch._dynamo.reset()
    # the models' norms compute in float32 even in a float64 model; compiled, they sum in another order
    engine = _mixed_batch(models, arch, rtol=1e-6, decode_graphs=True, compile_layers=True)
    forwards = [layer.forward for layer in engine.model.model.layers]
    assert all(isinstance(forward, compiled_layers._Either) for forward in forwards)
    shapes = set(engine.graphs.recorded)  # (rows, adapters or not, the adapter pools there are) recorded
    code = forwards[0].eager.__func__.__code__  # the code every layer's compiled forward shares
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
    assert 0 < len(entries) <= len(shapes) * (2 if arch == "gemma2" else 1), (len(entries), shapes)


def test_fused_groups_run_qkv_and_gate_up_as_one_call_each(models):
    checkpoint, _ = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4)
    groups = {pool_id for pool_id in engine.adapters.pool_shapes if "+" in pool_id}
    assert groups == {f"model.layers.{i}.{block}" for i in range(2) for block in
                      ("self_attn.q_proj+model.layers.{i}.self_attn.k_proj+model.layers.{i}.self_attn.v_proj".format(i=i),
                       "mlp.gate_proj+model.layers.{i}.mlp.up_proj".format(i=i))}


def test_members_of_a_fused_group_called_apart_compute_alone(models, monkeypatch):
    """A member whose input is not its group's (a path the model did not take when the group was found) computes
    from its own columns of the group's weight and pools: still every request's own tokens."""
    original = layers.FusedGroup.member_output

    def apart(self, member, x):
        if member:
            self._pending = None
        return original(self, member, x)

    monkeypatch.setattr(layers.FusedGroup, "member_output", apart)
    _mixed_batch(models, "llama")


def _mixed_batch(models, arch, rtol=1e-9, max_batch_tokens=8, **options):
    checkpoint, adapters = models(arch)
    # 4-token blocks and an 8-token budget: prompts are prefilled in chunks beside other requests' decodes
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4,
                                    max_batch_tokens=max_batch_tokens, **options)
    names = [None, *adapters]
    jobs = [(prompt, names[i % len(names)]) for i, prompt in enumerate(PROMPTS + PROMPTS[:2])]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
    handles = []
    for i, (prompt, name) in enumerate(jobs):
        handles.append(engine.submit(prompt, params, None if name is None else (name, adapters[name])))
        if i % 2:  # the next requests join while these run
            engine.step()
            engine.step()
    while engine.has_work():
        engine.step()
    # transformers' eager attention (which Gemma2's soft-capping takes) computes its softmax in float32
    rtol = 1e-6 if arch == "gemma2" else rtol
    for handle, (prompt, name) in zip(handles, jobs):
        _check(handle.result(), _alone(checkpoint, adapters.get(name), prompt, 6), prompt, rtol)
    assert engine.pool.free == engine.pool.num_blocks, "every block went back to the pool"
    return engine


def _admitting(checkpoint, adapters, admit_batch: int, **options):
    """Seven requests of different lengths through an engine of 3 running at most, stepped here: (the engine,
    their handles and jobs, each step's (running before it, waiting before it, joined in it, free slots before it))."""
    engine = Engine.from_pretrained(checkpoint, kv_blocks=64, block_size=4, max_batch_tokens=64, max_running=3,
                                    admit_batch=admit_batch, decode_graphs=True, **options)
    names = [None, *adapters]
    jobs = [(prompt, names[i % len(names)], 3 + 2 * i) for i, prompt in enumerate(PROMPTS + PROMPTS[:3])]
    handles = [engine.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=3),
                             None if name is None else (name, adapters[name])) for prompt, name, tokens in jobs]
    admissions = []
    while engine.has_work():
        before = {r.id for r in engine.scheduler.running}
        waiting = len(engine.scheduler.waiting) + len(engine._incoming)
        free = engine.scheduler.max_running - len(before)
        engine.step()
        joined = len({r.id for r in engine.scheduler.running} - before)
        admissions.append((len(before), waiting, joined, free))
    return engine, handles, jobs, admissions


def test_admitting_requests_together_keeps_steps_decode_only_and_changes_no_token(models):
    """admit_batch 2 of max_running 3: once requests run, waiting ones join two at a time, so more steps are
    decodes alone (those a GPU replays from CUDA graphs; on the CPU, run padded through the same graphs object)
    than when each joins as its slot frees; every request's tokens are still its own."""
    checkpoint, adapters = models("llama")
    engine, handles, jobs, admissions = _admitting(checkpoint, adapters, 2, dtype=torch.float64)
    waited = [step for step in admissions if step[0] and step[1] and not step[2] and step[3]]
    assert waited, "no step ran with a slot free and requests waiting"
    for running, waiting, joined, free in admissions:
        if running and joined:  # beside running requests, requests join two at a time (the last one alone)
            assert free >= 2 or joined == waiting == 1
    for handle, (prompt, name, tokens) in zip(handles, jobs):
        _check(handle.result(), _alone(checkpoint, adapters.get(name), prompt, tokens), prompt)
    assert engine.pool.free == engine.pool.num_blocks
    one_by_one = _admitting(checkpoint, adapters, 1, dtype=torch.float64)[0]
    assert engine.graphs.steps / engine.steps > one_by_one.graphs.steps / one_by_one.steps
    with pytest.raises(ValueError, match="admit_batch"):
        Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4, max_running=2,
                               admit_batch=3)
    # by default an eighth of max_running join together (at least one)
    for max_running, default in ((96, 12), (64, 8), (7, 1)):
        assert Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4,
                                      max_running=max_running).scheduler.admit_batch == default


def test_waiting_requests_of_several_owners_are_admitted_in_turns(models):
    """By arrival alone, one tenant's queued sequences held another's one request until every one of them had run.
    Now owners take turns: the fewest running first, then the one served longest ago; each owner's by arrival."""
    checkpoint, _ = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, max_running=1)
    params = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=3)
    handles = [(f"alice-{i}", engine.submit(PROMPTS[0], params, owner="alice")) for i in range(4)]
    handles += [("bob-0", engine.submit(PROMPTS[1], params, owner="bob")),
                ("carol-0", engine.submit(PROMPTS[1], params, owner="carol"))]
    handles.append(("alice-4", engine.submit(PROMPTS[0], params, owner="alice")))
    admitted = []
    while engine.has_work():
        engine.step()
        for request in engine.scheduler.running:
            name = next(name for name, handle in handles if handle.request is request)
            if name not in admitted:
                admitted.append(name)
    assert admitted == ["alice-0", "bob-0", "carol-0", "alice-1", "alice-2", "alice-3", "alice-4"]
    for name, handle in handles:  # each its own tokens, whatever the order
        _check(handle.result(), _alone(checkpoint, None, PROMPTS[0] if name.startswith("alice") else PROMPTS[1], 2),
               PROMPTS[0] if name.startswith("alice") else PROMPTS[1])
    # without owners (or with one), by arrival
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, max_running=1)
    order = [engine.submit(PROMPTS[i % 2], params) for i in range(3)]
    seen = []
    while engine.has_work():
        engine.step()
        seen += [r for r in engine.scheduler.running if r not in seen]
    assert seen == [handle.request for handle in order]


def test_head_lora_in_replayed_decode_steps_follows_the_batch_as_it_changes(models, tmp_path):
    """Graph-replayed decode steps (their padded layout, eagerly on the CPU) with an adapter on the output head:
    requests end at different steps, so the same row bucket runs different batches, and the head's segments
    (the sampled rows') must be the new batch's, as the other layers' are."""
    checkpoint, adapters = models("llama")
    torch.manual_seed(5)
    _save_random_lora(checkpoint, ["q_proj", "lm_head"], tmp_path / "head")
    adapters = {**adapters, "head": tmp_path / "head"}
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, decode_graphs=True)
    jobs = [(PROMPTS[0], "head", 2), (PROMPTS[1], "attn_r2", 7), (PROMPTS[2], None, 4), (PROMPTS[3], "head", 7)]
    handles = [engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=3), None if name is None
                             else (name, adapters[name])) for prompt, name, n in jobs]
    while engine.has_work():
        engine.step()
    assert engine.graphs.recorded
    for handle, (prompt, name, n) in zip(handles, jobs):
        _check(handle.result(), _alone(checkpoint, adapters.get(name), prompt, n), prompt)


@pytest.mark.parametrize("decode_graphs", [False, True])
def test_preempted_requests_resume_without_losing_or_repeating_a_token(models, decode_graphs):
    checkpoint, adapters = models("llama")
    # 12 blocks of 4 tokens: four requests of up to 19 + 12 tokens cannot all stay
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=12, block_size=4, max_batch_tokens=32,
                                    decode_graphs=decode_graphs)
    names = [None, "attn_r2", "mlp_r8", "embed_head"]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    completions = engine.generate(PROMPTS, params, [None if n is None else (n, adapters[n]) for n in names])
    assert sum(c.preemptions for c in completions) > 0, "the pool was large enough: nothing was preempted"
    for completion, prompt, name in zip(completions, PROMPTS, names):
        _check(completion, _alone(checkpoint, adapters.get(name), prompt, 12), prompt)


def test_float32_greedy_equals_plain(models):
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float32, kv_blocks=64, block_size=4, max_batch_tokens=8)
    names = [None, "attn_r2", "everything_rs", "embed_head"]
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3),
                                  [None if n is None else (n, adapters[n]) for n in names])
    for completion, prompt, name in zip(completions, PROMPTS, names):
        _check(completion, _alone(checkpoint, adapters.get(name), prompt, 8, torch.float32), prompt, rtol=1e-4)


def test_seeded_sampling_repeats_whatever_else_is_batched(models):
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4)
    sampled = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], sampled, [("attn_r2", adapters["attn_r2"])])[0].token_ids
    crowd = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=5), sampled, sampled],
                            [None, ("attn_r2", adapters["attn_r2"]), None])
    assert crowd[1].token_ids == alone
    other_seed = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=1.5, top_p=0.9, top_k=20,
                                                              seed=8, ignore_eos=True),
                                 [("attn_r2", adapters["attn_r2"])])[0].token_ids
    assert other_seed != alone


def test_stop_token_ids_and_max_tokens(models):
    checkpoint, _ = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4)
    free = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]


def test_adapters_beyond_the_slots_wait_and_the_least_recently_used_is_evicted(models):
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=2)
    names = ["attn_r2", "mlp_r8", "everything_rs", "embed_head", "attn_r2"]
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)
    completions = engine.generate([PROMPTS[i % 4] for i in range(5)], params, [(n, adapters[n]) for n in names])
    for i, (completion, name) in enumerate(zip(completions, names)):
        _check(completion, _alone(checkpoint, adapters[name], PROMPTS[i % 4], 5), PROMPTS[i % 4])
    assert len(engine.adapters.resident) == 2


def test_the_engine_computes_with_the_executors_weights(models):
    checkpoint, _ = models("llama")
    executor = symbiosis.Executor.from_pretrained(checkpoint, dtype=torch.float64)
    engine = Engine(checkpoint, executor, kv_blocks=8, block_size=4)
    layer = engine.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert layer.base.weight.data_ptr() == executor.weights.layers[layer.layer_id].weight.data_ptr()
    assert not any(p.numel() >= 64 * 64 and p.dim() == 2 and "embed" not in n for n, p in engine.model.named_parameters()), \
        "the engine holds a base layer's weight of its own"


def test_tokens_stream_from_the_engine_thread(models):
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4).start()
    try:
        handle = engine.submit(PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True), ("mlp_r8", adapters["mlp_r8"]))
        streamed = [token.id for token in handle]
        assert streamed == handle.result().token_ids and len(streamed) == 6
        assert streamed == _alone(checkpoint, adapters["mlp_r8"], PROMPTS[1], 6)[0]
    finally:
        engine.close()


def test_result_times_out_when_no_step_runs(models):
    checkpoint, _ = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4)  # no thread
    handle = engine.submit(PROMPTS[1], SamplingParams(max_tokens=2))
    with pytest.raises(TimeoutError, match="did not finish in time"):
        handle.result(timeout=0.05)
    while engine.has_work():
        engine.step()
    assert len(handle.result(timeout=0.05).token_ids) == 2


def _write_lora(directory, tensors: dict, config: dict) -> None:
    from safetensors.torch import save_file

    directory.mkdir()
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}))


def test_bad_requests_fail_alone(models, tmp_path):
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=16, block_size=4, max_lora_rank=4)
    healthy = engine.submit(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3), ("attn_r2", adapters["attn_r2"]))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    cases = {
        "missing": (tmp_path / "nowhere", AdapterError, "not a local adapter directory"),
        "rank": (adapters["mlp_r8"], AdapterError, "rank 8, above this engine's limit of 4"),
        "shapes": (None, AdapterError, "this base model needs"),
        "fingerprint": (None, AdapterError, "another base model"),
        "ia3": (None, UnsupportedAdapter, "a IA3 adapter; the engine runs LoRA adapters"),
        "dora": (None, UnsupportedAdapter, "use_dora=True"),
        "pickle": (None, AdapterError, "a pickle"),
        "nan_alpha": (None, AdapterError, "must be finite"),  # loaded, then every request's logits were NaN
        "inf_alpha_pattern": (None, AdapterError, "must be finite"),
        "integers": (None, AdapterError, "holds int64 values"),  # cast into weights silently
        "float8": (None, AdapterError, "holds float8_e4m3fn values"),  # a server error: no isfinite for float8
    }
    _write_lora(tmp_path / "shapes", {key + "A.weight": torch.zeros(2, 32), key + "B.weight": torch.zeros(64, 2)}, {})
    _write_lora(tmp_path / "fingerprint", {key + "A.weight": torch.zeros(2, 64), key + "B.weight": torch.zeros(64, 2)}, {})
    (tmp_path / "fingerprint" / "symbiosis.json").write_text(json.dumps({"base_fingerprint": "0" * 64}))
    _write_lora(tmp_path / "ia3", {"base_model.model.model.layers.0.mlp.down_proj.ia3_l": torch.ones(1, 112)},
                {"peft_type": "IA3"})
    _write_lora(tmp_path / "dora", {key + "A.weight": torch.zeros(2, 64), key + "B.weight": torch.zeros(64, 2)},
                {"use_dora": True})
    _write_lora(tmp_path / "pickle", {key + "A.weight": torch.zeros(2, 64), key + "B.weight": torch.zeros(64, 2)}, {})
    (tmp_path / "pickle" / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    pair = {key + "A.weight": torch.zeros(2, 64), key + "B.weight": torch.zeros(64, 2)}
    _write_lora(tmp_path / "nan_alpha", pair, {"lora_alpha": float("nan")})
    _write_lora(tmp_path / "inf_alpha_pattern", pair, {"alpha_pattern": {"q_proj": float("inf")}})
    _write_lora(tmp_path / "integers", {name: t.long() for name, t in pair.items()}, {})
    _write_lora(tmp_path / "float8", {name: t.to(torch.float8_e4m3fn) for name, t in pair.items()}, {})
    for name, (directory, error, message) in cases.items():
        with pytest.raises(error, match=message):
            engine.submit(PROMPTS[1], SamplingParams(max_tokens=4), (name, directory or tmp_path / name))
    with pytest.raises(BadCall, match="exceeds the model's context of 128"):
        engine.submit([1] * 120, SamplingParams(max_tokens=16))
    with pytest.raises(BadCall, match="exceeds the engine's whole KV cache of 64 tokens"):
        engine.submit([1] * 60, SamplingParams(max_tokens=16))
    with pytest.raises(BadCall, match="outside the vocabulary"):
        engine.submit([1, 128], SamplingParams(max_tokens=4))
    with pytest.raises(BadCall, match="top_p"):
        SamplingParams(top_p=0.0)
    # An adapter whose values are finite but whose output overflows: NaN logits end that request alone.
    _write_lora(tmp_path / "overflow", {key + "A.weight": torch.full((2, 64), 1e200, dtype=torch.float64),
                                        key + "B.weight": torch.full((64, 2), 1e200, dtype=torch.float64)}, {})
    broken = engine.submit(PROMPTS[1], SamplingParams(max_tokens=4), ("overflow", tmp_path / "overflow"))
    while engine.has_work():
        engine.step()
    with pytest.raises(GenerationError, match="NaN or Inf"):
        broken.result()
    _check(healthy.result(), _alone(checkpoint, adapters["attn_r2"], PROMPTS[0], 6), PROMPTS[0])
    assert engine.pool.free == engine.pool.num_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("decode_graphs, compile_layers", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("block_size, max_batch_tokens", [(16, 8), (64, 512)])
def test_on_the_gpu_the_triton_kernels_give_plain_peft_tokens(models, decode_graphs, compile_layers, block_size,
                                                               max_batch_tokens):
    """float32 on CUDA (the SGMV kernels in Triton, the compiled paged attention, decode steps eager or replayed
    from CUDA graphs, their decoder layers compiled or not; prompts in small chunks beside decodes, or whole)
    against plain transformers + PEFT."""
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.float32, kv_blocks=16, block_size=block_size,
                                    max_batch_tokens=max_batch_tokens, decode_graphs=decode_graphs,
                                    compile_layers=compile_layers)
    names = [None, "attn_r2", "mlp_r8", "everything_rs"]
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3),
                                  [None if n is None else (n, adapters[n]) for n in names])
    for completion, prompt, name in zip(completions, PROMPTS, names):
        _check(completion, _alone(checkpoint, adapters.get(name), prompt, 8, torch.float32), prompt, rtol=1e-3)
    assert bool(engine.graphs and engine.graphs.recorded) == decode_graphs


@pytest.mark.gpu
def test_on_the_gpu_long_prompts_over_several_prefill_rows_give_plain_peft_tokens(tmp_path):
    """Prompts of 300 and 700 tokens (rows of 128 queries in the prefill layout, the longer one in two chunks of a
    512-token budget) beside a short one and its decodes, float32 on CUDA with the compiled kernels and the engine's
    warm-up, against plain transformers + PEFT."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    _save_random_lora(tmp_path / "base", ["q_proj", "v_proj", "down_proj"], tmp_path / "adapter")
    engine = Engine.from_pretrained(tmp_path / "base", device="cuda", dtype=torch.float32, kv_blocks=64,
                                    block_size=64, max_batch_tokens=512, max_running=8)
    engine.warm_up()
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (300, 700, 9)]
    adapters = [("adapter", tmp_path / "adapter"), None, ("adapter", tmp_path / "adapter")]
    completions = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3), adapters)
    for completion, prompt, adapter in zip(completions, prompts, adapters):
        expected = _alone(tmp_path / "base", None if adapter is None else adapter[1], prompt, 6, torch.float32)
        _check(completion, expected, prompt[:8], rtol=1e-3)


@pytest.mark.gpu
def test_on_the_gpu_steps_run_on_their_own_stream_beside_other_work(models):
    """The engine's thread launches its steps on its own high-priority stream; while another thread keeps the
    default stream full of GEMMs (as a training pass does), every request still gets plain PEFT's tokens."""
    import threading

    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.float32, kv_blocks=16, block_size=16)
    assert engine.stream is not None and engine.stream != torch.cuda.default_stream()
    busy, stop = torch.randn(2048, 2048, device="cuda"), threading.Event()

    def flood():
        while not stop.is_set():
            for _ in range(20):
                torch.mm(busy, busy)
            torch.cuda.current_stream().synchronize()
    flooding = threading.Thread(target=flood)
    flooding.start()
    engine.start()
    try:
        names = [None, "attn_r2", "everything_rs"]
        handles = [engine.submit(prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3),
                                 None if n is None else (n, adapters[n])) for prompt, n in zip(PROMPTS, names)]
        completions = [handle.result(timeout=120) for handle in handles]
    finally:
        stop.set()
        flooding.join()
        engine.close()
    for completion, prompt, name in zip(completions, PROMPTS, names):
        _check(completion, _alone(checkpoint, adapters.get(name), prompt, 8, torch.float32), prompt, rtol=1e-3)


BOTTLENECK_TARGETS = {"llama": ("self_attn.o_proj", "mlp.down_proj"), "gpt2": ("attn.c_proj", "mlp.c_proj")}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("decode_graphs", [False, True])
def test_bottleneck_adapters_batch_with_lora_and_none_and_equal_plain_hooks(models, arch, decode_graphs, tmp_path):
    """Houlsby adapters (HMI eq. 1) of two ranks and activations, a LoRA and no adapter in one batch: each request
    makes the tokens and log-probabilities plain transformers with the bottleneck hooked on makes alone."""
    checkpoint, adapters = models(arch)
    base = AutoModelForCausalLM.from_pretrained(checkpoint)
    targets = BOTTLENECK_TARGETS[arch]
    houlsby = save_bottleneck(tmp_path / "houlsby", random_bottleneck(base, targets, 4, seed=1))
    attention_only = save_bottleneck(tmp_path / "gelu", random_bottleneck(base, targets[:1], 8, seed=2),
                                     non_linearity="gelu", scaling=0.5)
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, max_lora_rank=8,
                                    decode_graphs=decode_graphs)
    requests = [("houlsby", houlsby), ("gelu", attention_only), ("mlp_r8", adapters["mlp_r8"]), None]
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3), requests)
    for completion, prompt, request in zip(completions, PROMPTS, requests):
        _check(completion, _alone(checkpoint, None if request is None else request[1], prompt, 6), prompt)
    targeted = len(random_bottleneck(base, targets, 1, 0))  # every layer's attention and MLP outputs
    assert sum(pools.down is not None for pools in engine.adapters.bottleneck_pools.values()) == targeted


def test_bad_bottleneck_adapters_are_refused_with_the_reason(models, tmp_path):
    checkpoint, _ = models("llama")
    base = AutoModelForCausalLM.from_pretrained(checkpoint)
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4, max_lora_rank=8)
    fused = save_bottleneck(tmp_path / "fused", random_bottleneck(base, ("self_attn.q_proj",), 4, 0))
    with pytest.raises(AdapterError, match="shares its input with sibling layers"):
        engine.submit(PROMPTS[0], adapter=("fused", fused))
    wide = save_bottleneck(tmp_path / "wide", random_bottleneck(base, ("mlp.down_proj",), 16, 0))
    with pytest.raises(AdapterError, match="bottleneck of 16, above this engine's limit of 8"):
        engine.submit(PROMPTS[0], adapter=("wide", wide))
    weights = random_bottleneck(base, ("mlp.down_proj",), 4, 0)
    next(iter(weights.values()))["up.bias"] = torch.zeros(3)
    with pytest.raises(AdapterError, match="bottleneck tensors have shapes"):
        engine.submit(PROMPTS[0], adapter=("short", save_bottleneck(tmp_path / "short", weights)))
    odd = save_bottleneck(tmp_path / "odd", random_bottleneck(base, ("mlp.down_proj",), 4, 0))
    config = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**config, "non_linearity": "tanh"}))
    with pytest.raises(AdapterError, match="non_linearity 'tanh' is not one of relu, gelu, silu"):
        engine.submit(PROMPTS[0], adapter=("odd", odd))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe"])
def test_moe_models_serve_each_request_as_plain_peft(arch, tmp_path):
    """A MoE base in the engine: the experts are the executor's (one call per chosen expert), attention adapters
    are the engine's (SGMV); a mixed batch of adapters and none makes each request's own tokens and log-probs."""
    from matrix import make_checkpoint

    make_checkpoint(arch, tmp_path / "base", output_router_logits=False)
    adapters = {}
    for i, (name, targets) in enumerate({"attn_r2": ["q_proj", "v_proj"], "all_attn_r4": ["q_proj", "k_proj",
                                                                                          "v_proj", "o_proj"]}.items()):
        torch.manual_seed(20 + i)
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64),
                                    peft.LoraConfig(r=2 + 2 * i, lora_alpha=8, target_modules=targets,
                                                    init_lora_weights=False))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.3)
        model.save_pretrained(tmp_path / name)
        adapters[name] = tmp_path / name
    engine = Engine.from_pretrained(tmp_path / "base", dtype=torch.float64, kv_blocks=64, block_size=4,
                                    max_batch_tokens=8)
    names = [None, *adapters]
    jobs = [(prompt, names[i % len(names)]) for i, prompt in enumerate(PROMPTS)]
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)
    handles = [engine.submit(prompt, params, None if name is None else (name, adapters[name])) for prompt, name in jobs]
    while engine.has_work():
        engine.step()
    for handle, (prompt, name) in zip(handles, jobs):
        _check(handle.result(), _alone(tmp_path / "base", adapters.get(name), prompt, 5), prompt)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        Engine.from_pretrained(tmp_path / "base", dtype=torch.float64, kv_blocks=8, block_size=4, decode_graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_on_the_gpu_moe_decode_steps_replay_from_graphs_as_they_run_eagerly(arch, tmp_path):
    """bf16 on a Hopper GPU: the experts' grouped GEMMs keep their offsets on the device, so MoE decode steps can be
    recorded as CUDA graphs; replayed, they make the eager engine's tokens and log-probabilities."""
    from matrix import make_checkpoint

    from symbiosis.engine.engine import _experts_on_device

    make_checkpoint(arch, tmp_path / "base", output_router_logits=False)
    options = dict(device="cuda", dtype=torch.bfloat16, kv_blocks=32, block_size=16)
    eager = Engine.from_pretrained(tmp_path / "base", decode_graphs=False, **options)
    if not _experts_on_device(eager.model.symbiosis_session.executor):
        pytest.skip("no grouped GEMM on this GPU")
    replayed = Engine.from_pretrained(tmp_path / "base", decode_graphs=True, **options)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    ours, theirs = replayed.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert replayed.graphs.recorded
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor([t.logprob for t in a.logprobs]),
                              torch.tensor([t.logprob for t in b.logprobs]), rtol=5e-2, atol=5e-2)


def test_steps_on_the_cpu_leave_nothing_behind(models):
    """The unfused attention of the CPU keeps nothing a step: flex_attention called outside torch.compile kept a
    compiled wrapper of its own for good at every call (torch 2.13), ~11 objects a request here, without end."""
    import gc

    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float32, kv_blocks=32, block_size=4, max_lora_rank=8)

    def serve(count: int) -> None:
        handles = [engine.submit(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=5, ignore_eos=True),
                                 ("attn_r2", adapters["attn_r2"]) if i % 2 else None) for i in range(count)]
        while engine.has_work():
            engine.step()
        assert all(len(h.result().token_ids) == 5 for h in handles)

    serve(8)  # first steps make what lives on (compiled code, caches)
    gc.collect()
    before = len(gc.get_objects())
    serve(40)
    gc.collect()
    assert len(gc.get_objects()) - before < 100


def test_deferred_wake_ups_deliver_every_event_and_flush_before_the_engine_rests(models):
    """`defer_wakeups`: readers with put_quietly/flush get every event quietly, the same tokens, and a flush after
    the last of them (the engine wakes them before it waits for the device, and at once when nothing is in flight)."""
    checkpoint, adapters = models("llama")

    class Reader:
        def __init__(self):
            self.log = []

        def put(self, event):
            self.log.append(("put", event))

        def put_quietly(self, event):
            self.log.append(("quiet", event))

        def flush(self):
            self.log.append(("flush", None))

    def run(defer: bool):
        engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=32, block_size=4, max_lora_rank=4)
        engine.defer_wakeups = defer
        readers = [Reader() for _ in PROMPTS]
        for prompt, reader in zip(PROMPTS, readers):
            engine.submit(prompt, SamplingParams(max_tokens=4, ignore_eos=True), ("attn_r2", adapters["attn_r2"]),
                          events=reader)
        while engine.has_work():
            engine.step()
        return readers

    plain, deferred = run(False), run(True)
    for before, after in zip(plain, deferred):
        assert [kind for kind, _ in before.log] == ["put"] * 5
        assert {kind for kind, _ in after.log} == {"quiet", "flush"} and after.log[-1][0] == "flush"
        events = [event for kind, event in after.log if kind == "quiet"]
        assert [getattr(e, "id", None) for e in events] == [getattr(e, "id", None) for _, e in before.log]
        assert events[-1].reason == "length"


def test_deferred_wake_ups_come_before_an_eager_launch_and_after_a_replayed_one(models):
    """With `defer_wakeups`, the events read so far wait through a decode step's launch (a graph's replay: short)
    but not through an eager step's (a prefill's, ~10x the host time): the readers are flushed before it."""
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=32, block_size=4, max_lora_rank=4,
                                    decode_graphs=True)
    log = []

    class Reader:
        put = put_quietly = lambda self, event: log.append("event")  # noqa: E731
        flush = lambda self: log.append("flush")  # noqa: E731

    launch = engine._launch

    def logged(chunks):
        log.append("replayed" if engine._replays(chunks) else "eager")
        return launch(chunks)

    engine._launch = logged
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.submit(PROMPTS[0], params, ("attn_r2", adapters["attn_r2"]), events=Reader())
    for _ in range(4):
        engine.step()
    engine.submit(PROMPTS[1], params, events=Reader())  # a prefill beside the first one's decodes
    while engine.has_work():
        engine.step()
    pending, launches = 0, {"replayed": 0, "eager": 0}
    for entry in log:
        if entry in launches:
            launches[entry] += 1
            assert entry == "replayed" or pending == 0, log  # nothing read waits through an eager launch
            if entry == "replayed" and pending:
                launches["replayed with events waiting"] = launches.get("replayed with events waiting", 0) + 1
        pending = 0 if entry == "flush" else pending + (entry == "event")
    assert launches["eager"] >= 2 and launches.get("replayed with events waiting", 0) >= 1, launches
