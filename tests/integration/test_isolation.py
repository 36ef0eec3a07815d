"""Tenants that attack the executor with a valid token, on a real executor process (CPU): each attack costs
the attacker at most an error on its own calls; the executor and the other tenants carry on, exactly."""

from __future__ import annotations

import glob
import os
import socket
import time

import pytest
import torch
import zmq

import symbiosis
from helpers import TOKEN, start_executor
from symbiosis.transport import auth, wire
from symbiosis.transport.ipc import handoff
from symbiosis.transport.ipc.doorbell import ANSWERED_AT, CONTROL_BYTES, REQUEST, U64, Doorbell, _slot

pytestmark = pytest.mark.slow
LAYER = "model.layers.0.mlp.up_proj"


TENANTS = {"alice": "alice-token", "mallory": "mallory-token"}


@pytest.fixture(params=["ipc"])
def executor_process(request, checkpoints, tmp_path):
    """(url, an in-process Executor of the same checkpoint for expected values, the executor's process), with
    tenants alice and mallory beside the admin (TOKEN), 8 attaches per tenant, 12 in all, calls of 1,024
    tokens at most."""
    model_dir, _ = checkpoints("llama")
    url = f"ipc://{tmp_path}/executor.sock" if request.param == "ipc" else "tcp://127.0.0.1:0"
    if request.param == "tcp":
        with socket.socket() as probe:  # a free port, named before the executor binds it
            probe.bind(("127.0.0.1", 0))
            url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    process = start_executor(model_dir, url, tmp_path, "opportunistic", 5, "cpu", "float64", TENANTS,
                             "--max-attaches-per-tenant", "8", "--max-attaches", "12", "--max-call-tokens", "1024")
    local = symbiosis.Executor.from_pretrained(model_dir, dtype=torch.float64)
    yield url, local, process
    process.terminate()
    assert process.wait(timeout=30) == 0, "the executor did not stop cleanly"
    if url.startswith("ipc://"):
        socket_file = url.removeprefix("ipc://")
        assert not os.path.exists(socket_file) and not os.path.exists(socket_file + ".handoff")  # SIGTERM: gone


def _healthy_call(url, local) -> None:
    """Another tenant's call, checked exactly: the attack did not touch it."""
    session = symbiosis.connect(url, token=TOKEN, timeout=10).attach(local.fingerprint, "bystander")
    x = torch.randn(5, 64, dtype=torch.float64)
    assert torch.allclose(session.forward(LAYER, x), local.weights.layers[LAYER].forward(x, True), rtol=1e-12)
    session.close()


def _raw(url, message: dict, token: str | None = TOKEN, wait_ms: int = 10_000) -> dict | None:
    """A request made by hand, as an attacker would: the reply (errors included), or None if none came."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_client(sock, token)
    sock.connect(url)
    try:
        wire.send(sock, wire.encode({"id": 1, **message}))
        return wire.decode_header(sock.recv_multipart()[0]) if sock.poll(wait_ms) else None
    finally:
        sock.close()


def _raw_attach(url, fingerprint, token: str = TOKEN, **fields) -> dict:
    return _raw(url, {"op": "attach", "fingerprint": fingerprint, **fields}, token)


def test_a_tenant_cannot_shrink_its_shared_memory_under_the_executor(executor_process):
    """Attack: truncate one's own buffer and control block, then ring a call (the executor mapped them: a
    shrunk file killed it with SIGBUS, every tenant with it). The memory is sealed: truncation is refused."""
    url, local, process = executor_process
    reply = _raw_attach(url, local.fingerprint, name="attacker", shared={"nbytes": 1 << 16})
    link, fds = handoff.claim(reply["handoff"], bytes.fromhex(reply["ticket"]), 4, timeout=10)
    control, request, answer, buffer = fds
    for fd in (buffer, control):
        for size in (0, 1 << 30):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    assert os.fstat(control).st_size == CONTROL_BYTES
    # Scribbling is all that is left: a call claiming more rows than the buffer holds, and a header of garbage.
    bell = Doorbell(control, request, answer)
    bell.control[:4096] = os.urandom(4096)
    U64.pack_into(bell.control, ANSWERED_AT, 0)  # (so that this test can wait for the answer)
    seq = 1
    REQUEST.pack_into(bell.control, _slot(seq), 0, 0, 0, 1, 1 << 20, 64, len(LAYER))  # 1M x 64 float64 rows
    bell.control[_slot(seq) + REQUEST.size:_slot(seq) + REQUEST.size + len(LAYER)] = LAYER.encode()
    U64.pack_into(bell.control, _slot(seq), seq)
    os.write(bell.request_fd, b"\0")
    bell.wait_answered(seq, 10, lambda: None)
    assert process.poll() is None, "the executor died"
    _healthy_call(url, local)
    bell.close()
    link.close()


def test_a_tenant_cannot_name_files_or_claim_another_tenants_memory(executor_process, tmp_path):
    """Attack: attach naming another tenant's shared-memory files (the executor mapped any /dev/shm file a
    client named, and the victim's results were silently wrong). Now an attach names no file, the memory is in
    no directory at all, and only the tenant holding a ticket gets its descriptors."""
    url, local, process = executor_process
    victim = symbiosis.connect(url, token=TOKEN, timeout=10).attach(local.fingerprint, "victim")
    assert not glob.glob("/dev/shm/symbiosis-*")  # nothing to see with inotify, nothing to name
    secret = tmp_path / "secret"
    secret.write_bytes(b"\0" * 4096)
    for fields in ({"buffer": {"kind": "cpu", "path": str(secret), "nbytes": 4096}},
                   {"doorbell": {"control": str(secret), "request": "/dev/null", "reply": "/dev/null"}},
                   {"shared": {"kind": "cpu", "path": str(secret), "nbytes": 4096}}):
        reply = _raw_attach(url, local.fingerprint, name="attacker", **fields)
        if "shared" in fields:  # a path in it is ignored: the executor makes the memory
            assert reply["ok"] and reply["buffer_bytes"] >= 4096
        else:
            assert reply["error"] == "BadCall" and "an attach names no files" in reply["message"]
    guess = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    guess.connect(url.removeprefix("ipc://") + ".handoff")
    guess.sendall(os.urandom(handoff.TICKET_BYTES))  # a ticket it was not given
    guess.settimeout(10)
    assert socket.recv_fds(guess, 1, 4)[:2] == (b"", [])  # nothing handed over; the connection is closed
    guess.close()
    x = torch.randn(4, 64, dtype=torch.float64)
    assert torch.allclose(victim.forward(LAYER, x), local.weights.layers[LAYER].forward(x, True), rtol=1e-12)
    victim.close()
    assert process.poll() is None


def _rss_mib(process) -> float:
    return int(open(f"/proc/{process.pid}/status").read().split("VmRSS:")[1].split()[0]) / 1024


def _send_or_give_up(sock, frames) -> None:
    """Send, unless ZeroMQ has no peer to queue it for within 3 s (a handshake the executor refused leaves none,
    and a DEALER's send would block for ever): either way nothing may be read."""
    sock.setsockopt(zmq.SNDTIMEO, 3000)
    try:
        sock.send_multipart(frames, copy=False)
    except zmq.Again:
        pass


@pytest.mark.parametrize("executor_process", ["ipc", "tcp"], indirect=True)
def test_nothing_is_read_before_the_token_and_nothing_larger_than_a_call(executor_process):
    """Attack: a 256 MiB frame from a peer with no token (the executor read 512 MiB frames before checking
    it), and one from a tenant, larger than any call. The token is checked in ZeroMQ's handshake, before any
    message is read; a tenant's message is bounded by the largest call."""
    url, local, process = executor_process
    before = _rss_mib(process)
    for token in (None, "guess"):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        auth.secure_client(sock, token)
        sock.connect(url)
        _send_or_give_up(sock, [b'{"op": "stats"}', b"\0" * (256 << 20)])
        assert not sock.poll(3000)  # no answer: nothing was read
        sock.close()
    assert _rss_mib(process) - before < 64, "the executor read an unauthenticated peer's frame"
    with pytest.raises(symbiosis.Unauthorized, match="missing or wrong token"):
        symbiosis.connect(url, token="guess", timeout=5).stats()
    # This executor takes calls of 1,024 tokens at most (the fixture): 3.4 MiB a message, with the header.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_client(sock, TENANTS["mallory"])
    sock.connect(url)
    _send_or_give_up(sock, [b'{"op": "stats", "id": 1}', b"\0" * (64 << 20)])
    assert not sock.poll(3000)  # dropped by ZeroMQ as it arrived
    sock.close()
    assert _rss_mib(process) - before < 64
    _healthy_call(url, local)


def test_attaches_are_limited_per_tenant_and_in_all(executor_process):
    """Attack: attach hundreds of times (400 attaches used up the executor's descriptors and ZeroMQ aborted
    it). A tenant gets 8, all tenants together 12; the rest are refused with a reason, and the executor keeps
    serving (its descriptor limit is raised to the hard limit, too)."""
    url, local, process = executor_process
    replies = [_raw_attach(url, local.fingerprint, TENANTS["mallory"], name=f"m{i}") for i in range(400)]
    assert sum(r["ok"] for r in replies) == 8
    refused = [r for r in replies if not r["ok"]]
    assert {r["error"] for r in refused} == {"Unauthorized"}
    assert "'mallory' has 8 clients attached" in refused[0]["message"]
    alice = [_raw_attach(url, local.fingerprint, TENANTS["alice"], name=f"a{i}") for i in range(8)]
    assert sum(r["ok"] for r in alice) == 4 and "serves 12 clients at most" in alice[-1]["message"]
    limit = int(open(f"/proc/{process.pid}/limits").read().split("Max open files")[1].split()[0])
    assert limit >= min(1 << 16, int(open("/proc/self/limits").read().split("Max open files")[1].split()[1]))
    assert process.poll() is None


def test_a_request_id_nested_deep_is_refused_and_a_refused_attach_keeps_no_descriptor(executor_process):
    """Attacks: a request whose id is a list nested ~1,000 deep (echoing it in the reply overflowed the stack,
    twice, and the second escaped the server's loop: every client dropped); and attaches with shared memory that the
    data plane then refuses (each left the four descriptors made for the client open: ~500 of them and ZeroMQ
    aborted the executor)."""
    url, local, process = executor_process
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.secure_client(sock, TENANTS["mallory"])
    sock.connect(url)
    try:
        for depth in range(600, 1100, 3):  # (where reading stops and echoing would fail depends on the stack)
            sock.send(b'{"op": "describe", "id": ' + b"[" * depth + b"]" * depth + b"}")
            assert sock.poll(10_000), depth
            reply = wire.decode_header(sock.recv_multipart()[0])
            assert not reply["ok"] and reply["id"] is None, depth
            assert "its id must be" in reply["message"] or "not JSON that can be read" in reply["message"]
    finally:
        sock.close()
    descriptors = len(os.listdir(f"/proc/{process.pid}/fd"))
    for _ in range(40):
        refused = _raw_attach(url, local.fingerprint, TENANTS["mallory"], shared={"nbytes": 4096},
                              collective={"backend": "mpi"})
        assert not refused["ok"]
    assert len(os.listdir(f"/proc/{process.pid}/fd")) < descriptors + 20
    _healthy_call(url, local)
    assert process.poll() is None


def test_idle_handoff_connections_are_capped_and_a_client_writing_to_its_link_is_detached(executor_process):
    """Attacks on `ipc://`'s handoff socket: thousands of connections that never present a ticket (each was held for
    the ticket's 10 s: the descriptor table filled and ZeroMQ aborted the executor), and a client that keeps writing
    into its handoff connection after the handoff (read a byte a pass: the I/O thread polled hot)."""
    import socket as sockets

    url, local, process = executor_process
    handoff_path = url.removeprefix("ipc://") + ".handoff"
    descriptors = len(os.listdir(f"/proc/{process.pid}/fd"))
    idle = []
    for _ in range(600):
        connection = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
        try:
            connection.connect(handoff_path)
        except OSError:  # (the listen backlog full for a moment)
            connection.close()
            continue
        idle.append(connection)
    time.sleep(1)
    assert len(os.listdir(f"/proc/{process.pid}/fd")) < descriptors + 300  # 256 held at most
    _healthy_call(url, local)
    for connection in idle:
        connection.close()

    spammer = symbiosis.connect(url, token=TENANTS["mallory"], timeout=10).attach(local.fingerprint, "spammer")
    spammer.forward(LAYER, torch.randn(2, 64, dtype=torch.float64))
    spammer.link.send(b"junk" * 1000)
    deadline = time.monotonic() + 10
    with pytest.raises(symbiosis.errors.SymbiosisError):
        while time.monotonic() < deadline:  # detached: its calls fail from then on
            spammer.forward(LAYER, torch.randn(2, 64, dtype=torch.float64))
            time.sleep(0.05)
    _healthy_call(url, local)
    assert process.poll() is None


def test_a_tenant_can_neither_use_nor_keep_alive_nor_watch_another_tenants_clients(executor_process):
    """Attack: heartbeats and pings needed no token, so anyone who knew a client id (and --stats listed them all,
    with per-layer token counts) could keep a dead client attached for ever, slowing every tenant that waits
    for it. Now every message is its tenant's (the handshake), a client id is its tenant's alone, and a tenant's
    --stats shows its own clients only; the admin sees everything."""
    url, local, process = executor_process
    victim = symbiosis.connect(url, token=TENANTS["alice"], timeout=10).attach(local.fingerprint, "victim")
    x = torch.randn(2, 64, dtype=torch.float64)
    victim.forward(LAYER, x)
    for op in ("heartbeat", "ping", "fetch", "detach"):
        reply = _raw(url, {"op": op, "client": victim.client_id, "layer": LAYER}, TENANTS["mallory"], wait_ms=3000)
        assert reply is None or (reply["error"] == "UnknownClient" and "not attached" in reply["message"]), (op, reply)
    mine = symbiosis.connect(url, token=TENANTS["mallory"], timeout=10)
    session = mine.attach(local.fingerprint, "mallory")
    stats = mine.stats()
    assert stats["attached_clients"] == [session.client_id] and "per_layer" not in stats and "overall" not in stats
    everything = symbiosis.connect(url, token=TOKEN, timeout=10).stats()
    assert {victim.client_id, session.client_id} <= set(everything["attached_clients"])
    assert everything["per_client"][victim.client_id]["tokens"] == 2 and "per_layer" in everything
    assert torch.allclose(victim.forward(LAYER, x), local.weights.layers[LAYER].forward(x, True), rtol=1e-12)
    victim.close()
    session.close()


def test_a_flood_of_connections_fills_the_descriptor_table_without_killing_the_executor(checkpoints, tmp_path):
    """Attack: open connections until the executor has no descriptor left (ZeroMQ aborts a process whose
    descriptors run out at the wrong place). With the table full, the attached tenant's calls go on, exactly;
    once the flood ends (unauthenticated connections are closed after 5 s, or when the attacker goes) new
    tenants attach again."""
    model_dir, _ = checkpoints("llama")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    process = start_executor(model_dir, url, tmp_path, "opportunistic", 5, "cpu", "float64", TENANTS,
                             descriptors=400)
    local = symbiosis.Executor.from_pretrained(model_dir, dtype=torch.float64)
    try:
        alice = symbiosis.connect(url, token=TENANTS["alice"], timeout=10).attach(local.fingerprint, "alice")
        flood, in_use = [], 0
        while in_use < 398 and len(flood) < 1500:  # the kernel queues 100 at a time for the executor to accept
            flood += [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(50)]
            time.sleep(0.05)
            in_use = len(os.listdir(f"/proc/{process.pid}/fd"))
        assert in_use >= 398, "the flood did not fill the executor's descriptor table"
        x = torch.randn(5, 64, dtype=torch.float64)
        for _ in range(20):
            assert torch.allclose(alice.forward(LAYER, x), local.weights.layers[LAYER].forward(x, True), rtol=1e-12)
        assert process.poll() is None
        for connection in flood:
            connection.close()
        _healthy_call(url, local)
        alice.close()
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0, "the executor did not stop cleanly"
