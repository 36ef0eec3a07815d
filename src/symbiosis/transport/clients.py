"""The executor service's attached clients: who they are, what they hold, and who may attach or use which.

A client belongs to the tenant whose connection attached it (`auth.py`); only that tenant's connections may
use its id, and only the connection that attached it may call through it (its heartbeats and pings come
from side connections of the same tenant). Attaches are limited per tenant and in all, and checked before
anything is made for them.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections import deque
from dataclasses import dataclass, field

from symbiosis.errors import BadCall, UnknownClient, Unauthorized
from symbiosis.executor.executor import Executor
from symbiosis.transport.ipc.doorbell import Doorbell
from symbiosis.transport.ipc.shm import SharedBuffer

log = logging.getLogger("symbiosis.executor")
FDS_PER_CLIENT = 8  # descriptors an ipc:// client may hold here: two ZeroMQ connections, its link, two pipe
# ends, and room for ZeroMQ's own


def _raise_descriptor_limit() -> int:
    """Raise this process's descriptor limit to its hard limit (Linux's default soft limit is 1024, which 400
    attaches used up; ZeroMQ then aborted the process); returns what is left for clients."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return max(0, soft - 256)  # the executor's own files, sockets and threads


def mps_running() -> bool:
    """Whether an NVIDIA MPS control daemon serves this host's CUDA processes: CUDA connects a process to MPS
    when it finds the daemon's pipe, in $CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


@dataclass
class RemoteClient:
    """The service's record of one attached client."""

    identity: bytes
    tenant: str
    name: str
    buffer: SharedBuffer | None
    last_seen: float
    doorbell: Doorbell | None = None  # ipc://: the call path that bypasses the socket
    flags: SharedBuffer | None = None  # a pipelined client's int32 [input seq, output seq] (client.py)
    link: socket.socket | None = None  # ipc://: the handoff connection, open while the client's process lives
    pending: deque = field(default_factory=deque)  # doorbell requests taken, not yet submitted (in order)
    in_batcher: bool = False  # one of its doorbell calls is submitted and not answered yet
    on_stream: int = 0  # pipelined: its answered calls the executor's stream has not run yet




class ClientTable(dict):
    """client id -> RemoteClient."""

    def __init__(self, executor: Executor, max_attaches: int, max_attaches_per_tenant: int):
        super().__init__()
        self.executor = executor
        # No more clients than this process's descriptor limit allows (raised to the hard limit first).
        self.max_attaches = min(max_attaches, _raise_descriptor_limit() // FDS_PER_CLIENT)
        self.max_attaches_per_tenant = max_attaches_per_tenant
        self._warned_no_mps = False

    def check_room(self, tenant: str, header: dict) -> None:
        """Refuse an attach before anything is made for it."""
        if len(self) >= self.max_attaches:
            raise Unauthorized(f"this executor serves {self.max_attaches} clients at most; try again later")
        if sum(client.tenant == tenant for client in self.values()) >= self.max_attaches_per_tenant:
            raise Unauthorized(f"tenant {tenant!r} has {self.max_attaches_per_tenant} clients attached, its most; "
                               "close one first")
        if "buffer" in header or "doorbell" in header or "flags" in header:
            raise BadCall("an attach names no files: the executor makes a client's shared memory and hands it over")

    def admit(self, identity: bytes, tenant: str, header: dict, made: tuple | None, last_seen: float) -> str:
        """Register a client (its fingerprint checked) with what was made for it: (buffer, doorbell, flags,
        descriptors) or None; everything made is closed if it is refused."""
        name = str(header.get("name", "client"))[:64]
        try:
            client_id = self.executor.register(str(header.get("fingerprint")), f"{name}-{secrets.token_hex(4)}")
        except BaseException:
            if made is not None:
                for thing in made[:3]:
                    if thing is not None:
                        thing.close()
                for fd in made[3]:
                    os.close(fd)
            raise
        buffer, doorbell, flags, _ = made if made is not None else (None, None, None, [])
        self[client_id] = RemoteClient(identity, tenant, name, buffer, last_seen, doorbell, flags)
        return client_id

    def owned(self, client_id, tenant: str, identity: bytes, op: str) -> RemoteClient:
        """The client a message names, if its tenant sent it (and, but for heartbeats, pings and its rendezvous
        store's requests, each sent on a channel of their own, over the connection that attached it)."""
        client = self.get(client_id) if isinstance(client_id, str) else None  # (a list or object: no client's id)
        if client is None or client.tenant != tenant or \
                (client.identity != identity and op not in ("heartbeat", "ping", "store")):
            raise UnknownClient(f"client {str(client_id)[:80]!r} is not attached to this executor (restarted, or "
                                "timed out without heartbeats); attach again")
        return client

    def warn_without_mps(self) -> None:
        """Once: a second pipelined client process computes on the executor's GPU, and no MPS serves it."""
        if not self._warned_no_mps and sum(c.flags is not None for c in self.values()) > 1 and not mps_running():
            self._warned_no_mps = True
            log.warning("several client processes compute on %s without MPS: the GPU time-slices between their "
                        "contexts (eight 1B tenants ran at half the tokens/s on an H100). Start `nvidia-cuda-mps-control "
                        "-d` before the executor and its clients (README, Performance)", self.executor.device)

    def of_tenant(self, tenant: str) -> set[str]:
        return {client_id for client_id, client in self.items() if client.tenant == tenant}
