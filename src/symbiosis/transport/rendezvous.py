"""The rendezvous of an `nccl://` (`gloo://`) client's process group, carried over the executor's own ZeroMQ socket.

A process group's two ranks meet through a key-value store: NCCL's rank 0 puts its communicator's unique id
there (the address of its bootstrap socket and a random magic: whoever reads it can join the pair), gloo's ranks
their addresses. A TCPStore would listen on a port of its own, unauthenticated, where anyone on the network could
read a pair's keys, or fill the executor's memory with theirs. Here each client's pair has a store of its own on
the executor (`PairStore`, in memory), and the client reaches it only by requests over the socket that checked
its tenant's token (`ChannelStore`, a `torch.distributed.Store`). The executor answers them on its I/O thread and
never waits in one: a client's `get` or `wait` of a key not there yet asks again.

    client (rank 1)                            executor
    ChannelStore.get(key)  -- {op: store, action: get, key} -->  PairStore.serve -> HashStore (rank 0 sets here)
                           <-- {value: hex | null} ----------   (null: not yet; the client asks again)

What a client may put in its store is bounded (keys, their length, the bytes of their values): the two backends
need a few keys of a few hundred bytes.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from symbiosis.errors import BadCall
from symbiosis.transport.channel import Channel

MAX_KEYS = 64  # a client's own keys in its pair's store (gloo sets 1 a rank, NCCL 0 on the client's side)
MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 16 << 10  # NCCL's unique id is 128 bytes, a gloo address ~300
MAX_STORE_BYTES = 256 << 10
POLL_S = (0.001, 0.05)  # a wait asks again after 1 ms, backing off to 50 ms


def _key(key) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
        raise BadCall(f"a store request's key must be a string of 1..{MAX_KEY_CHARS} characters")
    return key


def _value(header: dict, field: str) -> bytes:
    value = header.get(field)
    if not isinstance(value, str) or len(value) > 2 * MAX_VALUE_BYTES:
        raise BadCall(f"a store request's {field} must be hex of at most {MAX_VALUE_BYTES} bytes")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise BadCall(f"a store request's {field} is not hex") from None


class PairStore:
    """The executor's side: one client's pair's store, `store` for the executor's rank, `serve` for the client's
    requests (from the I/O thread; never blocks)."""

    ACTIONS = ("set", "get", "add", "check", "compare_set", "delete")

    def __init__(self, timeout_s: float):
        self.store = dist.HashStore()
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self._written: dict[str, int] = {}  # the client's keys -> bytes (HashStore cannot list its keys)
        self._lock = threading.Lock()

    def _room(self, key: str, nbytes: int) -> None:
        written = {**self._written, key: nbytes}
        if len(written) > MAX_KEYS or sum(written.values()) > MAX_STORE_BYTES:
            raise BadCall(f"a client's rendezvous store holds at most {MAX_KEYS} keys and {MAX_STORE_BYTES} bytes")
        self._written = written

    def serve(self, header: dict) -> dict:
        """A client's request -> the fields of its reply."""
        action = header.get("action")
        if action not in self.ACTIONS:
            raise BadCall(f"unknown store action {str(action)[:40]!r}: one of {', '.join(self.ACTIONS)}")
        if action == "check":
            keys = header.get("keys")
            if not isinstance(keys, list) or not 0 < len(keys) <= MAX_KEYS:
                raise BadCall(f"a store check names 1..{MAX_KEYS} keys")
            return {"found": self.store.check([_key(k) for k in keys])}
        key = _key(header.get("key"))
        with self._lock:
            if action == "get":  # only a key that is there: HashStore's get would wait for it on this thread
                return {"value": self.store.get(key).hex() if self.store.check([key]) else None}
            if action == "delete":
                self._written.pop(key, None)
                return {"deleted": self.store.delete_key(key)}
            if action == "add":
                amount = header.get("amount")
                if type(amount) is not int or abs(amount) > 1 << 62:  # noqa: E721 -- not a bool
                    raise BadCall("a store add's amount must be an integer")
                self._room(key, 20)
                return {"value": self.store.add(key, amount)}
            desired = _value(header, "value")
            self._room(key, len(desired))
            if action == "set":
                self.store.set(key, desired)
                return {}
            return {"value": self.store.compare_set(key, _value(header, "expected"), desired).hex()}


class ChannelStore(dist.Store):
    """The client's side: a `torch.distributed.Store` whose operations are requests to the executor over a
    channel of its own (its calls' channel carries pipelined replies that a request would skip). Made for one
    attach; `close` when the session goes."""

    def __init__(self, url: str, timeout_s: float, token: str | None, client_id: str):
        super().__init__()
        self.client_id, self.timeout_s = client_id, timeout_s
        self._channel = Channel(url, timeout_s, token)
        self.requests = 0  # how many were made (a process group's monitor may check keys while it lives)

    def _ask(self, action: str, **fields) -> dict:
        self.requests += 1
        reply, _ = self._channel.request({"op": "store", "client": self.client_id, "action": action, **fields})
        return reply

    @staticmethod
    def _hex(value) -> str:
        return (value.encode() if isinstance(value, str) else bytes(value)).hex()

    def set(self, key: str, value) -> None:
        self._ask("set", key=key, value=self._hex(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return bytes.fromhex(self._ask("get", key=key)["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._ask("add", key=key, amount=int(amount))["value"])

    def check(self, keys: list[str]) -> bool:
        return bool(self._ask("check", keys=list(keys))["found"])

    def compare_set(self, key: str, expected, desired) -> bytes:
        reply = self._ask("compare_set", key=key, expected=self._hex(expected), value=self._hex(desired))
        return bytes.fromhex(reply["value"])

    def delete_key(self, key: str) -> bool:
        return bool(self._ask("delete", key=key)["deleted"])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout else self.timeout_s
        deadline, pause = time.monotonic() + limit, POLL_S[0]
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"the executor's rank did not publish {', '.join(keys)[:200]} within "
                                          f"{limit:g} s")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])

    def close(self) -> None:
        self._channel.close()
