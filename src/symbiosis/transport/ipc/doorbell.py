"""The same-host call path: a ring of request slots in shared memory plus a pipe byte as the wake-up.

A ZeroMQ request/reply hands each message through two I/O threads per side, which costs ~0.5 ms a round
trip; a layer call is on the client's critical path, and a fine-tuning step makes ~130 of them. So on
`ipc://` the calls skip the socket: the client writes a fixed-layout request into the next slot of a small
shared control block and writes one byte into a pipe the executor's I/O thread polls. The executor takes
the slots in order, and answers each call by advancing `answered` in the header (and writing one byte into
a second pipe, which a waiting client sleeps on). The tensors stay in the client's `SharedBuffer`.
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

import json
import mmap
import os
import platform
import select
import struct
import time
from dataclasses import dataclass
from typing import Callable

import torch

from symbiosis.errors import BadCall, ExecutorUnavailable
from symbiosis.protocol import CALL_DTYPES as DTYPES, CHECK_EVERY, OPS  # an op and a dtype travel as indexes
from symbiosis.transport import wire
from symbiosis.transport.ipc.shm import sealed_memory

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
    """One client's control block and its two pipes (request: client -> executor, reply: back).

    The executor makes all three (`pair`) and hands the client its ends over the handoff socket: the
    control block is sealed anonymous memory (`shm.sealed_memory`), nothing is in any directory. Each side
    holds `request_fd` and `reply_fd`: the client writes the first and reads the second, the executor the
    reverse. A pipe whose other end is gone reads as end-of-file: `peer_gone` (the executor drops the client;
    the client raises `ExecutorUnavailable` at once instead of waiting out its timeout).
    """

    def __init__(self, control_fd: int, request_fd: int, reply_fd: int):
        try:
            self.control = mmap.mmap(control_fd, CONTROL_BYTES)
        finally:
            os.close(control_fd)  # the mapping keeps the memory
        self.request_fd, self.reply_fd = request_fd, reply_fd
        self.peer_gone = False
        self._reply_poll = select.poll()
        self._reply_poll.register(self.reply_fd, select.POLLIN)
        # Client: the last call made. Executor: the last call taken (it takes only the calls after this).
        self.seq = U64.unpack_from(self.control, TAKEN_AT)[0]
        self.last_answer = self.seq  # executor: the last call it answered (its own count: the block is shared)

    @classmethod
    def pair(cls) -> tuple["Doorbell", list[int]]:
        """The executor's side, and the descriptors of the client's (control, request write, reply read), to
        hand over and then close."""
        control = sealed_memory(CONTROL_BYTES, "doorbell")
        request_read, request_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        reply_read, reply_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        return cls(os.dup(control), request_read, reply_write), [control, request_write, reply_read]

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
                if not _drain(self.reply_fd) and self.answered < seq:
                    raise ExecutorUnavailable("the executor closed this client's doorbell (its process is gone, "
                                              "or it detached this client)")
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
        """The calls queued since the last take, in order (called when the request pipe is readable)."""
        if not _drain(self.request_fd):
            self.peer_gone = True  # the client's process closed its end (exited, or died): no more calls
        requests = []
        while True:
            seq, at = self.seq + 1, _slot(self.seq + 1)
            if U64.unpack_from(self.control, at)[0] != seq:
                break
            if seq - self.last_answer > SLOTS:  # its slot held a call not yet answered: the client did not wait
                raise BadCall(f"the client wrote call {seq} over unanswered ones (at most {SLOTS} may be "
                              "outstanding)")
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
        self.last_answer = seq
        _ring(self.reply_fd)

    def close(self) -> None:
        for fd in (self.request_fd, self.reply_fd):
            os.close(fd)
        self.control.close()


def _ring(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass  # the pipe is full of unread wake-ups: the reader will wake anyway
    except BrokenPipeError:
        pass  # the reader is gone; the waits and the server's reaper notice that


def _drain(fd: int) -> bool:
    """Consume pending wake-up bytes; False once the writer is gone (end of file). One read: a byte left over
    (more than 4096 pending) only causes one spurious wake-up; a second read would cost a syscall a call."""
    try:
        return os.read(fd, 4096) != b""
    except BlockingIOError:
        return True
