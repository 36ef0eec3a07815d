"""`symbiosis serve` as users start it: a process on loopback, driven by the `openai` client; SIGHUP reloads
the keys (for the HTTP API and for split tenants attaching to its executor); SIGTERM stops it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import openai
import pytest
import torch

import symbiosis
from conftest import KEYS, launch, terminate


@pytest.mark.parametrize("fronts", [[], ["--http-processes", "2"]], ids=["one_process", "fronts"])
def test_serve_reloads_keys_on_sighup_and_shares_its_executor(served_files, tmp_path, fronts):
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    executor_url = f"ipc://{tmp_path / 'executor.sock'}"
    process, url = launch(served_files["model"], tmp_path / "state", keys, "--adapter-root", str(served_files["adapters"]),
                          "--executor-listen", executor_url, "--served-model-name", "tiny", "--no-training", *fronts)
    try:
        client = lambda tenant: openai.OpenAI(base_url=url + "/v1", api_key=KEYS[tenant], max_retries=0)  # noqa: E731
        served = client("bob").completions.create(model="tiny", prompt="the cat", max_tokens=4, temperature=0)
        assert served.usage.completion_tokens >= 1
        streamed = client("bob").completions.create(model="tiny", prompt="the cat", max_tokens=4, temperature=0,
                                                    stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == served.choices[0].text

        # a split tenant attaches to the same executor with its API key and computes with the same base
        executor = symbiosis.connect(executor_url, token=KEYS["alice"], timeout=30)
        model = symbiosis.from_pretrained(served_files["model"], executor, device="cpu", name="split")
        ids = torch.tensor([[1, 5, 9, 14]])
        from transformers import AutoModelForCausalLM
        plain = AutoModelForCausalLM.from_pretrained(served_files["model"])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
        model.symbiosis_session.close()

        keys.write_text(f"alice {KEYS['alice']}\nadmin {KEYS['admin']}\n")  # bob's key is withdrawn
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while True:
            try:
                client("bob").models.list()
            except openai.AuthenticationError:
                break
            assert time.monotonic() < deadline, "SIGHUP did not withdraw bob's key"
            time.sleep(0.1)
        assert client("alice").models.list().data[0].id == "tiny"
        with pytest.raises(symbiosis.errors.SymbiosisError):
            symbiosis.connect(executor_url, token=KEYS["bob"], timeout=3).stats()
    finally:
        terminate(process)
    assert process.returncode == 0, process.stderr.read()


def _children(pid: int) -> set[int]:
    return {int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"  # (a zombie has ended)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree from Linux's /proc")
def test_front_processes_end_with_the_service_even_when_it_is_killed(served_files, tmp_path):
    """--http-processes: the fronts stop with the service on SIGTERM, and on SIGKILL too (nothing left listening
    on the port, answering for a service that is gone)."""
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    for stop in (signal.SIGTERM, signal.SIGKILL):
        process, url = launch(served_files["model"], tmp_path / f"state-{stop.name}", keys, "--no-training",
                              "--http-processes", "2")
        fronts = _children(process.pid)
        assert len(fronts) == 2
        assert openai.OpenAI(base_url=url + "/v1", api_key=KEYS["alice"], max_retries=0).models.list().data
        process.send_signal(stop)
        process.wait(60)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in fronts):
            assert time.monotonic() < deadline, f"a front outlived the service ({stop.name}): " + ", ".join(
                Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in fronts if _alive(pid))
            time.sleep(0.1)


def test_a_front_whose_service_ended_before_it_started_ends_at_once():
    """A service killed while its front was still importing has left that front to init before it could ask to die
    with its parent: the front finds it has another parent than the service it was started for, and ends."""
    import os
    import socket
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as listener:
        ended = subprocess.run([sys.executable, "-m", "symbiosis.serve.front", "--fd", str(listener.fileno()),
                                "--service", "ipc:///nonexistent/bridge", "--max-body-bytes", "1024",
                                "--parent", str(os.getppid())], pass_fds=[listener.fileno()], capture_output=True, timeout=60)
    assert ended.returncode != 0
    assert b"ended before this front started" in ended.stderr
