"""The wire format shared by server and client: one ZeroMQ multipart message per request or reply.

    frame 0: header, UTF-8 JSON: {"op", "id", "client", ...}; tensors are described as
             {"dtype": "float32", "shape": [T, d]}
    frame 1..n: raw tensor bytes, sent and received without copies (on ipc://, layer calls do not use
             the socket: see doorbell.py)

Replies carry {"id", "ok": true, ...} or {"id", "ok": false, "error": ErrorClassName, "message": ...}.
"""

from __future__ import annotations

import json

import torch
import zmq

from symbiosis import errors

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name) -> torch.dtype:
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise errors.BadCall(f"unsupported tensor dtype {str(name)[:80]!r}")
    return dtype


def tensor_frame(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy (pyzmq keeps the buffer alive until sent)."""
    tensor = tensor.detach().contiguous()
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy()) if tensor.numel() else memoryview(b"")


def describe(tensor: torch.Tensor) -> dict:
    return {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}


MAX_DIMS = 8


def frame_tensor(frame, spec: dict) -> torch.Tensor:
    """A tensor over a received frame's bytes (no copy); checks that the bytes fit the declared shape, a list of at
    most MAX_DIMS non-negative JSON integers (not floats, strings or booleans, which int() would round or coerce)."""
    shape = spec.get("shape") if isinstance(spec, dict) else None
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
            not all(type(n) is int and n >= 0 for n in shape):  # noqa: E721 -- bool is an int subclass
        raise errors.BadCall(f"malformed tensor description {str(spec)[:200]}: its shape must be a list of at most "
                             f"{MAX_DIMS} non-negative integers")
    dtype = parse_dtype(spec.get("dtype"))
    buffer = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    numel = 1
    for n in shape:
        numel *= n
    if buffer.nbytes != numel * dtype.itemsize:
        raise errors.BadCall(f"tensor frame has {buffer.nbytes} bytes, but {spec} needs {numel * dtype.itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


ZERO_COPY_MIN_BYTES = 64 * 1024  # below this, pyzmq's zero-copy bookkeeping costs more than a copy


def encode(header: dict, *tensors: torch.Tensor) -> list:
    return [json.dumps(header).encode(), *(tensor_frame(t) for t in tensors)]


def send(socket, frames: list) -> None:
    """Send a multipart message, copying small frames and handing large ones to ZeroMQ without a copy."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        big = isinstance(frame, memoryview) and frame.nbytes >= ZERO_COPY_MIN_BYTES
        socket.send(frame, flags=zmq.SNDMORE if i < last else 0, copy=not big)


def decode_header(frame) -> dict:
    try:
        header = json.loads(bytes(frame.buffer if hasattr(frame, "buffer") else frame))
    except (ValueError, RecursionError) as e:  # not UTF-8 or not JSON, nested too deep, a number too long
        raise errors.BadCall(f"malformed message: header is not JSON that can be read ({str(e)[:200]})") from e
    if not isinstance(header, dict):
        raise errors.BadCall("malformed message: header must be a JSON object")
    call_id = header.get("id")  # echoed in the reply, even an error's: a scalar, or the reply could not be written
    if not (call_id is None or (type(call_id) is int and abs(call_id) < 2**63) or  # noqa: E721 -- not bools
            (isinstance(call_id, str) and len(call_id) <= 256)):
        raise errors.BadCall("malformed message: its id must be an integer or a string of at most 256 characters")
    return header


def error_reply(call_id, error: BaseException) -> dict:
    name = type(error).__name__ if isinstance(error, errors.SymbiosisError) else "SymbiosisError"
    message = str(error) if isinstance(error, errors.SymbiosisError) else f"{type(error).__name__}: {error}"
    return {"id": call_id, "ok": False, "error": name, "message": message}


def raise_error(reply: dict) -> None:
    cls = getattr(errors, str(reply.get("error")), errors.SymbiosisError)
    if not (isinstance(cls, type) and issubclass(cls, errors.SymbiosisError)):
        cls = errors.SymbiosisError
    raise cls(reply.get("message", "executor error"))
