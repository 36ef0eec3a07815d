"""One step's layout: prefill steps' attention in (rows, queries) buckets, padding that reads nothing and is never
gathered back; decodes whose input token is still on the device."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from symbiosis.engine.batch import SHORTEST_QUERY_BUCKET, Chunk, StepBatch, bucket


def _chunk(blocks, start, tokens, slot=None, sample=True, from_row=None):
    return Chunk(SimpleNamespace(blocks=blocks), start, tokens, slot, sample, from_row)


def test_prefill_steps_lay_their_attention_out_in_buckets():
    chunks = [_chunk([0, 1], 0, list(range(5, 10))), _chunk([2, 3, 4], 4, list(range(20, 37)), slot=1),
              _chunk([5], 2, [7])]
    batch = StepBatch(chunks, block_size=8, num_pages=8, max_pages=4, device=torch.device("cpu"))
    rows, queries = batch.query_index.shape
    assert (rows, queries) == (bucket(3), max(SHORTEST_QUERY_BUCKET, bucket(17))) == (4, 32)
    # every flat token is gathered back from exactly its own row and query, padding never
    lengths = [len(c.tokens) for c in batch.chunks]
    expected = [r * queries + q for r, n in enumerate(lengths) for q in range(n)]
    assert batch.query_rows.tolist() == expected and batch.num_tokens == sum(lengths)
    assert batch.kv_num_blocks[len(chunks):].eq(0).all(), "a padding row reads no page"
    assert not batch.one_token_rows and batch.previous_rows.eq(-1).all()


def test_decodes_take_a_token_still_on_the_device_from_its_row():
    chunks = [_chunk([0], 3, [0], from_row=2), _chunk([1], 5, [11]), _chunk([2], 1, [0], from_row=0)]
    batch = StepBatch(chunks, block_size=8, num_pages=8, max_pages=4, device=torch.device("cpu"), padded_rows=4)
    assert batch.one_token_rows and batch.num_tokens == 4
    assert batch.previous_rows.tolist() == [2, -1, 0, -1] and batch.input_ids.tolist() == [0, 11, 0, 0]
