"""One step's layout: decodes and prefill chunks in two attention layouts whose shapes are powers of two of rows
alone (the compiled kernels meet a few shapes), padding that reads nothing and is never gathered back; decodes whose
input token is still on the device."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from symbiosis.engine.batch import QUERY_BLOCK, Chunk, StepBatch, bucket


def _chunk(blocks, start, tokens, slot=None, sample=True, from_row=None):
    return Chunk(SimpleNamespace(blocks=blocks), start, tokens, slot, sample, from_row)


def _batch(chunks, **kwargs):
    return StepBatch(chunks, block_size=8, num_pages=40, max_pages=36, device=torch.device("cpu"), **kwargs)


def test_a_mixed_step_lays_decodes_and_prefill_rows_out_apart_each_in_a_bucket_of_rows():
    long = list(range(3, 3 + QUERY_BLOCK + 40))  # two prefill rows
    chunks = [_chunk([0, 1], 0, list(range(5, 10))), _chunk(list(range(2, 25)), 4, long, slot=1),
              _chunk([30], 2, [7]), _chunk([31], 5, [8], slot=1)]
    batch = _batch(chunks)
    decode, prefill = batch.layouts
    assert decode.query_index.shape == (bucket(2), 1) and prefill.query_index.shape == (bucket(3), QUERY_BLOCK)
    lengths = [len(c.tokens) for c in batch.chunks]  # the step's order: adapters first
    firsts = [sum(lengths[:n]) for n in range(len(lengths))]
    # every flat token is computed by exactly one layout, from exactly its own row and query; padding never
    computed = sorted(decode.tokens.tolist() + prefill.tokens.tolist())
    assert computed == list(range(batch.num_tokens)) == list(range(sum(lengths)))
    for layout in batch.layouts:
        queries = layout.query_index.shape[1]
        for token, row in zip(layout.tokens.tolist(), layout.query_rows.tolist()):
            assert layout.query_index[row // queries, row % queries] == token
            chunk = layout.row_chunk[row // queries]
            assert layout.query_positions[row // queries, row % queries] == \
                batch.chunks[chunk].start + token - firsts[chunk]
    # a prefill row reads the pages up to its last query, a padding row none
    assert prefill.kv_num_blocks[:3, 0, 0].tolist() == [-(-(4 + QUERY_BLOCK) // 8), -(-(4 + len(long)) // 8), 1]
    assert prefill.kv_num_blocks[3:].eq(0).all() and decode.kv_num_blocks[2:].eq(0).all()
    assert prefill.row_chunk[3:].eq(-2).all()
    assert batch.previous_rows.eq(-1).all() and not any(layout.whole for layout in batch.layouts)


def test_prefill_shapes_do_not_follow_prompt_lengths():
    shapes = {_batch([_chunk(list(range(20)), 0, [1] * length)]).layouts[0].query_index.shape
              for length in (2, 17, 100, QUERY_BLOCK)}
    assert shapes == {(1, QUERY_BLOCK)}


def test_decodes_take_a_token_still_on_the_device_from_its_row():
    chunks = [_chunk([0], 3, [0], from_row=2), _chunk([1], 5, [11]), _chunk([2], 1, [0], from_row=0)]
    batch = _batch(chunks, padded_rows=4)
    (layout,) = batch.layouts
    assert layout.one_token_rows and layout.whole and batch.num_tokens == 4
    assert layout.kv_num_blocks[3].eq(0).all() and layout.row_chunk[3] == -2, "the padding row reads no page"
    assert batch.previous_rows.tolist() == [2, -1, 0, -1] and batch.input_ids.tolist() == [0, 11, 0, 0]


def test_a_steps_arrays_reach_the_device_as_they_were_built_whatever_their_dtypes_and_order():
    """One copy for int64 and int32 arrays together (each view at a multiple of its item size)."""
    from symbiosis.engine.batch import _upload

    arrays = {"a": np.arange(5, dtype=np.int32), "b": [7, -1, 2**40], "c": np.arange(12, dtype=np.int64).reshape(3, 4),
              "d": np.full((2, 3), -5, dtype=np.int32)}
    tensors = _upload(arrays, torch.device("cpu"), None)
    for name, array in arrays.items():
        expected = torch.as_tensor(np.asarray(array, dtype=np.int64) if isinstance(array, list) else array)
        assert tensors[name].dtype == expected.dtype and torch.equal(tensors[name], expected), name


@pytest.mark.gpu
def test_on_the_gpu_staged_uploads_stay_right_as_the_ring_wraps_and_grows():
    """More uploads than the ring has buffers, of growing sizes, not waited for one by one: each lands intact."""
    from symbiosis.engine.batch import Staging, _upload

    staging, device, sent = Staging(slots=3), torch.device("cuda"), []
    for i in range(40):
        arrays = {"x": np.arange(i * 997, dtype=np.int64) + i, "y": np.full(i % 7 + 1, i, dtype=np.int32)}
        sent.append((arrays, _upload(arrays, device, staging)))
    torch.cuda.synchronize()
    for arrays, tensors in sent:
        for name, array in arrays.items():
            assert torch.equal(tensors[name].cpu(), torch.from_numpy(array))


def test_the_cpus_eager_steps_leave_nothing_in_reference_cycles(models):
    """Prefills and decodes of requests with two adapters and none, on the CPU (attention over gathered contexts,
    its mask one comparison a step): nothing they make is left for the cyclic collector, whose collections stop
    every thread (flex_attention's mask helpers, which vmap a mask_mod, left ~3,500 objects in cycles a step)."""
    import gc

    from symbiosis.engine import Engine, SamplingParams

    checkpoint, adapters = models("llama")
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float32, kv_blocks=64, block_size=4)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11] * (1 + i % 3) for i in range(6)]
    named = [None, ("attn_r2", adapters["attn_r2"]), ("mlp_r8", adapters["mlp_r8"])] * 2
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.generate(prompts, params, named)  # (what the first steps make once: compiled code, pools, caches)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        steps = engine.steps
        engine.generate(prompts, params, named)
        gc.collect()
        steps, left = engine.steps - steps, len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert steps >= 8 and left < steps  # (nothing, on this machine)


def test_a_step_and_its_tensors_are_freed_when_dropped_not_left_to_the_cyclic_collector():
    """A step's layouts read its page tables, not the step: no reference cycle, so its tensors (device memory on a
    GPU) go when the engine drops the step, not at some later collection that stops every thread."""
    import gc
    import weakref

    long = list(range(3, 3 + QUERY_BLOCK + 40))
    batch = _batch([_chunk([0, 1], 0, list(range(5, 10))), _chunk(list(range(2, 25)), 4, long, slot=1)])
    for layout in batch.layouts:  # what a step's attention makes from them (the CPU's masks)
        layout.gathered(None)
    step, page_owner = weakref.ref(batch), weakref.ref(batch.page_owner)
    gc.disable()
    try:
        del batch, layout
        assert step() is None and page_owner() is None
    finally:
        gc.enable()
