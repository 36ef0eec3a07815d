"""Every transport gives the in-process results; bad messages get an error to that client only."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
import zmq
from peft import get_peft_model

import symbiosis
from symbiosis.errors import BadCall, UnknownLayer, Unauthorized
from symbiosis.transport import auth
from symbiosis.transport.server import ExecutorServer
from helpers import ExecutorLog, assert_close, batch
from matrix import peft_config

TOKEN = "correct horse battery staple"


def _url(scheme: str, tmp_path) -> str:
    return f"ipc://{tmp_path}/executor.sock" if scheme == "ipc" else "tcp://127.0.0.1:*"  # a free port


@pytest.fixture
def served(checkpoints, tmp_path):
    """(executor, url-maker) with servers stopped at teardown."""
    servers = []

    def serve(arch: str, scheme: str, client_timeout: float = 5, **kwargs):
        path, _ = checkpoints(arch)
        executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, **kwargs)
        servers.append(ExecutorServer(executor, _url(scheme, tmp_path), TOKEN,
                                      client_timeout=client_timeout).start())
        return executor, servers[-1].url

    yield serve
    for server in servers:
        server.stop()


def _train_once(model, arch):
    model.train()
    torch.manual_seed(11)  # same dropout masks for both models
    out = model(**batch(arch))
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _twins(checkpoints, arch: str, executor, url: str, method: str = "lora") -> list:
    """[a PEFT model on the in-process executor, its twin (same adapter init) on the served one at url]."""
    path, auto_class = checkpoints(arch)
    models = []
    for backend in (executor, symbiosis.connect(url, token=TOKEN, timeout=10)):
        torch.manual_seed(3)
        models.append(get_peft_model(symbiosis.from_pretrained(path, backend, auto_class=auto_class),
                                     peft_config(method, arch)))
    return models


@pytest.mark.parametrize("method", ["lora", "dora_rslora_dropout_bias"])  # DoRA asks for weight_norms too
@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_remote_equals_in_process(arch, scheme, method, served, checkpoints):
    models = _twins(checkpoints, arch, *served(arch, scheme), method)
    (local_out, local_grads), (remote_out, remote_grads) = (_train_once(m, arch) for m in models)
    assert_close(remote_out.logits, local_out.logits, "logits")
    assert_close(remote_out.loss, local_out.loss, "loss")
    for name, grad in local_grads.items():
        assert_close(remote_grads[name], grad, f"grad of {name}")
    models[1].base_model.model.symbiosis_session.close()


def test_remote_client_with_activation_checkpointing_equals_in_process_without(served, checkpoints):
    """Checkpointing makes executor calls inside backward (the recomputed forwards); through a transport too,
    the gradients are those of a client that keeps every activation."""
    models = _twins(checkpoints, "llama", *served("llama", "ipc"), method="rslora_all_linear")
    models[1].gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    session = models[1].base_model.model.symbiosis_session
    (local_out, local_grads), (remote_out, remote_grads) = (_train_once(m, "llama") for m in models)
    assert_close(remote_out.loss, local_out.loss, "loss")
    for name, grad in local_grads.items():
        assert_close(remote_grads[name], grad, f"grad of {name}")
    # Once the groups are learnt (the first pass): per decoder layer 4 grouped calls forward, 4 recomputed,
    # 4 backward; lm_head forward and backward.
    before = session.calls
    _train_once(models[1], "llama")
    assert session.calls - before == 2 * (4 + 4 + 4) + 2
    session.close()


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_heartbeats_keep_an_idle_client_attached(scheme, served, checkpoints):
    """A client that makes no calls for longer than the executor's client timeout (say, it is busy on its
    own side) stays attached as long as its heartbeat thread runs."""
    path, _ = checkpoints("llama")
    executor, url = served("llama", scheme, client_timeout=1.0)
    session = symbiosis.connect(url, token=TOKEN, timeout=10).attach(executor.fingerprint, "idle")
    time.sleep(2.5)
    layer = "model.layers.0.mlp.up_proj"
    x = torch.randn(3, executor.layer_specs[layer].in_features, dtype=torch.float64)
    assert_close(session.forward(layer, x), executor.weights.layers[layer].forward(x, True), "after idling")
    assert len(executor.clients) == 1
    session.close()


def test_a_session_nobody_holds_is_collected_and_the_executor_reaps_it(served, checkpoints):
    """Dropping a model without closing its session must not leak: the heartbeat thread holds the session
    weakly, so the session is collected, its heartbeats stop, and the executor detaches it after its client
    timeout (a session that heartbeats forever would stay attached forever)."""
    import gc
    import threading
    import weakref

    path, auto_class = checkpoints("llama")
    executor, url = served("llama", "ipc", client_timeout=1.0)
    earlier = set(threading.enumerate())
    model = get_peft_model(symbiosis.from_pretrained(path, symbiosis.connect(url, token=TOKEN, timeout=10),
                                                     auto_class=auto_class), peft_config("lora", "llama"))
    _train_once(model, "llama")
    session = weakref.ref(model.base_model.model.symbiosis_session)
    client_id = session().client_id
    heartbeat, = [t for t in threading.enumerate() if t.name == "symbiosis-heartbeat" and t not in earlier]
    assert len(executor.clients) == 1
    with ExecutorLog.listening() as said:
        del model
        gc.collect()
        assert session() is None
        heartbeat.join(timeout=10)
        assert not heartbeat.is_alive(), "a heartbeat thread outlived its session"
        said.wait_for(rf"detached {re.escape(client_id)}$", timeout=10)
    assert not executor.clients, "the executor still holds the dropped client"


def test_wrong_or_missing_token_is_refused(served, checkpoints):
    path, auto_class = checkpoints("llama")
    _, url = served("llama", "tcp")
    for token in (None, "guess"):
        with pytest.raises(Unauthorized, match="missing or wrong token"):
            symbiosis.from_pretrained(path, symbiosis.connect(url, token=token, timeout=5), auto_class=auto_class)
    with pytest.raises(Unauthorized):
        symbiosis.connect(url, token="guess", timeout=5).stats()


def test_remote_errors_name_the_problem(served, checkpoints):
    path, auto_class = checkpoints("llama")
    _, url = served("llama", "ipc", max_call_tokens=64)
    model = symbiosis.from_pretrained(path, symbiosis.connect(url, token=TOKEN, timeout=5), auto_class=auto_class)
    session = model.symbiosis_session
    with pytest.raises(UnknownLayer, match="no base layer 'nope'"):
        session.forward("nope", torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(BadCall, match=r"expects \[tokens, 64\], got \[2, 63\]"):
        session.forward("model.layers.0.self_attn.q_proj", torch.zeros(2, 63, dtype=torch.float64))
    with pytest.raises(BadCall, match="more than this executor's limit of 64"):
        session.forward("model.layers.0.self_attn.q_proj", torch.zeros(65, 64, dtype=torch.float64))
    ids = torch.randint(0, 128, (1, 5))
    assert model(ids).logits.shape == (1, 5, 128)  # still served


def _raw(url: str, *frames: bytes) -> dict:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    auth.secure_client(socket, TOKEN)
    socket.connect(url)
    socket.send_multipart(list(frames))
    assert socket.poll(5000), "no reply to a malformed message"
    reply = json.loads(socket.recv_multipart()[0])
    socket.close()
    return reply


def test_malformed_messages_get_an_error_and_the_executor_keeps_serving(served, checkpoints):
    path, auto_class = checkpoints("llama")
    executor, url = served("llama", "tcp")
    healthy = symbiosis.from_pretrained(path, symbiosis.connect(url, token=TOKEN, timeout=5), auto_class=auto_class)
    ids = torch.randint(0, 128, (2, 4))
    expected = healthy(ids).logits
    client = healthy.symbiosis_session.client_id
    cases = [
        ((b"{not json",), "BadCall", "not JSON"),
        ((b"[1, 2]",), "BadCall", "JSON object"),
        ((json.dumps({"op": "teleport", "client": client}).encode(),), "UnknownClient", "not attached"),
        ((json.dumps({"op": "forward", "client": "ghost", "layer": "lm_head"}).encode(),), "UnknownClient", "ghost"),
        ((json.dumps({"op": "forward", "client": [client], "layer": "lm_head"}).encode(),), "UnknownClient",
         "not attached"),  # an id that is no string (unhashable), not a server error
        ((b"[" * 100_000 + b"]" * 100_000,), "BadCall", "not JSON that can be read"),  # nested past the parser
        ((b'{"op": "ping", "id": ' + b"7" * 5000 + b"}",), "BadCall", "not JSON that can be read"),  # an int too long
        ((json.dumps({"op": "attach", "token": TOKEN, "fingerprint": "0" * 64}).encode(),), "FingerprintMismatch",
         "different checkpoint"),
        ((json.dumps({"op": "attach", "token": TOKEN, "fingerprint": executor.fingerprint,
                      "buffer": {"kind": "cpu", "path": "/etc/passwd", "nbytes": 10}}).encode(),), "BadCall",
         "an attach names no files"),
        ((json.dumps({"op": "attach", "token": TOKEN, "fingerprint": executor.fingerprint,
                      "shared": {"nbytes": 4096}}).encode(),), "BadCall", "this executor serves tcp://"),
    ]
    for frames, error, message in cases:
        reply = _raw(url, *frames)
        assert reply["ok"] is False and reply["error"] == error and message in reply["message"], reply
    assert torch.equal(healthy(ids).logits, expected)


def test_frames_that_do_not_match_their_description(served, checkpoints):
    """A tensor frame whose size disagrees with the declared shape, sent on an attached client's socket."""
    path, auto_class = checkpoints("llama")
    _, url = served("llama", "tcp")
    session = symbiosis.connect(url, token=TOKEN, timeout=5).attach(
        symbiosis.Executor.from_pretrained(path).fingerprint, "raw")
    header = {"op": "forward", "id": 999, "client": session.client_id, "layer": "model.layers.0.self_attn.q_proj",
              "tensor": {"dtype": "float64", "shape": [2, 64]}}
    session.channel.socket.send_multipart([json.dumps(header).encode(), b"\0" * 10])
    assert session.channel.socket.poll(5000)
    reply = json.loads(session.channel.socket.recv_multipart()[0])
    assert reply["error"] == "BadCall" and "10 bytes" in reply["message"]
    header.update(id=1000, tensor={"dtype": "complex128", "shape": [2, 64]})
    session.channel.socket.send_multipart([json.dumps(header).encode(), b"\0" * 10])
    assert session.channel.socket.poll(5000)
    assert "unsupported tensor dtype" in json.loads(session.channel.socket.recv_multipart()[0])["message"]
    # shapes that int() would round or coerce to ones the bytes fit, and negatives whose product does: refused
    for number, shape in enumerate(([2.9, 64], [True, 64], ["2", "64"], [-2, -64], [float("inf"), 64], [0] * 9)):
        header.update(id=1001 + number, tensor={"dtype": "float64", "shape": shape})
        session.channel.socket.send_multipart([json.dumps(header).encode(), b"\0" * (2 * 64 * 8)])
        assert session.channel.socket.poll(5000)
        reply = json.loads(session.channel.socket.recv_multipart()[0])
        assert reply["error"] == "BadCall" and "non-negative integers" in reply["message"], (shape, reply)
    session._request({"op": "detach"})  # e.g. the executor reaped it
    with pytest.raises(symbiosis.ExecutorUnavailable, match="no longer knows this client|closed this client's"):
        session.forward("model.layers.0.self_attn.q_proj", torch.zeros(2, 64))
    session.close()
    with pytest.raises(symbiosis.SymbiosisError, match="session is closed"):
        session.forward("model.layers.0.self_attn.q_proj", torch.zeros(2, 64))


def test_doorbell_requests_that_are_malformed_stale_or_orphaned(served, checkpoints):
    """The ipc:// call path: a malformed request gets an error in the reply block and the client keeps
    working; a wake-up without a new request is ignored; a bogus doorbell is refused at attach; a client the
    executor forgot learns so within about a second instead of waiting out its timeout."""
    from symbiosis.transport.ipc.doorbell import REQUEST, U64, _slot

    path, _ = checkpoints("llama")
    executor, url = served("llama", "ipc")
    session = symbiosis.connect(url, token=TOKEN, timeout=30).attach(executor.fingerprint, "raw")
    layer = "model.layers.0.self_attn.q_proj"
    x = torch.randn(2, 64, dtype=torch.float64)
    expected = executor.weights.layers[layer].forward(x, True)
    bell = session.doorbell

    seq = bell.seq + 1
    REQUEST.pack_into(bell.control, _slot(seq), 0, 99, 0, 0, 2, 64, 0)  # op code 99
    U64.pack_into(bell.control, _slot(seq), seq)
    bell.seq = seq
    os.write(bell.request_fd, b"\0")
    with pytest.raises(BadCall, match="malformed doorbell request"):
        bell.wait(seq, 5, session._still_attached)

    os.write(bell.request_fd, b"\0")  # a stale wake-up: same sequence number, nothing to answer
    assert_close(session.forward(layer, x), expected, "after a malformed and a stale request")
    with pytest.raises(BadCall, match="longer than"):
        bell.submit("forward", "x" * 5000, False, torch.float64, (2, 64), 5, session._still_attached)
    with pytest.raises(UnknownLayer, match="no base layer 'xxx"):
        session.forward("x" * 5000, x)  # refused before it is sent

    refused = _raw(url, json.dumps({"op": "attach", "token": TOKEN, "fingerprint": executor.fingerprint,
                                    "doorbell": {"control": "/etc/passwd"}}).encode())
    assert refused["error"] == "BadCall" and "an attach names no files" in refused["message"]
    assert len(executor.clients) == 1

    session._request({"op": "detach"})  # e.g. the executor reaped it, or restarted
    started = time.monotonic()
    with pytest.raises(symbiosis.ExecutorUnavailable, match="no longer knows this client|closed this client's"):
        session.forward(layer, x)
    assert time.monotonic() - started < 5
    session.close()


def test_doorbell_ring_runs_calls_in_order_and_reports_a_failure_at_a_later_call(served, checkpoints):
    """Calls queued without waiting for answers (as pipelined clients make them), over twice the ring's size:
    the executor runs them in order, and a call that fails is reported at a later call, once."""
    from symbiosis.transport.ipc.doorbell import SLOTS

    executor, url = served("llama", "ipc")
    session = symbiosis.connect(url, token=TOKEN, timeout=30).attach(executor.fingerprint, "ring")
    bell, layer = session.doorbell, "model.layers.0.self_attn.q_proj"
    weights = executor.weights.layers[layer]
    x = torch.randn(2, 64, dtype=torch.float64)
    session.buffer.view(torch.float64, [2, 64]).copy_(x)
    calls, failing, raised, made = 2 * SLOTS + 3, 5, [], 0
    for i in range(calls):  # each call reads the buffer and writes its output over it: q(q(...q(x)))
        try:
            bell.submit("forward", "nope" if i == failing else layer, False, torch.float64, (2, 64), 10,
                        session._still_attached)
            made += 1
        except UnknownLayer as error:  # an earlier call's error: this call is not made
            raised.append(str(error))
    try:
        bell.wait(bell.seq, 10, session._still_attached)
    except UnknownLayer as error:
        raised.append(str(error))
    assert raised == [f"an earlier call of this client (#{failing + 1}) failed: "
                      "this executor serves no base layer 'nope'"]
    for _ in range(made - 1):
        x = weights.forward(x, True)
    assert_close(session.buffer.view(torch.float64, [2, 64]), x, "after the ring went round twice")
    assert_close(session.forward(layer, x), weights.forward(x, True), "a call after them")
    session.close()


def test_doorbell_reports_the_failure_of_the_call_a_full_ring_waited_for_as_an_earlier_calls():
    """A call that finds the ring full waits for the oldest call; if that one failed, the error is reported
    as an earlier call's (this call is not made), not as the call's own."""
    from symbiosis.transport.ipc.doorbell import SLOTS, Doorbell

    executor, client_ends = Doorbell.pair()
    client = Doorbell(*client_ends)
    try:
        def answer_the_first_with_an_error():
            taken = executor.take_requests()
            assert [r.seq for r in taken] == list(range(1, SLOTS + 1))
            executor.answer(1, {"error": "UnknownLayer", "message": "this executor serves no base layer 'x'"})

        for _ in range(SLOTS):
            client.submit("forward", "x", False, torch.float32, (1, 4), 5, lambda: None)
        with pytest.raises(UnknownLayer, match=r"^an earlier call of this client \(#1\) failed: .* layer 'x'"):
            client.submit("forward", "x", False, torch.float32, (1, 4), 5, answer_the_first_with_an_error)
        assert client.seq == SLOTS  # the call was not made
    finally:
        executor.close()
        client.close()


def test_ipc_leaves_no_files_behind(served, checkpoints, tmp_path):
    """Shared memory is anonymous (memfd, handed over as descriptors): nothing is made in /dev/shm or any
    directory, also when the buffer grows; the socket files are this user's alone, and gone once it stops."""
    import glob
    import stat

    before = set(glob.glob("/dev/shm/*"))
    executor, url = served("llama", "ipc")
    socket_file = Path(url.removeprefix("ipc://"))
    for path in (socket_file, Path(f"{socket_file}.handoff")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    session = symbiosis.connect(url, token=TOKEN, timeout=10).attach(executor.fingerprint, "tidy")
    layer = "model.layers.0.mlp.up_proj"
    weights = executor.weights.layers[layer]
    for tokens in (3, 20_000):  # 20,000 x 128 float64 outgrow the initial 8 MiB buffer
        x = torch.randn(tokens, weights.spec.in_features, dtype=torch.float64)
        assert_close(session.forward(layer, x), weights.forward(x, True), f"{tokens} tokens")
        assert set(glob.glob("/dev/shm/*")) == before
    session.close()


def test_spinning_waits_give_the_same_results(served, checkpoints, monkeypatch):
    """The spin-then-sleep waits used on hosts with cores to spare (switched on here regardless of the
    core count): a fine-tuning step over ipc:// still equals the in-process one."""
    from symbiosis.transport import server
    from symbiosis.transport.ipc import doorbell

    monkeypatch.setattr(doorbell, "SPIN_S", 0.002)
    monkeypatch.setattr(server, "HOT_S", 0.002)
    models = _twins(checkpoints, "llama", *served("llama", "ipc"))
    (local_out, local_grads), (remote_out, remote_grads) = (_train_once(m, "llama") for m in models)
    assert_close(remote_out.logits, local_out.logits, "logits")
    for name, grad in local_grads.items():
        assert_close(remote_grads[name], grad, f"grad of {name}")
    models[1].base_model.model.symbiosis_session.close()


def test_a_client_that_takes_no_handoffs_is_detached_and_holds_no_one_up(served, checkpoints):
    """ipc://: a client asking for buffer after buffer and never taking their descriptors from its handoff
    connection filled it, and the executor's one I/O thread then blocked on the next, for every client."""
    executor, url = served("llama", "ipc")
    good = symbiosis.connect(url, token=TOKEN, timeout=5).attach(executor.fingerprint, "good")
    bad = symbiosis.connect(url, token=TOKEN, timeout=5).attach(executor.fingerprint, "bad")
    layer, x = "model.layers.0.self_attn.q_proj", torch.randn(2, 64, dtype=torch.float64)
    errors = []
    for number in range(2000):  # ~200 fit a connection's buffer on Linux
        bad.channel.socket.send_multipart([json.dumps({"op": "buffer", "id": 10_000 + number,
                                                       "client": bad.client_id, "nbytes": 4096}).encode()])
        assert bad.channel.socket.poll(5000), f"no reply to buffer request {number}: the I/O thread is stuck"
        reply = json.loads(bad.channel.socket.recv_multipart()[0])
        if not reply["ok"]:
            errors.append(reply)
            break
    assert errors and "does not take what the executor hands it" in errors[0]["message"], errors
    assert bad.client_id not in executor.clients
    assert_close(good.forward(layer, x), executor.weights.layers[layer].forward(x, True), "beside it")
    good.close()


def test_a_client_that_writes_over_unanswered_doorbell_calls_is_detached(served, checkpoints):
    """ipc://: the ring holds SLOTS calls; a client that wrote more without waiting for answers had every one of
    them queued in the executor, without bound."""
    from symbiosis.protocol import CALL_DTYPES, OPS
    from symbiosis.transport.ipc.doorbell import REQUEST, SLOTS, U64, _slot

    executor, url = served("llama", "ipc", policy="lockstep")  # (answers wait for the other client's calls)
    idle = symbiosis.connect(url, token=TOKEN, timeout=30).attach(executor.fingerprint, "idle")
    bad = symbiosis.connect(url, token=TOKEN, timeout=30).attach(executor.fingerprint, "bad")
    bell, layer, seq = bad.doorbell, b"model.layers.0.self_attn.q_proj", bad.doorbell.seq
    deadline = time.monotonic() + 30
    while bad.client_id in executor.clients:
        assert time.monotonic() < deadline, "the executor took call after call over unanswered ones"
        for _ in range(SLOTS):
            seq += 1
            at = _slot(seq)
            bell.control[at + REQUEST.size:at + REQUEST.size + len(layer)] = layer
            REQUEST.pack_into(bell.control, at, 0, OPS.index("forward"), 0, CALL_DTYPES.index(torch.float64), 2, 64,
                              len(layer))
            U64.pack_into(bell.control, at, seq)
        os.write(bell.request_fd, b"\0")
        while U64.unpack_from(bell.control, 0)[0] < seq and bad.client_id in executor.clients:
            assert time.monotonic() < deadline
            time.sleep(0.001)  # until the executor has taken them (not answered them)
    x = torch.randn(2, 64, dtype=torch.float64)
    assert_close(idle.forward(layer.decode(), x), executor.weights.layers[layer.decode()].forward(x, True), "beside it")
    idle.close()


def test_a_tenant_flooding_the_socket_does_not_keep_the_executor_from_others_calls(served, checkpoints):
    """Another process sends cheap requests as fast as it can on four connections and reads no reply: the
    executor's I/O thread read the socket until it was empty, which it never was, so no doorbell call was
    answered while the flood lasted."""
    import subprocess
    import sys

    executor, url = served("llama", "ipc", client_timeout=30)
    victim = symbiosis.connect(url, token=TOKEN, timeout=10).attach(executor.fingerprint, "victim")
    layer, x = "model.layers.0.self_attn.q_proj", torch.randn(2, 64, dtype=torch.float64)
    flood = f"""
import json, sys, time
import zmq
sys.path.insert(0, {str(Path(symbiosis.__file__).parents[1])!r})
from symbiosis.transport import auth
context, sockets = zmq.Context(), []
for _ in range(4):
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    auth.secure_client(socket, {TOKEN!r})
    socket.connect({url!r})
    sockets.append(socket)
message, end = json.dumps({{"op": "describe", "id": 1}}).encode(), time.monotonic() + 8
print("flooding", flush=True)
while time.monotonic() < end:
    for socket in sockets:
        socket.send(message)
"""
    flooder = subprocess.Popen([sys.executable, "-c", flood], stdout=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout.readline().strip() == "flooding"
        time.sleep(1)
        for _ in range(3):
            started = time.monotonic()
            assert_close(victim.forward(layer, x), executor.weights.layers[layer].forward(x, True), "in the flood")
            assert time.monotonic() - started < 5, "a call waited out the flood"
    finally:
        flooder.kill()
        flooder.wait()
    victim.close()
