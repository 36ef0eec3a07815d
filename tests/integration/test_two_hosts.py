"""Two hosts as two network namespaces of this machine, joined by a veth pair: a sharded executor spanning both
(torchrun, one node each, gloo), and a client on the second host attached over tcp:// to rank 0 on the first,
getting exactly the logits of an executor in its own process. Skipped where namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from helpers import TOKEN, ExecutorLog

HOSTS = {"a": "10.77.0.1", "b": "10.77.0.2"}


@pytest.fixture()
def two_hosts():
    tag = f"sym{os.getpid() % 100000}"
    names = {side: f"{tag}{side}" for side in HOSTS}
    links = {side: f"v{tag}{side}" for side in HOSTS}
    made = []
    try:
        for side, name in names.items():
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
            made.append(name)
        subprocess.run(["ip", "link", "add", links["a"], "type", "veth", "peer", "name", links["b"]], check=True,
                       capture_output=True)
        for side, name in names.items():
            for command in (["ip", "link", "set", links[side], "netns", name],
                            ["ip", "-n", name, "addr", "add", f"{HOSTS[side]}/24", "dev", links[side]],
                            ["ip", "-n", name, "link", "set", links[side], "up"],
                            ["ip", "-n", name, "link", "set", "lo", "up"],
                            ["ip", "netns", "exec", name, sys.executable, "-c", "pass"]):
                subprocess.run(command, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"no network namespaces here: {getattr(e, 'stderr', b'') or e}")
    yield names, links
    for name in made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _on(namespace: str, interface: str, *command: str, **options) -> subprocess.Popen:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": interface, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(["ip", "netns", "exec", namespace, *command], env=env, **options)


CLIENT = textwrap.dedent("""
    import sys, torch, symbiosis
    sys.path.insert(0, {tests!r})
    from helpers import batch
    path, url, token = sys.argv[1:4]
    split = symbiosis.from_pretrained(path, symbiosis.connect(url, token=token, timeout=60), dtype=torch.float64)
    local = symbiosis.from_pretrained(path, symbiosis.Executor.from_pretrained(path, dtype=torch.float64),
                                      dtype=torch.float64)
    inputs = {{k: v for k, v in batch("llama").items() if k != "labels"}}
    with torch.no_grad():
        ours, theirs = split(**inputs).logits, local(**inputs).logits
    # torchrun runs its ranks with one BLAS thread, this process with several: float64 rounding apart, at most
    error = (ours - theirs).abs().max().item()
    print("EQUAL" if error <= 1e-12 * theirs.abs().max().item() else f"DIFFERENT by {{error}}", flush=True)
    split.symbiosis_session.close()
""")


def test_a_sharded_executor_spans_two_hosts_and_a_client_on_the_second_attaches(two_hosts, checkpoints, tmp_path):
    names, links = two_hosts
    path, _ = checkpoints("llama")
    token_file = tmp_path / "tenants"
    token_file.write_text(f"admin {TOKEN}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://{HOSTS['a']}:{port + 1}"
    nodes = []
    for rank, side in enumerate(("a", "b")):
        nodes.append(_on(names[side], links[side], sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                         "--node-rank", str(rank), "--nproc-per-node", "1", "--master-addr", HOSTS["a"],
                         "--master-port", str(port), "-m", "symbiosis.cli", "executor", "--model", str(path),
                         "--listen", url, "--devices", "cpu,cpu", "--dtype", "float64",
                         "--token-file", str(token_file), text=True,
                         stderr=subprocess.PIPE if side == "a" else (tmp_path / f"node-{side}.log").open("w")))
    front = nodes[0]
    front.log = ExecutorLog.reading(front.stderr)
    try:
        front.log.wait_for(r"^\[executor\] serving .*sharded over cpu,cpu", timeout=120)
        script = tmp_path / "client.py"
        script.write_text(CLIENT.format(tests=str(os.path.dirname(os.path.dirname(__file__)))))
        client = _on(names["b"], links["b"], sys.executable, str(script), str(path), url, TOKEN,
                     stdout=subprocess.PIPE, text=True)
        out, _ = client.communicate(timeout=120)
        assert client.returncode == 0 and out.strip().endswith("EQUAL"), out
    finally:
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                node.kill()
