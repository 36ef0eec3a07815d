"""The Tinker API's request decoding (serve/tinker/wire.py) against hostile bodies: sizes claimed and not sent,
sparse indices that fit no column, datums whose answers could not share one record."""

from __future__ import annotations

import numpy as np
import pytest

from symbiosis.errors import BadCall
from symbiosis.serve.tinker import wire


def _body(*datums) -> bytes:
    """A ForwardBackwardRequest of datums given as (tokens, {name: (shape, sparse (crow, col, values) or dense)})."""
    request = wire.messages["ForwardBackwardRequest"](model_id="m", seq_id=1, loss_fn="cross_entropy")
    for tokens, inputs in datums:
        datum = request.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        for name, (shape, data) in inputs.items():
            tensor = datum.loss_fn_inputs[name]
            tensor.shape.extend(shape)
            if isinstance(data, tuple):
                crow, col, values = data
                tensor.dtype = wire.DTYPE_INT64
                tensor.sparse_csr.crow_indices = np.asarray(crow, dtype=np.int64).tobytes()
                tensor.sparse_csr.col_indices = np.asarray(col, dtype=np.int64).tobytes()
                tensor.sparse_csr.values = np.asarray(values, dtype=np.int64).tobytes()
            else:
                tensor.dtype = wire.DTYPE_INT64
                tensor.dense = np.asarray(data, dtype=np.int64).tobytes()
    return request.SerializeToString()


def test_sparse_shapes_claimed_by_a_small_request_are_bounded_in_all():
    """16 one-token datums whose targets claim [1, 2^24] each, nothing sent: a 1.7 kB body, a 1 GB answer (which
    could not be stored, and ended the training thread). Each tensor is within its own bound; the request is not."""
    empty = ([0, 0], [], [])
    body = _body(*[([5], {"target_tokens": ([1, 1 << 24], empty)})] * 16)
    assert len(body) < 2000
    with pytest.raises(BadCall, match="more than 16777216 elements in all"):
        wire.forward_backward_request(body)
    assert len(wire.forward_backward_request(_body(([5], {"target_tokens": ([1, 1 << 24], empty)})))[5]) == 1


def test_a_sparse_index_into_no_column_is_refused():
    with pytest.raises(BadCall, match="sparse indices that do not fit shape"):  # (an IndexError: a server error)
        wire.forward_backward_request(_body(([5], {"target_tokens": ([1, 0], ([0, 1], [0], [5]))})))


def test_datums_whose_targets_differ_past_their_first_dimension_are_refused():
    """The answer's log-probabilities are one record with one trailing shape: [4] beside [3, 2] came back as [4]
    and [6], without an error."""
    with pytest.raises(BadCall, match="differ in shape past their first dimension"):
        wire.forward_backward_request(_body(([1, 2, 3, 4], {"target_tokens": ([4], [2, 3, 4, 5])}),
                                            ([1, 2, 3], {"target_tokens": ([3, 2], [2, 3, 3, 4, 4, 5])})))
