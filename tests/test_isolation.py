"""Tenants that attack the executor with a valid token, on a real executor process (CPU): each attack costs
the attacker at most an error on its own calls; the executor and the other tenants carry on, exactly."""

from __future__ import annotations

import glob
import json
import os
import socket

import pytest
import torch
import zmq

import symbiosis
from processes import TOKEN, start_executor
from symbiosis.transport import handoff, wire
from symbiosis.transport.doorbell import ANSWERED_AT, CONTROL_BYTES, REQUEST, U64, Doorbell, _slot

pytestmark = pytest.mark.slow
LAYER = "model.layers.0.mlp.up_proj"


@pytest.fixture
def executor_process(checkpoints, tmp_path):
    """(url, the executor's Executor-equivalent for expected values, its process)."""
    model_dir, _ = checkpoints("llama")
    url = f"ipc://{tmp_path}/executor.sock"
    process = start_executor(model_dir, url, tmp_path, client_timeout=5)
    local = symbiosis.Executor.from_pretrained(model_dir, dtype=torch.float64)
    yield url, local, process
    process.terminate()
    assert process.wait(timeout=30) == 0, "the executor did not stop cleanly"


def _healthy_call(url, local) -> None:
    """Another tenant's call, checked exactly: the attack did not touch it."""
    session = symbiosis.connect(url, token=TOKEN, timeout=10).attach(local.fingerprint, "bystander")
    x = torch.randn(5, 64, dtype=torch.float64)
    assert torch.equal(session.forward(LAYER, x), local.weights.layers[LAYER].forward(x, True))
    session.close()


def _raw_attach(url, fingerprint, **fields) -> dict:
    """An attach made by hand, as an attacker would: the reply (errors included)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        wire.send(sock, wire.encode({"op": "attach", "token": TOKEN, "fingerprint": fingerprint, "id": 1, **fields}))
        assert sock.poll(10_000), "no reply"
        return wire.decode_header(sock.recv_multipart()[0])
    finally:
        sock.close()


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
    seq = 1
    REQUEST.pack_into(bell.control, _slot(seq), 0, 0, 0, 1, 1 << 20, 64, len(LAYER))  # 1M x 64 float64 rows
    bell.control[_slot(seq) + REQUEST.size:_slot(seq) + REQUEST.size + len(LAYER)] = LAYER.encode()
    U64.pack_into(bell.control, _slot(seq), seq)
    os.write(bell.request_fd, b"\0")
    U64.pack_into(bell.control, ANSWERED_AT, 0)
    bell.seq = 0
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
    assert torch.equal(victim.forward(LAYER, x), local.weights.layers[LAYER].forward(x, True))
    victim.close()
    assert process.poll() is None
