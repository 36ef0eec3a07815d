"""The `ipc://` handoff: how a client gets the shared memory and pipes the executor made for it.

ZeroMQ cannot pass file descriptors, so beside its `ipc://PATH` socket the executor listens on a Unix stream
socket at `PATH.handoff` (both mode 0600). A client's attach, over ZeroMQ, is answered with a one-time
ticket; the client connects here and sends it, and the executor sends back the descriptors (`SCM_RIGHTS`) of
the client's control block, its two pipes and, for a host buffer, the buffer. The connection then stays
open for as long as the client is attached:

- the executor sends later descriptors through it (a larger buffer, `send`), and
- each side learns at once that the other's process is gone: its end reads as end-of-file.

A ticket nobody claims within `TICKET_S` is dropped with everything made for it. The executor opens no
path a client names, and a client can only ever receive descriptors of its own attach.
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import time
from pathlib import Path
from typing import Callable

from symbiosis.errors import BadCall, ExecutorUnavailable

TICKET_BYTES = 16
TICKET_S = 10.0  # a client that attached and did not claim its descriptors within this is dropped
MAX_FDS = 4
# connections not yet past their ticket: beyond this the oldest is closed for the newest (a flood of idle
# connections, each held for TICKET_S, used up the descriptor table, and ZeroMQ then aborted the executor; a client
# presents its ticket as soon as it connects, so only a flood newer than its own connection can close it)
MAX_WAITING = 256


def handoff_path(ipc_path: str) -> Path:
    return Path(ipc_path + ".handoff")


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def private_socket_file(path: Path) -> None:
    """Only this OS user may connect (other users' processes could otherwise attach, or watch)."""
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


class Listener:
    """The executor's handoff socket (non-blocking: the server's I/O thread polls it)."""

    def __init__(self, path: Path):
        self.path = path
        if path.is_socket():
            path.unlink()  # a stale one of an executor that died; a live one would hold the ZeroMQ path too
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.socket.bind(str(path))
        private_socket_file(path)
        self.socket.listen(64)
        self.socket.setblocking(False)

    def fileno(self) -> int:
        return self.socket.fileno()

    def accept(self) -> socket.socket | None:
        try:
            connection, _ = self.socket.accept()
        except (BlockingIOError, InterruptedError):
            return None
        connection.setblocking(False)
        return connection

    def close(self) -> None:
        self.socket.close()
        self.path.unlink(missing_ok=True)


def read_ticket(connection: socket.socket, partial: bytes) -> tuple[bytes, bool]:
    """More of a ticket from a connection that is readable: (bytes so far, whether the peer hung up)."""
    try:
        data = connection.recv(TICKET_BYTES - len(partial))
    except BlockingIOError:
        return partial, False
    except OSError:
        return partial, True
    return partial + data, data == b""


def send(connection: socket.socket, fds: list[int]) -> None:
    """Hand descriptors to the client (they stay open here: the caller closes its copies). Never waits: a client
    takes each handoff before its request's reply, so a connection with no room holds earlier ones it never
    read, and waiting for room would stop the executor's I/O thread for every client."""
    try:
        socket.send_fds(connection, [b"F"], fds)  # (the connection is non-blocking)
    except BlockingIOError:
        raise ExecutorUnavailable("this client does not take what the executor hands it over its handoff "
                                  "connection: it is detached") from None


def peer_gone(connection: socket.socket) -> bool:
    """For a connection that polled readable after the handoff: whether the other side is gone. Nothing comes over it
    after the handoff: a client that writes there is refused (BadCall), not read a byte at a time (its writes kept
    the executor's I/O thread polling hot)."""
    try:
        data = connection.recv(1)
    except BlockingIOError:
        return False
    except OSError:
        return True
    if data:
        raise BadCall("the client wrote to its handoff connection, which carries nothing after the handoff")
    return True


def claim(path: str, ticket: bytes, count: int, timeout: float) -> tuple[socket.socket, list[int]]:
    """The client's side: connect, present the ticket, receive `count` descriptors."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        connection.settimeout(timeout)
        connection.connect(path)
        connection.sendall(ticket)
        return connection, receive(connection, count)
    except BaseException:
        connection.close()
        raise


def receive(connection: socket.socket, count: int) -> list[int]:
    """The next descriptors the executor sends (a larger buffer after a "buffer" request)."""
    try:
        _, fds, _, _ = socket.recv_fds(connection, 1, MAX_FDS)
    except (OSError, socket.timeout) as e:
        raise ExecutorUnavailable(f"the executor did not hand over this client's shared memory: {e}") from e
    if len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise ExecutorUnavailable(f"the executor handed over {len(fds)} descriptors, expected {count}")
    return fds


class Desk:
    """The executor's side: its handoff socket, connections that have not shown a ticket yet, and tickets
    issued and not yet claimed. Registers what it listens on in the server's poller."""

    def __init__(self, ipc_path: Path, poller):
        private_socket_file(ipc_path)  # the ZeroMQ socket file beside it
        self.listener = Listener(handoff_path(str(ipc_path)))
        self._poller = poller
        self._poller.register(self.listener.fileno(), 1)  # POLLIN
        self._tickets: dict[bytes, tuple[str, list[int], float]] = {}  # ticket -> (client, fds to hand, deadline)
        self._waiting: dict[int, tuple[socket.socket, bytes, float]] = {}  # fd -> (connection, ticket so far, deadline)

    @property
    def path(self) -> Path:
        return self.listener.path

    def __len__(self) -> int:
        """Tickets not yet claimed (attaches in progress)."""
        return len(self._tickets)

    def issue(self, client_id: str, fds: list[int]) -> bytes:
        ticket = new_ticket()
        self._tickets[ticket] = (client_id, fds, time.monotonic() + TICKET_S)
        return ticket

    def owns(self, fd: int) -> bool:
        return fd == self.listener.fileno() or fd in self._waiting

    def on_readable(self, fd: int, attached: Callable[[str], bool]) -> tuple[str, socket.socket] | None:
        """Accept connections, or read a ticket; returns (client, connection) once a client claimed its
        descriptors (they are sent and closed here), for the server to keep as the client's link."""
        if fd == self.listener.fileno():
            while (connection := self.listener.accept()) is not None:
                if len(self._waiting) >= MAX_WAITING:
                    oldest = next(iter(self._waiting))
                    self._poller.unregister(oldest)
                    self._waiting.pop(oldest)[0].close()
                self._waiting[connection.fileno()] = (connection, b"", time.monotonic() + TICKET_S)
                self._poller.register(connection.fileno(), 1)
            return None
        connection, ticket, deadline = self._waiting[fd]
        ticket, hung_up = read_ticket(connection, ticket)
        if len(ticket) < TICKET_BYTES and not hung_up:
            self._waiting[fd] = (connection, ticket, deadline)
            return None
        self._poller.unregister(fd)
        del self._waiting[fd]
        claim = self._tickets.pop(ticket, None) if not hung_up else None
        if claim is None or not attached(claim[0]):  # no such ticket, or its client is gone: nothing is handed
            connection.close()
            if claim is not None:
                close_all(claim[1])
            return None
        client_id, fds, _ = claim
        try:
            send(connection, fds)
        except OSError:
            connection.close()
            raise
        finally:
            close_all(fds)
        return client_id, connection

    def expired(self) -> list[str]:
        """Clients that attached and did not claim their descriptors in time (their descriptors closed); idle
        connections dropped."""
        now, late = time.monotonic(), []
        for ticket, (client_id, fds, deadline) in list(self._tickets.items()):
            if now > deadline:
                del self._tickets[ticket]
                close_all(fds)
                late.append(client_id)
        for fd, (connection, _, deadline) in list(self._waiting.items()):
            if now > deadline:
                self._poller.unregister(fd)
                del self._waiting[fd]
                connection.close()
        return late

    def forget(self, client_id: str) -> None:
        """A client that left before claiming: its descriptors are closed."""
        for ticket, (owner, fds, _) in list(self._tickets.items()):
            if owner == client_id:
                del self._tickets[ticket]
                close_all(fds)

    def close(self) -> None:
        for connection, _, _ in self._waiting.values():
            connection.close()
        for _, fds, _ in self._tickets.values():
            close_all(fds)
        self.listener.close()


def close_all(fds: list[int]) -> None:
    """Close descriptors made for a client that will not take them."""
    for fd in fds:
        os.close(fd)
