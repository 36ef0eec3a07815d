"""The protobuf messages of the Tinker API, defined here from their field numbers and types (no generated code, no
SDK at run time), and their conversion to and from the trainer's and the engine's terms.

Three messages travel as protobuf: ForwardBackwardRequest (client to server; `forward` and `forward_backward`),
ForwardBackwardOutput and SampleResponse (server to client). Fields this service does not read (provenance spans)
are left out of the schema: protobuf skips unknown fields when it parses. Everything else is JSON.

Tensors: `dense` little-endian bytes of their dtype (float32 or int64 from the SDK), or sparse CSR (values, int64
row pointers and column indices); an empty `shape` means one dimension. Sizes are checked against the bytes before
anything is allocated.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from symbiosis.errors import BadCall
from symbiosis.train.trainer import Datum

PACKAGE = "tinker_public"
F = descriptor_pb2.FieldDescriptorProto
# name -> [(field, number, type, label, message or enum type name, oneof index)]
MESSAGES = {
    "ForwardBackwardRequest": [("model_id", 1, F.TYPE_STRING), ("seq_id", 2, F.TYPE_INT32),
                               ("data", 3, F.TYPE_MESSAGE, F.LABEL_REPEATED, "Datum"), ("loss_fn", 4, F.TYPE_STRING),
                               ("loss_fn_config", 5, F.TYPE_MESSAGE, F.LABEL_REPEATED, "ForwardBackwardRequest.LossFnConfigEntry"),
                               ("forward_only", 6, F.TYPE_BOOL),
                               ("loss_fn_config_v2", 7, F.TYPE_MESSAGE, F.LABEL_REPEATED, "ForwardBackwardRequest.LossFnConfigV2Entry")],
    "LossConfigValue": [("number", 1, F.TYPE_DOUBLE, None, None, 0), ("text", 2, F.TYPE_STRING, None, None, 0)],
    "Datum": [("model_input", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, "Chunk"),
              ("loss_fn_inputs", 2, F.TYPE_MESSAGE, F.LABEL_REPEATED, "Datum.LossFnInputsEntry")],
    "Chunk": [("encoded_text", 1, F.TYPE_MESSAGE, None, "EncodedTextChunk", 0),
              ("image", 2, F.TYPE_MESSAGE, None, "Opaque", 0), ("dmel", 3, F.TYPE_MESSAGE, None, "Opaque", 0)],
    "EncodedTextChunk": [("tokens", 1, F.TYPE_BYTES)],
    "Opaque": [],  # a chunk kind this service refuses: its content is skipped unread
    "Tensor": [("dense", 1, F.TYPE_BYTES, None, None, 0), ("sparse_csr", 2, F.TYPE_MESSAGE, None, "SparseCsr", 0),
               ("dtype", 3, F.TYPE_ENUM, None, "DType"), ("shape", 4, F.TYPE_INT64, F.LABEL_REPEATED)],
    "SparseCsr": [("values", 1, F.TYPE_BYTES), ("crow_indices", 2, F.TYPE_BYTES), ("col_indices", 3, F.TYPE_BYTES)],
    "ForwardBackwardOutput": [("loss_fn_output_type", 1, F.TYPE_STRING),
                              ("loss_fn_outputs", 2, F.TYPE_MESSAGE, F.LABEL_REPEATED, "ArrayRecord"),
                              ("metrics", 3, F.TYPE_MESSAGE, F.LABEL_REPEATED, "ForwardBackwardOutput.MetricsEntry")],
    "ArrayRecord": [("type_tag", 1, F.TYPE_STRING),
                    ("fields", 2, F.TYPE_MESSAGE, F.LABEL_REPEATED, "ArrayRecord.FieldsEntry"),
                    ("num_datums", 3, F.TYPE_INT64)],
    "BatchedTensor": [("data", 1, F.TYPE_BYTES), ("offsets", 2, F.TYPE_BYTES), ("dtype", 3, F.TYPE_ENUM, None, "DType"),
                      ("trailing_shape", 4, F.TYPE_INT64, F.LABEL_REPEATED)],
    "SampleResponse": [("sequences", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, "SampledSequence"),
                       ("prompt_logprobs", 2, F.TYPE_BYTES, None, None, None, True),
                       ("prompt_cache_hit_tokens", 4, F.TYPE_INT32)],
    "SampledSequence": [("stop_reason", 1, F.TYPE_ENUM, None, "StopReason"), ("tokens", 2, F.TYPE_BYTES),
                        ("logprobs", 3, F.TYPE_BYTES, None, None, None, True)],
}
MAPS = {  # map entries: (message, entry name) -> (key type, value type, value type name)
    ("ForwardBackwardRequest", "LossFnConfigEntry"): (F.TYPE_STRING, F.TYPE_DOUBLE, None),
    ("ForwardBackwardRequest", "LossFnConfigV2Entry"): (F.TYPE_STRING, F.TYPE_MESSAGE, "LossConfigValue"),
    ("Datum", "LossFnInputsEntry"): (F.TYPE_STRING, F.TYPE_MESSAGE, "Tensor"),
    ("ForwardBackwardOutput", "MetricsEntry"): (F.TYPE_STRING, F.TYPE_DOUBLE, None),
    ("ArrayRecord", "FieldsEntry"): (F.TYPE_STRING, F.TYPE_MESSAGE, "BatchedTensor"),
}
ONEOFS = {"LossConfigValue": "value", "Chunk": "chunk", "Tensor": "encoding"}  # each message's one oneof
ENUMS = {"DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
         "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"]}
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
NUMPY = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
MAX_TENSOR_ELEMENTS = 1 << 24  # a sparse tensor's dense size is claimed, not sent: bound it before allocating
# ... and a request's, all its datums' tensors together (each may claim its bound: 16 sparse [1, 2^24] targets of
# one token each were a 1.7 kB request whose 1 GB answer could not be stored, and that failure ended the training
# thread). The answer's log-probabilities are shaped as the targets: bounded with them.
MAX_REQUEST_ELEMENTS = 1 << 24


def _field(message, name, number, kind, label=None, type_name=None, oneof=None, optional=False):
    field = message.field.add(name=name, number=number, type=kind, label=label or F.LABEL_OPTIONAL)
    if type_name:
        field.type_name = f".{PACKAGE}.{type_name}"
    if oneof is not None:
        field.oneof_index = oneof
    if optional:  # proto3 `optional`: presence tracked through a synthetic one-member oneof
        field.proto3_optional = True
        field.oneof_index = len(message.oneof_decl)
        message.oneof_decl.add(name=f"_{name}")


def _schema():
    file = descriptor_pb2.FileDescriptorProto(name="symbiosis_tinker.proto", package=PACKAGE, syntax="proto3")
    for name, values in ENUMS.items():
        enum = file.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in MESSAGES.items():
        message = file.message_type.add(name=name)
        if name in ONEOFS:
            message.oneof_decl.add(name=ONEOFS[name])
        for spec in fields:
            _field(message, *spec)
        for (owner, entry_name), (key, value, value_type) in MAPS.items():
            if owner == name:
                entry = message.nested_type.add(name=entry_name)
                entry.options.map_entry = True
                _field(entry, "key", 1, key)
                _field(entry, "value", 2, value, None, value_type)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
            for name in MESSAGES}


messages = _schema()


# -- requests --

def _array(data: bytes, dtype: int, what: str) -> np.ndarray:
    numpy_type = NUMPY.get(dtype)
    if numpy_type is None:
        raise BadCall(f"{what}: unsupported dtype {dtype} (float32 or int64)")
    if len(data) % np.dtype(numpy_type).itemsize:
        raise BadCall(f"{what}: {len(data)} bytes are not a whole number of {np.dtype(numpy_type).name}")
    return np.frombuffer(data, dtype=numpy_type)


def tensor(message, what: str) -> torch.Tensor:
    """A Tensor message as a torch tensor (float32 as float64: the losses' inputs are exact either way)."""
    shape = list(message.shape)
    if any(d < 0 for d in shape) or len(shape) > 2 or math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise BadCall(f"{what}: shape {shape} (one or two non-negative dimensions, at most {MAX_TENSOR_ELEMENTS} "
                      "elements)")
    if message.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise BadCall(f"{what}: a sparse tensor needs a two-dimensional shape, got {shape}")
        values = _array(message.sparse_csr.values, message.dtype, what)
        rows = _array(message.sparse_csr.crow_indices, DTYPE_INT64, what)
        columns = _array(message.sparse_csr.col_indices, DTYPE_INT64, what)
        if len(rows) != shape[0] + 1 or len(columns) != len(values) or rows[0] != 0 or rows[-1] != len(values) \
                or np.any(np.diff(rows) < 0) or np.any((columns < 0) | (columns >= shape[1])):
            raise BadCall(f"{what}: sparse indices that do not fit shape {shape}")
        dense = np.zeros(shape, dtype=values.dtype)
        dense[np.repeat(np.arange(shape[0]), np.diff(rows)), columns] = values
        array = dense
    else:
        array = _array(message.dense, message.dtype, what)
        if not shape:
            shape = [array.size]
        if math.prod(shape) != array.size:
            raise BadCall(f"{what}: {array.size} values for shape {shape}")
        array = array.reshape(shape)
    result = torch.from_numpy(array.copy())
    return result.double() if result.is_floating_point() else result.long()


def forward_backward_request(body: bytes):
    """(model_id, seq_id, loss_fn, loss config, forward_only, datums) of a ForwardBackwardRequest."""
    request = messages["ForwardBackwardRequest"]()
    try:
        request.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 -- protobuf's DecodeError and friends
        raise BadCall(f"the body is not a ForwardBackwardRequest ({e})") from None
    config = {key: value.number for key, value in request.loss_fn_config_v2.items() if value.WhichOneof("value") == "number"}
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise BadCall(f"loss_fn_config[{key!r}] is text; this service's losses take numbers")
    config = config or dict(request.loss_fn_config)
    datums, claimed = [], 0
    for index, datum in enumerate(request.data):
        claimed += sum(math.prod(value.shape) for value in datum.loss_fn_inputs.values())
        if claimed > MAX_REQUEST_ELEMENTS:
            raise BadCall(f"datum {index}: the request's loss_fn_inputs hold more than {MAX_REQUEST_ELEMENTS} elements "
                          "in all; send fewer datums a request")
        tokens = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise BadCall(f"datum {index}: only encoded_text model input is supported (no images or audio)")
            tokens.extend(_array(chunk.encoded_text.tokens, DTYPE_INT32, f"datum {index} tokens").tolist())
        inputs = {key: tensor(value, f"datum {index} loss_fn_inputs[{key!r}]") for key, value in datum.loss_fn_inputs.items()}
        datums.append(Datum(tokens, inputs))
    # the answer is one record of the log-probabilities, whose shape past the first dimension is one for all datums
    shapes = {tuple(d.inputs["target_tokens"].shape[1:]) for d in datums if "target_tokens" in d.inputs}
    if len(shapes) > 1:
        raise BadCall(f"the datums' target_tokens differ in shape past their first dimension ({sorted(shapes)}); "
                      "send those of each shape in a request of their own")
    return request.model_id, request.seq_id, request.loss_fn, config, request.forward_only, datums


# -- results --

def forward_backward_output(logprobs: list[torch.Tensor], loss: float) -> bytes:
    """Every datum's `logprobs` in one ArrayRecord (float32, concatenated, byte offsets), and `loss:sum`."""
    output = messages["ForwardBackwardOutput"](loss_fn_output_type="ArrayRecord")
    record = output.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    parts = [lp.detach().to(torch.float32).numpy().ravel() for lp in logprobs]
    field = record.fields["logprobs"]
    field.data = b"".join(part.tobytes() for part in parts)
    field.offsets = np.cumsum([0] + [part.nbytes for part in parts]).astype(np.int64).tobytes()
    field.dtype = DTYPE_FLOAT32
    trailing = list(logprobs[0].shape[1:]) if logprobs else []
    field.trailing_shape.extend(trailing)
    output.metrics["loss:sum"] = float(loss)
    return output.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float] | None) -> bytes:
    """sequences: (tokens, their logprobs, "stop" or "length"); prompt_logprobs: NaN where not scored."""
    response = messages["SampleResponse"](prompt_cache_hit_tokens=0)
    for tokens, logprobs, reason in sequences:
        response.sequences.add(stop_reason=0 if reason == "stop" else 1,
                               tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                               logprobs=np.asarray(logprobs, dtype=np.float32).tobytes())
    if prompt_logprobs is not None:
        response.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return response.SerializeToString()
