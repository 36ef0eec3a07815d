"""The same-host call path: a ring of request slots in shared memory plus a pipe byte as the wake-up.

A ZeroMQ request/reply hands each message through two I/O threads per side, which costs ~0.5 ms a round
trip; a layer call is on the client's critical path, and a fine-tuning step makes ~130 of them. So on
`ipc://` the calls skip the socket: the client writes a fixed-layout request into the next slot of a small
shared control block and writes one byte into a FIFO the executor's I/O thread polls. The executor takes
the slots in order, and answers each call by advancing `answered` in the header (and writing one byte into
a second FIFO, which a waiting client sleeps on). The tensors stay in the client's `SharedBuffer`.
Attach, heartbeats, fetch and errors outside calls still use the socket.

The ring lets a client have up to SLOTS calls outstanding: a client on the executor's GPU does not wait
for answers at all (its GPU stream waits instead, `streamops.py`); other clients wait for each answer.

Control block (little-endian):
    header at 0:          taken u64 | answered u64 | error_seq u64 | errors_seen u64 | error_len u32
    error at ERROR_AT:    JSON {"error", "message", "seq"} of the call error_seq
    slot i at SLOTS_AT + i * SLOT_BYTES, call seq in slot seq % SLOTS:
                          seq u64 | op u8 | inference u8 | dtype u8 | pad u8 | rows u32 | cols u32 |
                          layer_len u16 | layer id
The executor writes taken, answered and the error; the client writes the slots and errors_seen. A slot's
seq is written last, so the executor never takes a half-written request. One error is kept at a time:
while the client has not seen the last one (errors_seen < error_seq), later ones are not recorded.
"""

from __future__ import annotations

import fcntl
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
from symbiosis.executor.executor import OPS  # an op travels as its index here
from symbiosis.transport import wire
from symbiosis.transport.shm import PREFIX, SHM_DIR

U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
TAKEN_AT, ANSWERED_AT, ERROR_SEQ_AT, ERRORS_SEEN_AT, ERROR_LEN_AT = 0, 8, 16, 24, 32
ERROR_AT = 64
SLOTS_AT = 4096
SLOT_BYTES = 512
SLOTS = 64
CONTROL_BYTES = SLOTS_AT + SLOTS * SLOT_BYTES
REQUEST = struct.Struct("<QBBBxIIH")
MAX_LAYER_ID = SLOT_BYTES - REQUEST.size
MAX_MESSAGE = SLOTS_AT - ERROR_AT
# Waiting without sleeping (spinning) pays only with cores to spare: with fewer, the spinners would take
# the CPU from the very processes they wait for.
SPARE_CORES = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) >= 8
# An answer is awaited this long by spinning on `answered` before sleeping in poll(). Spinning relies on
# x86's in-order visibility of stores (an error is written before `answered`).
SPIN_S = 300e-6 if SPARE_CORES and platform.machine() in ("x86_64", "AMD64") else 0.0
CHECK_EVERY = 1.0  # seconds of waiting on a reply between checks that the executor still knows the client
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass
class Request:
    seq: int
    op: str = ""
    layer: str = ""
    inference: bool = False
    dtype: torch.dtype | None = None
    shape: tuple[int, int] = (0, 0)
    malformed: str | None = None  # why the slot could not be read; the call is answered with this error


def _slot(seq: int) -> int:
    return SLOTS_AT + (seq % SLOTS) * SLOT_BYTES


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
        # The client holds an exclusive lock on its control block for as long as its process lives (the
        # kernel drops it when the process dies, however it dies): the executor tells a dead client from a
        # busy one at once (`peer_alive`) instead of after its heartbeat timeout. Works across PID namespaces.
        self._lock_fd = os.open(paths["control"], os.O_RDONLY | os.O_CLOEXEC)
        if owner:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._reply_poll = select.poll()
        self._reply_poll.register(self.reply_fd, select.POLLIN)
        # Client: the last call made. Executor: the last call taken (it takes only the calls after this).
        self.seq = U64.unpack_from(self.control, TAKEN_AT)[0]

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

    @property
    def answered(self) -> int:
        return U64.unpack_from(self.control, ANSWERED_AT)[0]

    def submit(self, op: str, layer: str, inference: bool, dtype: torch.dtype, shape: tuple[int, int],
               timeout: float, still_attached: Callable[[], None]) -> int:
        """Queue a call; returns its sequence number. Waits only while all SLOTS slots hold unanswered calls.
        Raises the error of an earlier call that failed and was not reported yet."""
        name = layer.encode()
        if len(name) > MAX_LAYER_ID:
            raise BadCall(f"layer id {layer[:60]!r}... is longer than {MAX_LAYER_ID} bytes")
        seq = self.seq + 1
        if seq - self.answered > SLOTS:  # the slot still holds a call the executor may not have taken
            self.wait_answered(seq - SLOTS, timeout, still_attached)
        self.raise_error()  # an error of any earlier call, call seq - SLOTS included, is an earlier call's
        at = _slot(seq)
        self.control[at + REQUEST.size:at + REQUEST.size + len(name)] = name
        REQUEST.pack_into(self.control, at, 0, OPS.index(op), inference, DTYPES.index(dtype), *shape, len(name))
        U64.pack_into(self.control, at, seq)  # last: the slot is complete once its seq is there
        self.seq = seq
        _ring(self.request_fd)
        return seq

    def wait(self, seq: int, timeout: float, still_attached: Callable[[], None]) -> None:
        """Until call `seq` (and so every call before it) is answered; then raise any unreported error."""
        self.wait_answered(seq, timeout, still_attached)
        self.raise_error(seq)

    def wait_answered(self, seq: int, timeout: float, still_attached: Callable[[], None]) -> None:
        """Until call `seq` is answered. Every CHECK_EVERY seconds of waiting, `still_attached()` asks over
        the socket whether the executor still knows this client (it raises if not: an executor that restarted
        never answers this doorbell)."""
        # Spin first: a sleeping process is woken through the scheduler (and a core in a deep idle state),
        # which costs more than a short call takes.
        spin_until = time.perf_counter() + SPIN_S
        while self.answered < seq and time.perf_counter() < spin_until:
            pass
        deadline = time.monotonic() + timeout
        while self.answered < seq:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ExecutorUnavailable(f"executor did not answer call {seq} within {timeout:g}s "
                                          "(stopped, restarted or overloaded)")
            if self._reply_poll.poll(min(left, CHECK_EVERY) * 1000):
                _drain(self.reply_fd)
            elif self.answered < seq:
                still_attached()

    def raise_error(self, current: int | None = None) -> None:
        """Raise the executor's error for a call that failed, if the client has not seen it yet."""
        error_seq, seen = (U64.unpack_from(self.control, at)[0] for at in (ERROR_SEQ_AT, ERRORS_SEEN_AT))
        if error_seq <= seen:
            return
        length = U32.unpack_from(self.control, ERROR_LEN_AT)[0]
        U64.pack_into(self.control, ERRORS_SEEN_AT, error_seq)
        try:
            reply = json.loads(self.control[ERROR_AT:ERROR_AT + min(length, MAX_MESSAGE)])
        except ValueError:
            reply = {"error": "SymbiosisError", "message": f"call {error_seq} failed (unreadable error report)"}
        if error_seq != current:  # a pipelined call: the failure shows at a later call
            reply["message"] = f"an earlier call of this client (#{error_seq}) failed: {reply.get('message')}"
        wire.raise_error(reply)

    # --- executor -------------------------------------------------------------------------------------

    def take_requests(self) -> list[Request]:
        """The calls queued since the last take, in order (called when the request FIFO is readable)."""
        _drain(self.request_fd)
        requests = []
        while True:
            seq, at = self.seq + 1, _slot(self.seq + 1)
            if U64.unpack_from(self.control, at)[0] != seq:
                break
            _, op, inference, dtype, rows, cols, layer_len = REQUEST.unpack_from(self.control, at)
            if op >= len(OPS) or dtype >= len(DTYPES) or layer_len > MAX_LAYER_ID:
                requests.append(Request(seq, malformed=f"malformed doorbell request (op {op}, dtype {dtype}, "
                                                       f"layer id of {layer_len} bytes)"))
            else:
                layer = bytes(self.control[at + REQUEST.size:at + REQUEST.size + layer_len]).decode(errors="replace")
                requests.append(Request(seq, OPS[op], layer, bool(inference), DTYPES[dtype], (rows, cols)))
            self.seq = seq
        if requests:
            U64.pack_into(self.control, TAKEN_AT, self.seq)
        return requests

    def answer(self, seq: int, error: dict | None = None) -> None:
        """Call `seq` is done (for a pipelined client: queued on the executor's stream), or failed with
        `error` (the socket path's error reply)."""
        if error is not None and U64.unpack_from(self.control, ERRORS_SEEN_AT)[0] >= \
                U64.unpack_from(self.control, ERROR_SEQ_AT)[0]:  # the last error was seen: room for this one
            error = {**error, "seq": seq, "message": str(error.get("message"))[:MAX_MESSAGE // 8]}  # fits as UTF-8
            message = json.dumps(error).encode()
            self.control[ERROR_AT:ERROR_AT + len(message)] = message
            U32.pack_into(self.control, ERROR_LEN_AT, len(message))
            U64.pack_into(self.control, ERROR_SEQ_AT, seq)
        # `answered` goes last: a client spinning on it must find the error already written (x86 makes stores
        # visible in program order, and only there do clients spin; elsewhere they wait for the FIFO byte,
        # whose syscall orders them).
        U64.pack_into(self.control, ANSWERED_AT, seq)
        _ring(self.reply_fd)

    def unlink(self) -> None:
        """Remove the files; the mapping and the FIFO descriptors stay usable by whoever has them open."""
        for path in self.paths.values():
            if path.name.startswith(PREFIX):
                path.unlink(missing_ok=True)

    def peer_alive(self) -> bool:
        """Executor: whether the client's process still holds its doorbell (it has not exited or died, nor
        closed it)."""
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        return False

    def close(self, unlink: bool = False) -> None:
        for fd in (self.request_fd, self.reply_fd, self._lock_fd):
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
    spurious wake-up; a second read would cost a syscall a call."""
    try:
        os.read(fd, 4096)
    except BlockingIOError:
        pass
