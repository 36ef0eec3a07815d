"""The nccl:// transport, on the CPU as gloo:// (the same code, torch.distributed point-to-point with the gloo
backend): a client's numbers equal an in-process client's; a bad call is answered and the data plane stays in
step; a client that stops sending its tensors is detached alone; nccl:// is refused where it cannot run."""

from __future__ import annotations

import time

import pytest
import torch

import symbiosis
from helpers import StalledGroup, assert_same_step_on
from symbiosis.errors import BadCall, ExecutorOutOfMemory, ExecutorUnavailable, UnknownLayer
from symbiosis.transport.server import ExecutorServer


@pytest.fixture()
def served(checkpoints):
    path, auto_class = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    server = ExecutorServer(executor, "tcp://127.0.0.1:0", client_timeout=3.0).start()
    port = server.url.rsplit(":", 1)[1]
    yield path, auto_class, executor, f"gloo://127.0.0.1:{port}"
    server.stop()
    executor.close()


def test_a_gloo_client_trains_as_an_in_process_client(served):
    path, auto_class, executor, url = served
    assert_same_step_on(path, auto_class, [executor, symbiosis.connect(url, timeout=20)])


def test_a_bad_call_is_answered_and_the_data_plane_stays_in_step(served):
    path, _, executor, url = served
    session = symbiosis.connect(url, timeout=20).attach(executor.fingerprint, "probe")
    layer_id, spec = next(iter(executor.layer_specs.items()))
    x = torch.randn(3, spec.in_features, dtype=torch.float64)
    with pytest.raises(UnknownLayer):
        session.forward("model.layers.0.no_such_proj", x)
    with pytest.raises(BadCall):
        session.forward(layer_id, torch.randn(3, spec.in_features + 1, dtype=torch.float64))
    expected = executor.weights.layers[layer_id].forward(x)
    assert torch.equal(session.forward(layer_id, x), expected)  # later calls still get their own tensors
    session.close()


def test_a_data_plane_that_cannot_be_set_up_fails_the_attach_clearly(served, monkeypatch):
    """The executor's rank of a client's pair never joins (its thread died before it published its address): the
    client's attach raises ExecutorUnavailable naming the data plane, after its own timeout, and the executor keeps
    serving others."""
    from symbiosis.transport import collective

    path, _, executor, url = served
    serve = collective._ClientPlane._serve
    monkeypatch.setattr(collective._ClientPlane, "_serve", lambda self: None)
    started = time.monotonic()
    with pytest.raises(ExecutorUnavailable, match="gloo:// data plane could not be set up"):
        symbiosis.connect(url, timeout=2).attach(executor.fingerprint, "unlucky")
    assert time.monotonic() - started < 10
    monkeypatch.setattr(collective._ClientPlane, "_serve", serve)
    layer_id, spec = next(iter(executor.layer_specs.items()))
    x = torch.randn(2, spec.in_features, dtype=torch.float64)
    session = symbiosis.connect(url, timeout=20).attach(executor.fingerprint, "lucky")
    assert torch.equal(session.forward(layer_id, x), executor.weights.layers[layer_id].forward(x))
    session.close()


def test_a_pair_meets_over_the_executors_own_socket_and_its_store_is_bounded(checkpoints):
    """The ranks of a client's pair meet in a store of that client's own on the executor, reached only over the
    authenticated socket: the attach reply names no port (a TCPStore's listened on every interface, unauthenticated),
    another tenant cannot read or write a client's keys, and a client's own requests are bounded. Refused requests
    are answered with an error; the client's data plane goes on."""
    from symbiosis.errors import UnknownClient
    from symbiosis.transport import auth, rendezvous
    from symbiosis.transport.channel import Channel

    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    tokens = {"alice": "alice-token", "mallory": "mallory-token"}
    server = ExecutorServer(executor, "tcp://127.0.0.1:0", tenants=auth.Tenants(tokens), client_timeout=5.0).start()
    url = server.url.replace("tcp://", "gloo://")
    try:
        session = symbiosis.connect(url, token=tokens["alice"], timeout=20).attach(executor.fingerprint, "alice")
        assert session.rendezvous.requests > 0  # gloo's ranks published their addresses through it
        own = Channel(server.url, 5, tokens["alice"])
        other = Channel(server.url, 5, tokens["mallory"])

        def ask(channel, **fields):
            return channel.request({"op": "store", "client": session.client_id, **fields})[0]

        assert ask(own, action="check", keys=["pair/0/0"])["found"]  # the executor's rank's address, to its client
        with pytest.raises(UnknownClient):
            ask(other, action="get", key="pair/0/0")
        with pytest.raises(UnknownClient):
            ask(other, action="set", key="pair/0/1", value="00")
        assert ask(own, action="get", key="absent")["value"] is None  # answered at once, never waited for
        with pytest.raises(BadCall, match="unknown store action"):
            ask(own, action="list")
        with pytest.raises(BadCall, match="string of 1"):
            ask(own, action="get", key=["pair/0/0"])
        with pytest.raises(BadCall, match="hex of at most"):
            ask(own, action="set", key="big", value="00" * (rendezvous.MAX_VALUE_BYTES + 1))
        with pytest.raises(BadCall, match="not hex"):
            ask(own, action="set", key="odd", value="xyz")
        with pytest.raises(BadCall, match="amount"):
            ask(own, action="add", key="n", amount=True)
        for i in range(rendezvous.MAX_KEYS):
            try:
                ask(own, action="set", key=f"k{i}", value="ab" * 8)
            except BadCall as e:
                assert "at most" in str(e) and i > rendezvous.MAX_KEYS - 4  # the client's own keys count too
                break
        else:
            pytest.fail("a client's store took more keys than MAX_KEYS")
        plain = symbiosis.connect(server.url, token=tokens["alice"], timeout=20).attach(executor.fingerprint, "plain")
        with pytest.raises(BadCall, match="without a data plane"):
            own.request({"op": "store", "client": plain.client_id, "action": "check", "keys": ["x"]})
        layer_id, spec = next(iter(executor.layer_specs.items()))
        x = torch.randn(2, spec.in_features, dtype=torch.float64)
        assert torch.equal(session.forward(layer_id, x), executor.weights.layers[layer_id].forward(x))
        for thing in (session, plain, own, other):
            thing.close()
    finally:
        server.stop()
        executor.close()


@pytest.mark.parametrize("alone", [False, True])
def test_a_client_that_never_sends_its_tensor_is_detached_alone(served, alone):
    """Batched with another client's calls or (`alone`) run on its pair's thread, a call whose tensor never comes
    is given up after the client timeout."""
    path, _, executor, url = served
    remote = symbiosis.connect(url, timeout=20)
    stalled = remote.attach(executor.fingerprint, "stalled")
    healthy = None if alone else remote.attach(executor.fingerprint, "healthy")
    layer_id, spec = next(iter(executor.layer_specs.items()))
    x = torch.randn(2, spec.in_features, dtype=torch.float64)

    alive = stalled.group
    stalled.group = StalledGroup(alive)  # its process group stays up: the executor waits, then gives up
    started = time.monotonic()
    with pytest.raises(ExecutorUnavailable, match="data plane"):
        stalled.forward(layer_id, x)
    assert 2.5 < time.monotonic() - started < 15, "the executor waits the client timeout (3 s), no longer"
    del alive
    healthy = healthy or remote.attach(executor.fingerprint, "healthy")
    assert torch.equal(healthy.forward(layer_id, x), executor.weights.layers[layer_id].forward(x))
    assert stalled.client_id not in executor.clients
    healthy.close()


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_failed_call_is_raised_and_the_session_goes_on(served, monkeypatch, pipelined):
    """An error after the input arrived (out of memory) is answered, and zeros keep the data plane in step; the
    error is raised at the call (a session that waits for replies: a second one of its process and GPU), or at the
    next call or at synchronize (pipelined); the session then computes as before."""
    path, _, executor, url = served
    session = symbiosis.connect(url, timeout=20).attach(executor.fingerprint, "unlucky")
    session.pipelined = pipelined
    layer_id, spec = next(iter(executor.layer_specs.items()))
    x = torch.randn(3, spec.in_features, dtype=torch.float64)
    run = executor._run_batch  # (the client is alone: its calls run on its pair's thread, not the batcher's)

    def out_of_memory_once(*args, **kwargs):
        monkeypatch.setattr(executor, "_run_batch", run)
        raise ExecutorOutOfMemory("the executor ran out of memory for this call")

    monkeypatch.setattr(executor, "_run_batch", out_of_memory_once)
    with pytest.raises(ExecutorOutOfMemory, match="ran out of memory"):
        session.forward(layer_id, x)
        session.synchronize()
    assert torch.equal(session.forward(layer_id, x), executor.weights.layers[layer_id].forward(x))
    session.synchronize()
    session.close()


def test_a_call_the_executor_refuses_after_its_tensor_was_sent_detaches_the_client(served):
    """A client that skips its own check (protocol.py) has sent its tensor and posted its receive: the pair is out
    of step, so the executor detaches it, and it says so."""
    path, _, executor, url = served
    session = symbiosis.connect(url, timeout=20).attach(executor.fingerprint, "careless")
    with pytest.raises(ExecutorUnavailable, match="out of step"):
        session._call("forward", "no.such.layer", torch.randn(2, 8, dtype=torch.float64), 8, False)
        session.synchronize()
    assert session.client_id not in executor.clients
    with pytest.raises(ExecutorUnavailable, match="reconnect"):
        session.synchronize()


def test_nccl_is_refused_where_it_cannot_run(served):
    path, _, executor, url = served
    remote = symbiosis.connect(url.replace("gloo://", "nccl://"), timeout=20)
    with pytest.raises(ValueError, match="CUDA device"):
        remote.attach(executor.fingerprint, "cpu-client", "cpu")
    with pytest.raises(ValueError, match="unsupported executor URL"):
        symbiosis.connect("mpi://127.0.0.1:1")


def test_a_client_whose_process_group_is_gone_is_detached_at_once(served):
    """A client process that died mid-call: its end of the data plane closes, the executor's recv fails at once."""
    path, _, executor, url = served
    session = symbiosis.connect(url, timeout=20).attach(executor.fingerprint, "dying")
    layer_id, spec = next(iter(executor.layer_specs.items()))

    class Gone:
        def send(self, tensors, dst, tag):
            return self

        def recv(self, tensors, src, tag):
            return self

        def wait(self):
            raise RuntimeError("Connection closed by peer")  # as gloo's receive on a group whose peer is gone

    session.group = Gone()  # the real group is dropped: its connections close, as a dead process's do
    started = time.monotonic()
    with pytest.raises(ExecutorUnavailable, match="data plane"):
        session.forward(layer_id, torch.randn(2, spec.in_features, dtype=torch.float64))
    assert time.monotonic() - started < 2
    assert session.client_id not in executor.clients


NCCL_CLIENT = """
import sys, time, torch, symbiosis
sys.path.insert(0, {tests!r})
from helpers import StalledGroup, batch
path, url = sys.argv[1:3]
split = symbiosis.from_pretrained(path, symbiosis.connect(url, timeout=60), device="cuda:1", dtype=torch.float64)
local = symbiosis.from_pretrained(path, symbiosis.Executor.from_pretrained(path, device="cuda:1", dtype=torch.float64),
                                  device="cuda:1", dtype=torch.float64)
inputs = {{k: v.to("cuda:1") for k, v in batch("llama").items()}}

remote = symbiosis.connect(url, timeout=60)
stalled = remote.attach(split.symbiosis_session.fingerprint, "stalled", "cuda:1")
stalled.group = StalledGroup(stalled.group)
layer_id, spec = next(iter(stalled.layer_specs.items()))
started = time.monotonic()
try:
    stalled.forward(layer_id, torch.randn(2, spec.in_features, dtype=torch.float64, device="cuda:1"))
    stalled.synchronize(gpu=True)  # pipelined: the call returned; its error comes with its answer
    print("THE STALLED CLIENT WAS ANSWERED", flush=True)
except symbiosis.errors.ExecutorUnavailable:
    print(f"stalled client detached after {{time.monotonic() - started:.1f}} s", flush=True)
ours, theirs = split(**inputs), local(**inputs)  # the executor, and this client's own data plane, go on
ours.loss.backward()
error = (ours.logits - theirs.logits).abs().max().item()
print("EQUAL" if error <= 1e-12 * theirs.logits.abs().max().item() else f"DIFFERENT by {{error}}", flush=True)
# With LoRA on attention the norms and MLPs are frozen: each decoder layer's tail is one call each way over nccl://
from peft import LoraConfig, get_peft_model
adapted = []
for model in (split, local):
    torch.manual_seed(0)
    adapted.append(get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False)))
outs = [model(**inputs) for model in adapted]
for out in outs:
    out.loss.backward()
grads = [torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad]) for model in adapted]
error = max((outs[0].logits - outs[1].logits).abs().max().item() / outs[1].logits.abs().max().item(),
            (grads[0] - grads[1]).abs().max().item() / grads[1].abs().max().item())
print("ADAPTED EQUAL" if error <= 1e-12 else f"ADAPTED DIFFERENT by {{error}}", flush=True)
time.sleep(3)  # what the process groups ask of their rendezvous store while they live (NCCL's monitor)
print(f"rendezvous requests: {{split.symbiosis_session.rendezvous.requests}}", flush=True)
split.symbiosis_session.close()
# Alone now, a client's calls are chained on the executor's GPU (answered before the input came): one that never
# sends its tensor is found by the executor's watch on the GPU's arrival, and detached as well
alone = remote.attach(stalled.fingerprint, "stalled alone", "cuda:1")
alone.group = StalledGroup(alone.group)
started = time.monotonic()
try:
    alone.forward(layer_id, torch.randn(2, spec.in_features, dtype=torch.float64, device="cuda:1"))
    alone.synchronize(gpu=True)
    print("THE STALLED CLIENT ALONE WAS ANSWERED", flush=True)
except symbiosis.errors.ExecutorUnavailable:
    print(f"stalled client alone detached after {{time.monotonic() - started:.1f}} s", flush=True)
"""


@pytest.mark.gpu
def test_on_two_gpus_a_client_on_the_second_attaches_over_nccl(checkpoints, tmp_path):
    """The executor on cuda:0 (this process), a client process on cuda:1 over nccl://: GPU to GPU, the numbers
    of an executor on the client's own GPU (float64: rounding apart), LoRA-adapted too (decoder tails over nccl://),
    its calls chained on the executor's GPU once it is alone there. A second client of that process that sends a
    header and never its tensor is detached after the client timeout, its communicator aborted, not the process;
    as is a third, alone, whose calls were chained."""
    import os
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, device="cuda:0", dtype=torch.float64)
    server = ExecutorServer(executor, "tcp://127.0.0.1:0", client_timeout=5.0).start()
    script = tmp_path / "client.py"
    script.write_text(NCCL_CLIENT.format(tests=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    try:
        port = server.url.rsplit(":", 1)[1]
        out = subprocess.run([sys.executable, str(script), str(path), f"nccl://127.0.0.1:{port}"], capture_output=True,
                             text=True, timeout=300)
        lines = out.stdout.splitlines()
        assert out.returncode == 0 and "EQUAL" in lines and "ADAPTED EQUAL" in lines, out.stdout + out.stderr[-3000:]
        assert "stalled client detached after" in out.stdout, out.stdout
        assert "stalled client alone detached after" in out.stdout, out.stdout
        print(out.stdout)
        assert executor.stats_snapshot()["per_layer"]["model.layers.0:backward"]["calls"] == 1  # its tail
        assert not executor.clients
    finally:
        server.stop()
        executor.close()


def test_a_process_that_exits_without_closing_its_sessions_exits_cleanly(checkpoints, tmp_path):
    """Process groups left to the interpreter's teardown would abort it ("terminate called without an active
    exception"): the transport releases them at exit, also after the executor stopped first."""
    import subprocess
    import sys

    path, _ = checkpoints("llama")
    script = tmp_path / "exits.py"
    script.write_text(f"""
import torch, symbiosis
from symbiosis.transport.server import ExecutorServer
executor = symbiosis.Executor.from_pretrained({str(path)!r}, dtype=torch.float64)
server = ExecutorServer(executor, "tcp://127.0.0.1:0").start()
model = symbiosis.from_pretrained({str(path)!r}, symbiosis.connect(server.url.replace("tcp://", "gloo://"), timeout=20),
                                  dtype=torch.float64)
with torch.no_grad():
    model(torch.randint(0, 100, (1, 4)))
server.stop()
executor.close()
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_process_of_several_nccl_sessions_is_told_to_raise_the_gpus_hardware_queues(monkeypatch, caplog):
    """Below 32 hardware queues a GPU (CUDA's default is 8), several nccl:// sessions of one process hung: the
    second session warns, naming the setting; at 32 it says nothing."""
    from symbiosis.transport import collective

    warn = collective._warn_few_queues.__wrapped__  # (once a process otherwise)
    for setting, warned in ((None, True), ("8", True), ("32", False)):
        caplog.clear()
        if setting is None:
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", setting)
        with caplog.at_level("WARNING", logger="symbiosis"):
            warn()
        assert ("CUDA_DEVICE_MAX_CONNECTIONS=32" in caplog.text) is warned, setting
