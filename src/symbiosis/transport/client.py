"""`symbiosis.connect(url, token=...)`: an executor in another process or on another host.

    executor = symbiosis.connect("ipc:///tmp/symbiosis.sock", token=token)
    model = symbiosis.from_pretrained(path, executor, auto_class=AutoModelForCausalLM)

The URL's scheme picks the transport: `tcp://` (`tcp.py`: calls as messages), `ipc://` (same host:
`ipc/session.py`, calls through shared memory; `ipc/pipelined.py` for a client process on the executor's
GPU, whose calls do not wait for their answers). Every session is a `base.Session`.
"""

from __future__ import annotations

from urllib.parse import urlparse

import torch

from symbiosis.transport import collective
from symbiosis.transport.channel import Channel
from symbiosis.transport.ipc import pipelined, streamops
from symbiosis.transport.ipc.session import IpcSession
from symbiosis.transport.remote import RemoteSession
from symbiosis.transport.tcp import TcpSession


class RemoteExecutor:
    """An executor in another process or on another host; a drop-in for `Executor` in `from_pretrained`."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0):
        scheme = urlparse(url).scheme
        if scheme not in ("ipc", "tcp", *collective.SCHEMES):
            raise ValueError(f"unsupported executor URL {url!r}: use ipc://PATH, tcp://HOST:PORT or nccl://HOST:PORT")
        # nccl:// (gloo://): requests over the executor's tcp:// socket, tensors over torch.distributed
        self.data_plane = collective.SCHEMES.get(scheme)
        self.url = collective.control_url(url) if self.data_plane else url
        self.token, self.timeout = token, timeout
        self.same_host = scheme == "ipc"
        self._description: dict | None = None

    def attach(self, fingerprint: str, name: str = "client", device: str | torch.device = "cpu") -> RemoteSession:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.data_plane is not None:
            return collective.CollectiveSession(self, fingerprint, name, device)
        if not self.same_host:
            return TcpSession(self, fingerprint, name, device)
        if self.pipelines(device) and pipelined.claim(device):
            return pipelined.PipelinedSession(self, fingerprint, name, device)
        return IpcSession(self, fingerprint, name, device)

    def _ask(self, op: str) -> dict:
        channel = Channel(self.url, self.timeout, self.token)
        try:
            return channel.request({"op": op})[0]
        finally:
            channel.close()

    def stats(self) -> dict:
        """This tenant's figures (the tenant `admin`: every figure of the executor)."""
        return self._ask("stats")["stats"]

    def pipelines(self, device: torch.device) -> bool:
        """Whether a client on `device` makes pipelined calls: same-host, on the executor's GPU, and both
        processes can queue stream memory operations."""
        if not self.same_host or device.type != "cuda":
            return False
        if self._description is None:
            self._description = self._ask("describe")
        return self._description["device"] == str(device) and self._description["stream_ops"] and \
            streamops.available(device)


def connect(url: str, token: str | None = None, timeout: float = 60.0) -> RemoteExecutor:
    """An executor served at `url` (`ipc://PATH` on this host, `tcp://HOST:PORT` anywhere), as the tenant
    whose token this is.

    `timeout`: seconds any one call may take before `ExecutorUnavailable` is raised.
    """
    return RemoteExecutor(url, token, timeout)
