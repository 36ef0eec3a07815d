"""What every session with an executor in another process has in common (`tcp.py`, `ipc/session.py`,
`ipc/pipelined.py` add how layer calls travel).

Requests are synchronous request/replies on a ZeroMQ channel (`channel.py`), each with a timeout: an
executor that is gone or hung raises `ExecutorUnavailable` instead of hanging the client. A heartbeat thread
(its own channel) keeps the executor from reaping a client that is busy computing on its side. Calls are
checked for shape and layer here, before they are sent, as the executor would (`protocol.py`), so that a
pipelined call's error shows at the call.
"""

from __future__ import annotations

import select
import socket
import threading
import time
import weakref
from abc import abstractmethod

import torch

from symbiosis.errors import ExecutorUnavailable, SymbiosisError, UnknownClient, UnknownLayer
from symbiosis.model.partition import BaseLayerSpec, group_spec
from symbiosis.protocol import CHECK_EVERY, check_call, check_counts, result_width
from symbiosis.transport import wire
from symbiosis.transport.base import Session
from symbiosis.transport.channel import Channel

INITIAL_BUFFER_BYTES = 8 << 20


class RemoteSession(Session):
    """A session with an executor in another process or on another host."""

    pipelined = False  # calls return before they are answered (`ipc/pipelined.py`)
    # a MoE projection's experts as ONE call (rows grouped by expert, `counts` rows each), where a call's header can
    # carry the counts (tcp://, nccl://); the ipc:// doorbell's fixed slots cannot: its clients call expert by expert
    grouped_experts = False
    # gated MLPs called whole (client/blocks.py) where calls carry their tensors to another device or host: there a
    # fifth of the bytes and one call fewer each way outweigh the executor recomputing gate and up in backward
    # (+27% of a Llama-3.2-1B layer's GEMM work); shared memory on one host (ipc://) moves bytes for less than that
    whole_blocks = False

    def __init__(self, executor, fingerprint: str, name: str, device: torch.device):
        self.executor, self.fingerprint, self.name, self.device = executor, fingerprint, name, device
        self.channel = Channel(executor.url, executor.timeout, executor.token)
        self.link: socket.socket | None = None  # ipc://: the handoff connection, ended when the executor is
        self._broken: str | None = None  # why calls can no longer be made (the executor stopped answering)
        self._call_lock = threading.Lock()  # one call at a time uses the transport
        # Layer calls made, and seconds this client's thread spent waiting for their replies (the executor's
        # queue, compute and the transport): what the executor costs a client, read by the benchmarks.
        self.calls, self.waited_s = 0, 0.0
        self._heartbeat_stop = threading.Event()
        self._attach(INITIAL_BUFFER_BYTES)

    # --- what a transport adds ------------------------------------------------------------------------

    def _shared(self, buffer_bytes: int) -> dict | None:
        """The shared memory to ask for at attach (None: calls travel in messages)."""
        return None

    def _take_shared(self, reply: dict) -> None:
        """Take what the executor made for this client (its attach reply)."""

    def _attach_request(self) -> dict:
        """What else the attach request asks for (a data plane: `collective.py`)."""
        return {}

    def _transport(self) -> list:
        """What this session's calls travel through (to close): buffers, doorbell, link."""
        return []

    def _buffer_bytes(self) -> int:
        return 0

    @abstractmethod
    def _call(self, op: str, layer_id: str, tensor: torch.Tensor, out_width: int, inference: bool) -> torch.Tensor:
        """tensor [T, d_in] in the client's dtype and device -> [T, d_out] likewise."""

    # --- attaching --------------------------------------------------------------------------------------

    def _attach(self, buffer_bytes: int) -> None:
        shared = self._shared(buffer_bytes)
        reply, _ = self.channel.request({"op": "attach", "fingerprint": self.fingerprint, "name": self.name,
                                         "shared": shared, **self._attach_request()})
        self._take_shared(reply)
        self.client_id = reply["client"]
        self.dtype = wire.parse_dtype(reply["dtype"])
        self.executor_device = reply["device"]
        self.max_call_tokens = int(reply["max_call_tokens"])
        self.heartbeat_s = float(reply["heartbeat_s"])
        self.layer_specs = {d["layer_id"]: BaseLayerSpec(**d) for d in reply["layers"]}
        self.block_specs = {d["layer_id"]: BaseLayerSpec(**d) for d in reply.get("blocks") or () if self.whole_blocks}
        self.expert_groups = {str(k): int(v) for k, v in (reply.get("experts") or {}).items()}
        self._broken = None
        self._heartbeat_stop.clear()
        # The thread holds the session weakly: a session nobody holds any more is collected (its claim on
        # pipelining given up), its heartbeats stop, and the executor reaps it.
        threading.Thread(target=_heartbeat, args=(weakref.ref(self), self.client_id, self._heartbeat_stop),
                         name="symbiosis-heartbeat", daemon=True).start()

    def reconnect(self) -> None:
        """Attach again (after the executor restarted): a new client id; the model and its state are kept."""
        self._heartbeat_stop.set()  # the old heartbeat thread ends; _attach starts one for the new id
        self.channel.close()
        self.channel = Channel(self.executor.url, self.executor.timeout, self.executor.token)
        old, size = self._transport(), self._buffer_bytes()
        self._reset_transport()
        self._attach(size)
        for thing in old:
            thing.close()

    def _reset_transport(self) -> None:
        self.link = None

    def _lost(self, why: str) -> None:
        """The executor is gone or stopped answering: calls raise from now on."""
        if self._broken is None:
            self._broken = why

    # --- requests ---------------------------------------------------------------------------------------

    def _request(self, header: dict, *tensors: torch.Tensor, channel: Channel | None = None) -> tuple[dict, list]:
        self._check_open()
        try:
            return (channel or self.channel).request({**header, "client": self.client_id}, *tensors)
        except UnknownClient as e:
            raise ExecutorUnavailable(f"{e}. The executor at {self.executor.url} no longer knows this client; "
                                      "call reconnect() on the session to attach again") from e

    def _still_attached(self) -> None:
        """Raise if the executor answers that it does not know this client; no answer in time proves nothing."""
        probe = Channel(self.executor.url, min(self.executor.timeout, CHECK_EVERY), self.executor.token)
        try:
            self._request({"op": "ping"}, channel=probe)
        except ExecutorUnavailable as e:
            if isinstance(e.__cause__, UnknownClient):
                raise
        finally:
            probe.close()

    def _check_open(self) -> None:
        if self._heartbeat_stop.is_set():
            raise SymbiosisError(f"this session is closed (client {self.client_id!r}); attach a new one")
        if self._broken is not None:
            raise ExecutorUnavailable(f"{self._broken}; results since its last answer are lost. "
                                      "Call reconnect() on the session once an executor serves again")

    def _spec(self, layer_id: str, tensor: torch.Tensor, op: str) -> BaseLayerSpec:
        """The layer's spec, once the call is checked as the executor would."""
        spec = self.block_specs.get(layer_id) or group_spec(self.layer_specs, layer_id)
        check_call(layer_id, spec, op, tensor, self.max_call_tokens)
        return spec

    # --- Session ----------------------------------------------------------------------------------------

    def forward(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        return self._call("forward", layer_id, x, self._spec(layer_id, x, "forward").out_features, inference)

    def forward_nobias(self, layer_id: str, x: torch.Tensor, inference: bool = False) -> torch.Tensor:
        width = self._spec(layer_id, x, "forward_nobias").out_features
        return self._call("forward_nobias", layer_id, x, width, inference)

    def backward(self, layer_id: str, grad_out: torch.Tensor) -> torch.Tensor:
        return self._call("backward", layer_id, grad_out, self._spec(layer_id, grad_out, "backward").in_features,
                          False)

    def expert_group(self, group_id: str, x: torch.Tensor | None = None):
        """How many experts the executor runs as one call under `group_id` (None: call them one by one). A remote
        executor's experts never run on this thread (`x` given: None)."""
        return self.expert_groups.get(group_id) if self.grouped_experts and x is None else None

    def _experts_call(self, op: str, group_id: str, tensor: torch.Tensor, counts: list[int], inference: bool):
        experts = self.expert_groups.get(group_id)
        spec = self.layer_specs.get(f"{group_id}.0")
        if not self.grouped_experts or experts is None or spec is None:
            raise UnknownLayer(f"this executor serves no experts {group_id[:300]!r} as one group")
        counts = list(map(int, counts))
        check_call(group_id, spec, op, tensor, self.max_call_tokens)
        check_counts(group_id, op, counts, experts, tensor.shape[0])
        return self._call(op, group_id, tensor, result_width(spec, op), inference, counts=counts)

    def experts_forward(self, group_id: str, x: torch.Tensor, counts: list[int], inference: bool = False):
        return self._experts_call("forward", group_id, x, counts, inference)

    def experts_backward(self, group_id: str, grad_out: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self._experts_call("backward", group_id, grad_out, counts, False)

    def _ask_tensors(self, op: str, layer_id: str) -> list[torch.Tensor]:
        reply, frames = self._request({"op": op, "layer": layer_id})
        return [wire.frame_tensor(f, spec).clone() for f, spec in zip(frames, reply["tensors"])]

    def fetch(self, layer_id: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        tensors = self._ask_tensors("fetch", layer_id)
        return tensors[0], (tensors[1] if len(tensors) > 1 else None)

    def weight_norms(self, layer_id: str) -> torch.Tensor:
        return self._ask_tensors("weight_norms", layer_id)[0]

    def close(self) -> None:
        if self._heartbeat_stop.is_set():
            return
        try:
            self._before_detach()
            self._request({"op": "detach"})
        except ExecutorUnavailable:
            pass
        finally:
            self._heartbeat_stop.set()
            self.channel.close()
            for thing in self._transport():
                thing.close()

    def _before_detach(self) -> None:
        """What must be done while the executor still serves this client (a pipelined one's last answers)."""


def gpu_reached(event: torch.cuda.Event, timeout_s: float) -> bool:
    """Whether the GPU reached `event` within `timeout_s` (looked at every 50 us): a stream stuck waiting for an
    executor that is gone must not hang the caller."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(50e-6)
    return True


def _heartbeat(session_ref: weakref.ref, client_id: str, stop: threading.Event) -> None:
    """Keeps the executor from reaping a session while it exists. A pipelined session pings instead: an
    executor that stops answering would otherwise leave the client's stream waiting for a flag forever, and
    a CPU that synchronises with it (`loss.item()`) hanging; then the stream is released and the session
    marked broken, so its next call raises. On ipc:// the handoff connection reads as end-of-file as soon as
    the executor's process is gone: the session is marked broken at once, not after a timeout."""
    session = session_ref()
    channel = Channel(session.executor.url, session.executor.timeout, session.executor.token)
    period, url, link = session.heartbeat_s, session.executor.url, session.link
    del session  # held only while it is used
    try:
        while True:
            gone = _link_gone(stop, link, period) if link is not None else False
            if link is None:
                stop.wait(period)
            if stop.is_set():
                return
            session = session_ref()
            if session is None or session.client_id != client_id:
                return  # collected, or attached again under a new id (with a heartbeat of its own)
            if gone:
                session._lost(f"the executor at {url} closed this client's connection (it stopped, or detached "
                              "this client)")
                return
            if not session.pipelined:
                try:
                    channel.send({"op": "heartbeat", "client": client_id})
                except SymbiosisError as e:  # the executor took nothing for a whole timeout: it is gone
                    if not stop.is_set():
                        session._lost(f"the executor at {url} stopped taking messages ({e})")
                    return
                del session
                continue
            try:
                channel.request({"op": "ping", "client": client_id})
            except SymbiosisError as e:
                if not stop.is_set():
                    session._lost(f"the executor at {url} stopped answering ({e})")
                return
            del session
    finally:
        channel.close()


def _link_gone(stop: threading.Event, link: socket.socket, period: float) -> bool:
    """Watch the handoff connection for `period` seconds (less once stopped): whether it reached its end."""
    deadline = time.monotonic() + period
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            if not select.select([link], [], [], min(0.2, period))[0]:
                continue
            if link.recv(1, socket.MSG_PEEK) == b"":  # readable: no wait; a handed-over buffer is not the end
                return True
        except (ValueError, OSError):  # the session closed it meanwhile
            return False
        time.sleep(0.01)  # a handed-over buffer, for the session's own thread to take
    return False
