"""The engine's adapter tiers (engine/adapters.py): an adapter read from disk, placed from host memory or found
already in a device slot gives the very same tokens and log-probabilities; the host tier keeps to its byte budget,
least recently used first; on a GPU each layer waits only for its own pool's copy."""

from __future__ import annotations

import time

import pytest
import safetensors.torch
import torch

from symbiosis.engine import Engine, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)


def _run(engine, adapters, name):
    completion = engine.generate([PROMPT], PARAMS, [(name, adapters[name])])[0]
    return completion.token_ids, [(t.logprob, t.top_logprobs) for t in completion.logprobs]


def _tier_walk(engine, adapters):
    """The same request with `everything_rs` from each tier in turn: disk, device slot, host memory, disk again."""
    stats = engine.adapters.stats
    first = _run(engine, adapters, "everything_rs")
    assert (stats.disk_reads, stats.placements) == (1, 1)
    assert _run(engine, adapters, "everything_rs") == first and stats.device_hits == 1  # still in its slot
    _run(engine, adapters, "mlp_r8")  # takes the only slot
    assert _run(engine, adapters, "everything_rs") == first
    assert (stats.host_hits, stats.disk_reads, stats.placements) == (2, 2, 3)  # from host memory, not read again
    engine.adapters.host_budget = 0  # host memory keeps nothing: each use reads the disk
    _run(engine, adapters, "mlp_r8")
    assert _run(engine, adapters, "everything_rs") == first and stats.disk_reads == 4
    assert engine.adapters.tiers()["host"] == {"adapters": 0, "bytes": 0, "budget_bytes": 0}


def test_output_is_the_same_whichever_tier_the_adapter_came_from(models):
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=1)
    _tier_walk(engine, adapters)


def test_an_adapter_that_replaces_another_in_its_slot_adds_nothing_of_the_old_one(models):
    """One slot, alternately an adapter on every projection and one on the MLP only: the second and later evictions
    of the first zero its scales through views made once (`AdapterStore._clears`), so the MLP-only adapter's outputs
    stay a fresh engine's, and so do the first one's."""
    checkpoint, adapters = models("llama")
    fresh = {name: _run(Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4),
                        adapters, name) for name in ("everything_rs", "attn_r2")}
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=1)
    for _ in range(3):
        for name in ("everything_rs", "attn_r2"):
            assert _run(engine, adapters, name) == fresh[name]
    assert engine.adapters.stats.placements == 6 and len(engine.adapters._clears) == 2


def test_an_adapter_of_the_evicted_ones_layout_overwrites_its_scales_and_zeroes_nothing(models, tmp_path, monkeypatch):
    """Two adapters of one layout (the same layers and ranks, other weights) take turns in one slot: a placement
    zeroes none of the evicted one's scales (its own overwrite every one, `AdapterStore._clear`) nor the rows beyond
    its rank (the evicted one's placement left them zero), and each keeps a fresh engine's outputs; an adapter of
    another layout still zeroes what it does not write."""
    checkpoint, adapters = models("llama")
    twin = tmp_path / "attn_r2_twin"  # attn_r2's layout, its weights negated and doubled
    twin.mkdir()
    (twin / "adapter_config.json").write_bytes((adapters["attn_r2"] / "adapter_config.json").read_bytes())
    tensors = safetensors.torch.load_file(adapters["attn_r2"] / "adapter_model.safetensors")
    safetensors.torch.save_file({k: -2 * v for k, v in tensors.items()}, twin / "adapter_model.safetensors")
    adapters = {**adapters, "twin": twin}
    names = ("attn_r2", "twin", "everything_rs")
    fresh = {name: _run(Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4),
                        adapters, name) for name in names}
    assert fresh["attn_r2"] != fresh["twin"]
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=1)
    zero_calls = []
    zero = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda tensors: (zero_calls.append(len(tensors)), zero(tensors)))
    for _ in range(2):
        # ranks 2 and 4 in pools of rank 64: the rows beyond them are zeroed after another layout (or none) only
        for name, zeroes in (("attn_r2", True), ("twin", False), ("attn_r2", False), ("everything_rs", True)):
            zero_calls.clear()
            assert _run(engine, adapters, name) == fresh[name]
            assert bool(zero_calls) == zeroes, (name, zero_calls)
    store = engine.adapters
    zeroed = {(key[1] == key[3], len(key[1].layers) > len(key[3].layers)): len(scales) for key, (scales, _) in store._clears.items()}
    assert zeroed == {(True, False): 0, (False, False): 0, (False, True): zeroed[False, True]}  # evicted, placed
    assert zeroed[False, True] > 0  # everything_rs's MLP scales, which attn_r2 does not write
    # adapters alike share one layout object, made as they were read: the placing caches' keys hash it once
    layouts = {name: store.load(name, adapters[name]).layout for name in names}
    assert layouts["attn_r2"] is layouts["twin"] and layouts["attn_r2"] != layouts["everything_rs"]
    assert {key[1] for key in store._waves} == {layouts["attn_r2"], layouts["everything_rs"]}


def test_the_host_tier_keeps_to_its_byte_budget_least_recently_used_first(models):
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4)
    store = engine.adapters
    sizes = {name: store.load(name, adapters[name]).nbytes for name in ("attn_r2", "mlp_r8", "everything_rs")}
    lora_bytes = {name: sum(a.nbytes + b.nbytes for adapter in [store.load(name, adapters[name])]
                            for a, b in map(adapter.lora, adapter.layers.values())) for name in sizes}
    assert sizes == lora_bytes  # one buffer, exactly the matrices
    store.host_budget = 0  # empties it
    assert store.tiers()["host"]["bytes"] == 0
    store.host_budget = sizes["attn_r2"] + sizes["mlp_r8"] + sizes["everything_rs"] - 1
    reads = store.stats.disk_reads
    for name in ("attn_r2", "mlp_r8", "attn_r2", "everything_rs"):  # attn_r2 used again: mlp_r8 is the oldest
        store.load(name, adapters[name])
    assert store.stats.disk_reads == reads + 3
    assert [a.name for a in store._host.values()] == ["attn_r2", "everything_rs"]
    assert store.host_bytes == sizes["attn_r2"] + sizes["everything_rs"] <= store.host_budget


def test_an_adapter_in_host_memory_is_a_few_objects_for_the_cyclic_collector(models, tmp_path):
    """Thousands of adapters live in the host tier after the service froze its heap: each full collection walks
    every object of theirs that the collector tracks, holding the GIL. An adapter's layers are plain spans (numbers
    in tuples), untracked once seen: the adapter, its buffer, its scales (and its key's tuple, until a later
    collection) are all that is walked, whatever its layers (LoRA on every linear layer, the input embedding and
    the head; a bottleneck adapter)."""
    import gc

    from transformers import AutoModelForCausalLM

    from symbiosis.client.bottleneck import random_bottleneck, save_bottleneck

    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4)
    base = AutoModelForCausalLM.from_pretrained(checkpoint)
    houlsby = save_bottleneck(tmp_path / "houlsby", random_bottleneck(base, ("self_attn.o_proj", "mlp.down_proj"), 4,
                                                                      seed=1))
    loaded = [engine.adapters.load(name, adapters[name]) for name in ("everything_rs", "embed_head")]
    loaded.append(engine.adapters.load("houlsby", houlsby))
    assert loaded[1].embedding is not None and loaded[2].bottlenecks
    gc.collect()
    for adapter in loaded:
        held = [adapter.layers, adapter.bottlenecks, *adapter.layers.values(),
                *adapter.bottlenecks.values()] + ([adapter.embedding] if adapter.embedding is not None else [])
        assert not any(gc.is_tracked(thing) for thing in held), adapter.name
        # and the views the placement takes are the matrices as read
        for span in adapter.layers.values():
            a, b = adapter.lora(span)
            assert a.shape == (span[1], span[2]) and b.shape == (span[3], span[1])


def test_an_adapter_is_one_host_buffer_in_model_order_and_a_slot_costs_slot_bytes(models):
    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4)
    adapter = engine.adapters.load("everything_rs", adapters["everything_rs"])
    tensors = [t for span in adapter.layers.values() for t in adapter.lora(span)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    model_order = [layer_id for layer_id in engine.adapters.specs if layer_id in adapter.layers]
    assert list(adapter.layers) == model_order
    spans = [(t.storage_offset(), t.numel()) for t in tensors]  # packed in that order: a run of layers (a wave of
    assert spans[0][0] == 0 and all(at + n == after for (at, n), (after, _) in zip(spans, spans[1:]))  # a placement)
    assert adapter.scales.shape == (len(adapter.layers), 1)  # is one range of the buffer, its scales one of those
    store = engine.adapters
    lora = sum(p.a.numel() + p.b.numel() for p in [store._pool(i) for i in store.pool_shapes]) * 8 + \
        sum(p.scales.numel() * 4 for p in store.pools.values())
    bottleneck = sum(sum(t.numel() for t in (p.down, p.down_bias, p.up, p.up_bias)) * 8 + 8 * p.scales.numel()
                     for p in [store._bottleneck_pool(i) for i in store.bottleneck_pools])
    assert store.slot_bytes * store.num_slots == lora + bottleneck  # every pool made: what the slots cost
    budgeted = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4,
                                      adapter_device_bytes=3 * store.slot_bytes + 1)
    assert budgeted.adapters.num_slots == 3
    with pytest.raises(ValueError, match="hold no adapter slot"):
        Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=8, block_size=4,
                               adapter_device_bytes=store.slot_bytes - 1)


@pytest.mark.gpu
def test_on_the_gpu_each_layer_waits_for_its_own_copy_and_tiers_agree(models):
    """float32 on CUDA: after a placement every targeted pool holds a pending copy event; an eager step waits for
    them layer by layer (none is left pending), and every tier gives the same tokens, eager or graph-replayed."""
    checkpoint, adapters = models("llama")
    for decode_graphs in (False, True):
        engine = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.float32, kv_blocks=16, block_size=16,
                                        adapter_slots=1, decode_graphs=decode_graphs)
        store = engine.adapters
        store.acquire(store.load("everything_rs", adapters["everything_rs"]))
        pending = [pool_id for pool_id, pools in store.pools.items() if pools.ready is not None]
        assert pending and len(pending) == sum(pools.a is not None for pools in store.pools.values())
        store.release(0)
        placed_first = _run(engine, adapters, "everything_rs")
        assert all(pools.ready is None for pools in store.pools.values())
        _run(engine, adapters, "mlp_r8")  # takes the slot
        store.host_budget = 0  # nothing in host memory: the walk starts from disk
        store.host_budget = 4 << 30
        store.stats.__init__()
        _tier_walk(engine, adapters)
        assert _run(engine, adapters, "everything_rs") == placed_first


def test_a_placement_is_a_few_copies_whose_pool_rows_are_dense_at_the_pools_rank(models):
    """Each wave: one copy of its range of the host buffer, then the pool rows from the staging buffer in one fused
    copy when every row is dense (an adapter of the pools' rank; a lower rank's B columns are strided, copied
    apart); the tokens agree either way."""
    checkpoint, adapters = models("llama")
    outputs = []
    for max_rank, dense in ((8, True), (64, False)):
        engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=1,
                                        max_lora_rank=max_rank)
        outputs.append(_run(engine, adapters, "mlp_r8"))
        waves = list(engine.adapters._waves.values())
        assert waves and all(len(wave.copies) == (1 if dense else 2) for wave in waves)
        assert all(t.is_contiguous() for t in waves[0].copies[0][0])
        assert all(t.shape == s.shape for wave in waves for targets, sources in wave.copies
                   for t, s in zip(targets, sources))
    assert outputs[0][0] == outputs[1][0]
    for (ours, top), (theirs, their_top) in zip(outputs[0][1], outputs[1][1]):
        assert abs(ours - theirs) < 1e-9


@pytest.mark.gpu
def test_on_the_gpu_a_placement_waits_only_for_the_steps_that_read_its_slot(models):
    """A step still queued that reads slot 0 (a long kernel, then `read_by`): an adapter placed into the free slot 1
    lands without waiting for it; one placed into slot 0 (evicting the adapter that step reads) waits for it. The
    evicted adapter targets every layer, the new one the MLP only: its output equals a fresh engine's, so the old
    scales were zeroed before the new adapter's step read them."""
    checkpoint, adapters = models("llama")
    fresh = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.float32, kv_blocks=16, block_size=16,
                                   decode_graphs=False)
    expected = _run(fresh, adapters, "mlp_r8")
    engine = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.float32, kv_blocks=16, block_size=16,
                                    adapter_slots=2, decode_graphs=False)
    store = engine.adapters
    load = lambda name: store.load(name, adapters[name])  # noqa: E731
    store.release(store.acquire(load("everything_rs")))
    torch.cuda.synchronize()
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(2_000_000_000)  # ~1 s: a step in flight
        store.read_by({0})
    assert store.acquire(load("attn_r2")) == 1
    store._copy_stream.synchronize()
    assert not engine.stream.query()  # the copies into slot 1 did not wait for the step
    store.release(1)
    assert store.acquire(load("mlp_r8")) == 0  # evicts everything_rs, which the step reads
    store._copy_stream.synchronize()
    assert engine.stream.query()  # ... so its copies waited for the step
    store.release(0)
    assert _run(engine, adapters, "mlp_r8") == expected


def test_a_placement_in_one_wave_or_in_several_gives_the_same_tokens(models, monkeypatch):
    """An adapter smaller than WAVE_BYTES goes in one wave; with WAVE_BYTES lowered the same adapter goes in
    PLACEMENT_WAVES waves, each its own range of the buffer: the same tokens and log-probabilities."""
    from symbiosis.engine import adapters as adapter_store

    checkpoint, adapters = models("llama")
    outputs, waves = [], []
    for wave_bytes in (adapter_store.WAVE_BYTES, 1):
        monkeypatch.setattr(adapter_store, "WAVE_BYTES", wave_bytes)
        engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=1)
        outputs.append(_run(engine, adapters, "everything_rs"))
        waves.append(len(engine.adapters._waves))
    assert waves == [1, min(adapter_store.PLACEMENT_WAVES, len(engine.adapters.load("everything_rs",
                                                                                      adapters["everything_rs"]).layers))]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("count", [1, 2, 5, 7, 16, 112, 224])
@pytest.mark.parametrize("megabytes", [1, 40, 91, 335, 10_000])
def test_waves_cover_the_layers_in_order_each_as_long_as_those_before_it(count, megabytes):
    from symbiosis.engine.adapters import PLACEMENT_WAVES, WAVE_BYTES, wave_bounds

    bounds = wave_bounds(count, megabytes << 20)
    assert len(bounds) == max(1, min(PLACEMENT_WAVES, count, (megabytes << 20) // WAVE_BYTES))
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(first < end for first, end in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    lengths = [end - first for first, end in bounds]
    if count >= 1 << (len(bounds) - 1):  # room for the parts 1, 1, 2, 4, ..: each wave no longer than all before it
        assert all(length <= sum(lengths[:i]) + 1 for i, length in enumerate(lengths) if i)
    if (count, megabytes) == (224, 335):  # Llama-3-8B, seven projections a layer: the first wave is layer 0
        assert lengths == [7, 7, 14, 28, 56, 112]


def test_adapters_of_arrived_requests_are_placed_while_the_step_runs_and_nothing_pinned_is_evicted(models):
    """`Engine._prefetch` (after a step's launch): a request that arrived meanwhile has its adapter placed before
    the next step admits it (admission then finds it in its slot), with the same tokens as alone; the store's
    prefetch never evicts a pinned adapter, nor one another waiting request needs."""
    checkpoint, adapters = models("llama")
    expected = _run(Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4), adapters,
                    "mlp_r8")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=2)
    store = engine.adapters
    running = engine.submit(PROMPT, PARAMS, ("attn_r2", adapters["attn_r2"]))
    engine.step()  # attn_r2's request runs, pinning its slot
    arrived = engine.submit(PROMPT, PARAMS, ("mlp_r8", adapters["mlp_r8"]))
    engine._prefetch()
    assert set(store.resident) == {"attn_r2", "mlp_r8"} and store.stats.placements == 2
    hits = store.stats.device_hits
    while engine.has_work():
        engine.step()
    assert store.stats.device_hits == hits + 1 and store.stats.placements == 2  # admitted from its slot
    completion = arrived.result()  # batched with the other request: its tokens, its log-probabilities to rounding
    assert completion.token_ids == expected[0]
    assert [t.logprob for t in completion.logprobs] == pytest.approx([lp for lp, _ in expected[1]], abs=1e-9)
    assert running.result().finish_reason == "length"

    pinned = store.acquire(store.load("everything_rs", adapters["everything_rs"]))  # evicts the LRU, attn_r2
    waiting = [store.load(name, adapters[name]) for name in ("attn_r2", "mlp_r8")]
    assert store.prefetch(waiting) == 0  # mlp_r8 is resident; attn_r2 could only evict a pinned or a wanted one
    assert store.resident.keys() == {"everything_rs", "mlp_r8"} and store.resident["everything_rs"] == pinned


@pytest.mark.parametrize("placer_fails", [False, True])
def test_a_request_arriving_while_the_engine_waits_for_the_device_has_its_adapter_placed_then(models, monkeypatch,
                                                                                             caplog, placer_fails):
    """The placer thread (`Engine._place_arrivals`): a request that arrives while the engine's thread waits for a
    step's tokens (after that step's `_prefetch`) has its adapter placed during the wait, not by the next step's
    admission; its tokens are those of its adapter alone. The device's wait is held open here by a gate. A placer
    whose placement raises logs it and lives on; admission places the adapter. One that arrives while the engine's
    thread is idle is placed by that thread's admission (a thread just woken places it several times slower)."""
    import threading

    from symbiosis.engine import sampling

    checkpoint, adapters = models("llama")
    expected = _run(Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4), adapters,
                    "mlp_r8")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=2)
    store, placers = engine.adapters, {}
    hold, waiting, release = threading.Event(), threading.Event(), threading.Event()
    device_wait, place = sampling.Launched.wait, store._place

    def held_wait(launched):
        if hold.is_set():  # the "device" runs until the test lets it finish
            waiting.set()
            assert release.wait(30)
        device_wait(launched)

    def placing(slot, adapter, evicted=None):
        placers[adapter.name] = threading.current_thread().name
        if placer_fails and placers[adapter.name] == "symbiosis-engine-placer":
            raise RuntimeError("out of memory (simulated)")
        place(slot, adapter, evicted)

    monkeypatch.setattr(sampling.Launched, "wait", held_wait)
    monkeypatch.setattr(store, "_place", placing)
    engine.start()
    try:
        hold.set()
        running = engine.submit(PROMPT, PARAMS, ("attn_r2", adapters["attn_r2"]))
        assert waiting.wait(30)  # the engine's thread waits for the step after running's prefill
        arrived = engine.submit(PROMPT, PARAMS, ("mlp_r8", adapters["mlp_r8"]))
        deadline = time.monotonic() + 30
        while "mlp_r8" not in placers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert placers.get("mlp_r8") == "symbiosis-engine-placer" and not release.is_set()
        hold.clear()
        release.set()
        completion = arrived.result(timeout=60)
        if placer_fails:
            assert placers["mlp_r8"] == "symbiosis-engine" and engine._placer.is_alive()
            assert "placing an arriving request's adapter failed" in caplog.text
        assert completion.token_ids == expected[0]
        assert [t.logprob for t in completion.logprobs] == pytest.approx([lp for lp, _ in expected[1]], abs=1e-9)
        assert running.result(timeout=60).finish_reason == "length"
        assert store.stats.placements == 2
        assert placers["attn_r2"] == "symbiosis-engine"  # it came to an idle engine: admission placed it
    finally:
        release.set()
        engine.close()


def test_the_placer_stops_between_placements_once_the_engines_wait_is_over(models, monkeypatch):
    """Two arrivals placed by the placer during the engine's wait for the device: the wait ends during the first
    placement, so the placer leaves the second to the engine's thread (its next step's admission or `_prefetch`),
    and the engine's next launch waits for one placement, not for all of them."""
    import threading

    from symbiosis.engine import sampling

    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=3)
    store, placers = engine.adapters, {}
    hold, waiting, release = threading.Event(), threading.Event(), threading.Event()
    both_sent, in_placement, finish = threading.Event(), threading.Event(), threading.Event()
    device_wait, place, prefetch = sampling.Launched.wait, store._place, engine._prefetch

    def held_wait(launched):
        if hold.is_set():
            waiting.set()
            assert release.wait(30)
        device_wait(launched)

    def placer_prefetch(*args, **kwargs):  # the placer's pass during the wait sees both arrivals
        if threading.current_thread().name == "symbiosis-engine-placer" and waiting.is_set():
            assert both_sent.wait(30)
        prefetch(*args, **kwargs)

    def placing(slot, adapter, evicted=None):
        placers[adapter.name] = threading.current_thread().name
        if adapter.name == "mlp_r8" and placers[adapter.name] == "symbiosis-engine-placer":
            in_placement.set()
            assert finish.wait(30)
        place(slot, adapter, evicted)

    monkeypatch.setattr(sampling.Launched, "wait", held_wait)
    monkeypatch.setattr(store, "_place", placing)
    monkeypatch.setattr(engine, "_prefetch", placer_prefetch)
    engine.start()
    try:
        hold.set()
        running = engine.submit(PROMPT, PARAMS, ("attn_r2", adapters["attn_r2"]))
        assert waiting.wait(30)
        first = engine.submit(PROMPT, PARAMS, ("mlp_r8", adapters["mlp_r8"]))
        second = engine.submit(PROMPT, PARAMS, ("everything_rs", adapters["everything_rs"]))
        both_sent.set()
        assert in_placement.wait(30)  # the placer is in its first placement, the engine's thread in its wait
        hold.clear()
        release.set()
        deadline = time.monotonic() + 30
        while not engine._wants_stepping:  # the wait is over: the engine's thread waits for the step lock
            assert time.monotonic() < deadline
            time.sleep(0.001)
        finish.set()
        for handle in (running, first, second):
            assert handle.result(timeout=60).finish_reason == "length"
        assert placers == {"attn_r2": "symbiosis-engine", "mlp_r8": "symbiosis-engine-placer",
                           "everything_rs": "symbiosis-engine"}
    finally:
        release.set()
        finish.set()
        both_sent.set()
        engine.close()


def test_a_placement_that_fails_part_way_leaves_nothing_in_its_slot_for_the_next(models, monkeypatch):
    """A placement that raises after its first wave (every scale of its layers written, some matrices) leaves its
    slot free; the next adapter placed there (one on fewer layers, which overwrites fewer scales) finds every other
    scale zero, so nothing of the failed one is added to its tokens."""
    from symbiosis.engine import adapters as adapter_store

    checkpoint, adapters = models("llama")
    monkeypatch.setattr(adapter_store, "WAVE_BYTES", 1000)  # the tiny adapters in several waves, as large ones go
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4, adapter_slots=1)
    store = engine.adapters
    everything, mlp = (store.load(name, adapters[name]) for name in ("everything_rs", "mlp_r8"))
    place_wave, waves = store._place_wave, []

    def failing_after_the_first(*args):
        waves.append(args[0].name)
        if len(waves) == 2:
            raise RuntimeError("out of memory (simulated)")
        place_wave(*args)
    monkeypatch.setattr(store, "_place_wave", failing_after_the_first)
    with pytest.raises(RuntimeError, match="out of memory"):
        store.acquire(everything)
    monkeypatch.setattr(store, "_place_wave", place_wave)
    assert store.resident == {}
    slot = store.acquire(mlp)
    written = {tuple(store.placement[layer_id][:2]) for layer_id in mlp.layers}
    others = [(pool_id, member) for layer_id in everything.layers
              for pool_id, member, _ in [store.placement[layer_id]] if (pool_id, member) not in written]
    assert others and all(store.pools[pool_id].scales[slot, member] == 0 for pool_id, member in others)
    assert _run(engine, adapters, "mlp_r8") == _run(
        Engine.from_pretrained(checkpoint, dtype=torch.float64, kv_blocks=64, block_size=4), adapters, "mlp_r8")


@pytest.mark.gpu
def test_on_the_gpu_requests_of_more_adapters_than_slots_arriving_mid_step_get_their_own_outputs(models):
    """float32 on CUDA, the engine's own thread: 12 requests of 3 adapters and the base arriving while steps run,
    over 2 slots, so placements (at admission and after launches) evict adapters that steps in flight may still
    read: every request's tokens are those of its adapter alone, its log-probabilities to float32 rounding."""
    import time

    checkpoint, adapters = models("llama")
    names = ["everything_rs", "mlp_r8", "attn_r2", None] * 3
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    alone = {}
    reference = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.float32, kv_blocks=64, block_size=16)
    for name in set(names):
        completion = reference.generate([PROMPT], params, [None if name is None else (name, adapters[name])])[0]
        alone[name] = (completion.token_ids, [t.logprob for t in completion.logprobs])
    engine = Engine.from_pretrained(checkpoint, device="cuda", dtype=torch.float32, kv_blocks=64, block_size=16,
                                    adapter_slots=2).start()
    try:
        handles = []
        for i, name in enumerate(names):
            handles.append(engine.submit(PROMPT, params, None if name is None else (name, adapters[name])))
            time.sleep(0.002 * (i % 3))  # some arrive between steps, some while one is being built
        for name, handle in zip(names, handles):
            completion = handle.result(timeout=120)
            assert completion.token_ids == alone[name][0], name
            assert [t.logprob for t in completion.logprobs] == pytest.approx(alone[name][1], abs=1e-3), name
        assert engine.adapters.stats.placements > 3  # adapters were evicted and placed again
    finally:
        engine.close()
