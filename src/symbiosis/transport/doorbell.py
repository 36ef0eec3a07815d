"""The same-host call path: a control block in shared memory plus a pipe byte as the wake-up.

A ZeroMQ request/reply hands each message through two I/O threads per side, which costs ~0.5 ms a round
trip; a layer call is on the client's critical path, and a fine-tuning step makes ~130 of them. So on
`ipc://` the calls skip the socket: the client writes a fixed-layout request into a small shared control
block, writes one byte into a FIFO the executor's I/O thread polls, and blocks reading one byte from a
second FIFO; the executor writes the reply into the control block and writes that byte. The tensors stay
in the client's `SharedBuffer`. Attach, heartbeats, fetch and errors outside calls still use the socket.

Control block (little-endian), request at 0, reply at REPLY_AT:
    request: seq u64 | op u8 | inference u8 | dtype u8 | pad u8 | rows u32 | cols u32 | layer_len u16 | layer id
    reply:   seq u64 | ok u8 | dtype u8 | pad u16 | rows u32 | cols u32 | message_len u32 | error JSON
Sequence numbers pair a reply with its request, so a stale wake-up (a call that timed out, an executor
that restarted) is recognised and skipped.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import secrets
import select
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from symbiosis.errors import BadCall, ExecutorUnavailable
from symbiosis.transport import wire
from symbiosis.transport.shm import PREFIX, SHM_DIR

CONTROL_BYTES = 8192
REPLY_AT = 2048
REQUEST = struct.Struct("<QBBBxIIH")
REPLY = struct.Struct("<QBBxxIII")
SEQ = struct.Struct("<Q")
MAX_LAYER_ID = REPLY_AT - REQUEST.size
MAX_MESSAGE = CONTROL_BYTES - REPLY_AT - REPLY.size
# Waiting without sleeping (spinning) pays only with cores to spare: with fewer, the spinners would take
# the CPU from the very processes they wait for.
SPARE_CORES = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) >= 8
# A reply is awaited this long by spinning on its sequence number before sleeping in poll(). Spinning relies
# on x86's in-order visibility of stores (the reply's fields are written before its sequence number).
SPIN_S = 300e-6 if SPARE_CORES and platform.machine() in ("x86_64", "AMD64") else 0.0
CHECK_EVERY = 1.0  # seconds of waiting on a reply between checks that the executor still knows the client
OPS = ("forward", "forward_nobias", "backward")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass
class Request:
    seq: int
    op: str
    layer: str
    inference: bool
    dtype: torch.dtype
    shape: list[int]


class Doorbell:
    """One client's control block and its two FIFOs (request: client -> executor, reply: back)."""

    def __init__(self, paths: dict[str, Path], owner: bool):
        self.paths = paths
        self.owner = owner
        with open(paths["control"], "r+b") as f:
            self.control = mmap.mmap(f.fileno(), CONTROL_BYTES)
        # O_RDWR: opening a FIFO does not block waiting for the other end, and a peer that dies leaves no EOF
        # to handle (timeouts and the heartbeat reaper catch that).
        self.request_fd = os.open(paths["request"], os.O_RDWR | os.O_NONBLOCK)
        self.reply_fd = os.open(paths["reply"], os.O_RDWR | os.O_NONBLOCK)
        self._reply_poll = select.poll()
        self._reply_poll.register(self.reply_fd, select.POLLIN)
        self.seq = REQUEST.unpack_from(self.control, 0)[0]  # the executor answers only requests after this

    @property
    def description(self) -> dict:
        return {name: str(path) for name, path in self.paths.items()}

    @classmethod
    def create(cls) -> "Doorbell":
        stem = SHM_DIR / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        paths = {"control": stem.with_suffix(".ctl"), "request": stem.with_suffix(".req"),
                 "reply": stem.with_suffix(".rep")}
        with open(paths["control"], "wb") as f:
            f.truncate(CONTROL_BYTES)
        os.mkfifo(paths["request"], 0o600)
        os.mkfifo(paths["reply"], 0o600)
        return cls(paths, owner=True)

    @classmethod
    def open(cls, description: dict) -> "Doorbell":
        """The executor's side; only symbiosis files of the right kind are accepted."""
        try:
            paths = {name: Path(description[name]) for name in ("control", "request", "reply")}
            for name, path in paths.items():
                info, fifo = os.lstat(path), name != "control"
                right_kind = stat.S_ISFIFO(info.st_mode) if fifo else \
                    stat.S_ISREG(info.st_mode) and info.st_size == CONTROL_BYTES
                if path.parent != SHM_DIR or not path.name.startswith(PREFIX) or not right_kind:
                    raise BadCall(f"{path} is not a symbiosis doorbell {'FIFO' if fifo else 'control block'}")
            return cls(paths, owner=False)
        except (KeyError, TypeError, OSError, ValueError) as e:
            raise BadCall(f"cannot open the client's doorbell: {e}") from e

    # --- client ---------------------------------------------------------------------------------------

    def call(self, op: str, layer: str, inference: bool, tensor: torch.Tensor, timeout: float,
             still_attached: Callable[[], None]) -> tuple:
        """Ring and wait for the reply: (dtype, [rows, cols]) of the result in the shared buffer.

        Every CHECK_EVERY seconds of waiting, `still_attached()` asks over the socket whether the executor
        still knows this client (it raises if not: an executor that restarted never answers this doorbell).
        """
        name = layer.encode()
        if len(name) > MAX_LAYER_ID:
            raise BadCall(f"layer id {layer[:60]!r}... is longer than {MAX_LAYER_ID} bytes")
        self.seq += 1
        self.control[REQUEST.size:REQUEST.size + len(name)] = name
        REQUEST.pack_into(self.control, 0, self.seq, OPS.index(op), inference, DTYPES.index(tensor.dtype),
                          tensor.shape[0], tensor.shape[1], len(name))
        _ring(self.request_fd)
        # Spin first: a sleeping process is woken through the scheduler (and a core in a deep idle state),
        # which costs more than a short call takes.
        spin_until = time.perf_counter() + SPIN_S
        while SEQ.unpack_from(self.control, REPLY_AT)[0] != self.seq and time.perf_counter() < spin_until:
            pass
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ExecutorUnavailable(f"executor did not answer {op!r} within {timeout:g}s "
                                          "(stopped, restarted or overloaded)")
            if SEQ.unpack_from(self.control, REPLY_AT)[0] != self.seq and \
                    not self._reply_poll.poll(min(left, CHECK_EVERY) * 1000):
                still_attached()
                continue
            _drain(self.reply_fd)
            seq, ok, dtype, rows, cols, message_len = REPLY.unpack_from(self.control, REPLY_AT)
            if seq != self.seq:
                continue  # a stale wake-up
            if not ok:
                start = REPLY_AT + REPLY.size
                wire.raise_error(json.loads(self.control[start:start + message_len]))
            return DTYPES[dtype], [rows, cols]

    # --- executor -------------------------------------------------------------------------------------

    def take_request(self) -> Request | None:
        """The pending request, if a new one came (called when the request FIFO is readable)."""
        _drain(self.request_fd)
        seq, op, inference, dtype, rows, cols, layer_len = REQUEST.unpack_from(self.control, 0)
        if seq <= self.seq:
            return None
        self.seq = seq
        if op >= len(OPS) or dtype >= len(DTYPES) or layer_len > MAX_LAYER_ID:
            raise BadCall(f"malformed doorbell request (op {op}, dtype {dtype}, layer id of {layer_len} bytes)")
        layer = bytes(self.control[REQUEST.size:REQUEST.size + layer_len]).decode(errors="replace")
        return Request(seq, OPS[op], layer, bool(inference), DTYPES[dtype], [rows, cols])

    def answer(self, seq: int, reply: dict) -> None:
        """`reply`: the socket path's reply, {"ok": True, "tensor": {"dtype", "shape"}} or an error reply."""
        # The sequence number goes last: a client spinning on it must find the rest already written (x86
        # makes stores visible in program order, and only there do clients spin; elsewhere they wait for
        # the FIFO byte, whose syscall orders them).
        if reply.get("ok"):
            spec = reply["tensor"]
            REPLY.pack_into(self.control, REPLY_AT, 0, True, DTYPES.index(wire.parse_dtype(spec["dtype"])),
                            *spec["shape"], 0)
        else:
            reply = {**reply, "message": str(reply.get("message"))[:MAX_MESSAGE // 8]}  # fits in UTF-8 JSON
            message = json.dumps(reply).encode()
            self.control[REPLY_AT + REPLY.size:REPLY_AT + REPLY.size + len(message)] = message
            REPLY.pack_into(self.control, REPLY_AT, 0, False, 0, 0, 0, len(message))
        SEQ.pack_into(self.control, REPLY_AT, seq)
        _ring(self.reply_fd)

    def unlink(self) -> None:
        """Remove the files; the mapping and the FIFO descriptors stay usable by whoever has them open."""
        for path in self.paths.values():
            if path.name.startswith(PREFIX):
                path.unlink(missing_ok=True)

    def close(self, unlink: bool = False) -> None:
        for fd in (self.request_fd, self.reply_fd):
            os.close(fd)
        self.control.close()
        if self.owner or unlink:
            self.unlink()


def _ring(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass  # the FIFO is full of unread wake-ups: the reader will wake anyway


def _drain(fd: int) -> None:
    """Consume pending wake-up bytes. One read: a byte left over (more than 4096 pending) only causes one
    spurious wake-up, which the sequence numbers make harmless; a second read would cost a syscall a call."""
    try:
        os.read(fd, 4096)
    except BlockingIOError:
        pass

