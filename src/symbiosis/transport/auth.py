"""Who a connection belongs to: tenants and their tokens, checked in ZeroMQ's handshake.

`--token-file` holds one `NAME TOKEN` line per tenant (a file holding one bare token is one tenant,
`admin`: the executor's only tenant sees everything). A client presents its token as the password of ZeroMQ's PLAIN mechanism; the executor's ZAP
handler (`ZapHandler`, ZeroMQ's authentication protocol, RFC 27) compares it in constant time with every
tenant's and answers with the tenant's name, which ZeroMQ then attaches to every message of that connection
(the frame property `User-Id`). So nothing a peer sends is read before its token is checked, and each message
says which tenant sent it: a client id belongs to the tenant that attached it, and only that tenant may use
it. The tenant named `admin` may read every tenant's figures (`--stats`).

PLAIN sends the token in clear: on a network you do not trust, carry `tcp://` inside a tunnel (SSH, WireGuard).
"""

from __future__ import annotations

import hmac
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq

ADMIN = "admin"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where ZeroMQ asks, in the context of the socket being connected to
MAX_TENANT_NAME = 64


@dataclass(frozen=True)
class Tenants:
    """tenant name -> token. Read with `read`; a server holds one and may be given another (`ZapHandler.use`)."""

    tokens: dict[str, str]

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Tenants":
        """`NAME TOKEN` lines (blank lines and `#` comments skipped), or one bare token."""
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
        lines = [line for line in lines if line and not line.startswith("#")]
        if len(lines) == 1 and len(lines[0].split()) == 1:
            return cls({ADMIN: lines[0]})
        tokens: dict[str, str] = {}
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(f"{path}: line {number} is not `NAME TOKEN`")
            name, token = fields
            if len(name) > MAX_TENANT_NAME or not name.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"{path}: line {number}: a tenant name is letters, digits, '-' and '_' "
                                 f"(at most {MAX_TENANT_NAME})")
            if name in tokens or token in tokens.values():
                raise ValueError(f"{path}: line {number}: tenant {name!r} or its token appears twice")
            tokens[name] = token
        if not tokens:
            raise ValueError(f"{path}: no tenant")
        return cls(tokens)

    def tenant(self, token: bytes) -> str | None:
        """The tenant whose token this is; every token is compared, in constant time."""
        found = None
        for name, expected in self.tokens.items():
            if hmac.compare_digest(token, expected.encode()):
                found = name
        return found


def client_token(path: str | os.PathLike) -> str:
    """A client's token from its file: a bare token, or its own `NAME TOKEN` line."""
    fields = Path(path).read_text().split()
    if len(fields) not in (1, 2):
        raise ValueError(f"{path}: expected a token (or `NAME TOKEN`)")
    return fields[-1]


def secure_client(socket: zmq.Socket, token: str | None) -> None:
    """Present `token` in the handshake of every connection this socket makes."""
    if token is not None:
        socket.plain_username = b"symbiosis"
        socket.plain_password = token.encode()


class ZapHandler:
    """Answers ZeroMQ's authentication requests for one context (its own thread)."""

    def __init__(self, context: zmq.Context, tenants: Tenants):
        self._tenants = tenants
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="symbiosis-zap", daemon=True)
        self._thread.start()

    def use(self, tenants: Tenants) -> None:
        """New tenants for connections made from now on (connections already made keep their tenant)."""
        self._tenants = tenants

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(200):
                continue
            request = self._socket.recv_multipart()
            version, request_id = request[:2] if len(request) >= 2 else (b"1.0", b"")
            tenant = None
            if len(request) >= 8 and request[5] == b"PLAIN":
                tenant = self._tenants.tenant(request[7])
            status = (b"200", b"OK") if tenant is not None else (b"400", b"missing or wrong token")
            self._socket.send_multipart([version, request_id, *status, (tenant or "").encode(), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()
