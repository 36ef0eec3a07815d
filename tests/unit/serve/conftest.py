"""A real `symbiosis serve` application on loopback (uvicorn in a thread, over a float64 engine on the CPU), its
model (the demo's tiny Llama with its BPE tokenizer and chat template, random weights), adapters under an adapter
root, and API keys for three tenants."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import peft
import pytest

try:  # the HTTP library the installed `openai` client is built on
    import httpx2 as httpx
except ImportError:
    import httpx
import torch
import uvicorn

KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef",
        "admin": "admin-key-0123456789abcdef"}


def write_lora(model_dir: Path, out: Path, seed: int, targets: list[str], r: int = 4) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def served_files(tmp_path_factory):
    from symbiosis.demo import build_base_model

    root = tmp_path_factory.mktemp("serve")
    model = build_base_model(root / "base", pretrain_steps=0, log=lambda *_: None)
    adapters = root / "adapters"
    write_lora(model, adapters / "alice" / "poet", 1, ["q_proj", "v_proj", "down_proj"])
    write_lora(model, adapters / "alice" / "counter", 2, ["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"], r=8)
    write_lora(model, adapters / "bob" / "writer", 3, ["v_proj", "up_proj"])
    write_lora(model, adapters / "shared" / "extra", 4, ["q_proj"])
    keys = root / "keys.txt"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    return {"root": root, "model": model, "adapters": adapters, "keys": keys}


class Running:
    """The service and its server on a loopback port; `fronts`: its HTTP in a front (serve/front.py) that forwards
    to the app over the bridge (serve/bridge.py), both in threads here (`symbiosis serve --http-processes` runs
    fronts as processes)."""

    def __init__(self, service, port: int, fronts: bool = False):
        from symbiosis.serve.app import MAX_UPLOAD_BYTES, create_app

        self.service, self.port = service, port
        app, self.stop_host = create_app(service), None
        if fronts:
            from symbiosis.serve.bridge import AsgiHost
            from symbiosis.serve.front import Front

            url = f"ipc://{tempfile.mkdtemp(prefix='bridge-')}/bridge"
            _, self.stop_host = AsgiHost(app, url).serve_in_thread()  # bound before the front connects
            app = Front(url, MAX_UPLOAD_BYTES)
        self.url = f"http://127.0.0.1:{port}"
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def client(self, tenant: str = "alice", **options):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEYS[tenant], max_retries=0, **options)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        if self.stop_host is not None:
            self.stop_host()
        self.service.close()


def load(server, tenant: str, name: str, path: str):
    """POST /v1/load_lora_adapter as `tenant`; the HTTP response."""
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def start(files, state_dir: Path, fronts: bool = False, **options) -> Running:
    from symbiosis.serve.service import Service

    engine = {"kv_blocks": 256, "block_size": 16, "max_lora_rank": 8, "adapter_slots": 4, **options.pop("engine", {})}
    service = Service(files["model"], state_dir, files["keys"], adapter_root=files["adapters"], dtype=torch.float64,
                      served_name="tiny-llama", engine_options=engine, **options).start()
    return Running(service, 0, fronts)


def start_with_tinker_keys(files, tmp_path_factory, tinker_keys: dict, **options) -> Running:
    """`start`, the tenants' keys joined by these `tml-` keys (the tinker SDK's: a tenant may have several)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("".join(f"{t} {k}\n" for t, k in [*KEYS.items(), *tinker_keys.items()]))
    return start({**files, "keys": keys}, tmp_path_factory.mktemp("state"), **options)


def tinker_server(tinker_keys: dict, **options):
    """A module's fixture: the service of `start_with_tinker_keys(.., **options)`, stopped after the module."""
    @pytest.fixture(scope="module")
    def running_server(served_files, tmp_path_factory):
        running = start_with_tinker_keys(served_files, tmp_path_factory, tinker_keys, **options)
        yield running
        running.stop()
    return running_server


@pytest.fixture(scope="module")
def server(served_files, tmp_path_factory):
    running = start(served_files, tmp_path_factory.mktemp("state"))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def browser():
    """Debian's chromium, driven by Playwright with its executable path (no browser download)."""
    import shutil

    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "the browser tests need Debian's chromium (README: the test command installs it)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield launched
        launched.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: Path, state_dir: Path, keys: Path, *options: str, port: int | None = None):
    """`symbiosis serve` as a user starts it, in its own process, up (answering /health): (process, url)."""
    port = port or free_port()
    process = subprocess.Popen([sys.executable, "-m", "symbiosis.cli", "serve", "--model", str(model), "--state-dir",
                                str(state_dir), "--api-keys", str(keys), "--port", str(port), *options],
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the service did not come up"
        time.sleep(0.2)


def terminate(process) -> None:
    """Stop a launched service as a user does (SIGTERM), killing it if it does not end."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()


def wait_for_job(client, job_id: str, statuses, timeout: float = 300):
    """The fine-tuning job once its status is one of `statuses`."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert time.monotonic() < deadline, f"job {job_id} stayed {job.status}"
        time.sleep(0.2)
