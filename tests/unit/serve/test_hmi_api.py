"""HMI's lifecycle on the real service (uvicorn on loopback, float64 on the CPU): domains (further pre-training,
then a top-alpha% table over the root) and tenant models (an adapter on the upper layers over PLOT) through the
`symbiosis hmi` CLI and the HTTP API; generation equal to the library's; tenants kept apart; bad input refused
with its reason; a domain build stopped by a restart resumes to the very result an uninterrupted build gives."""

from __future__ import annotations

import io
import json
import math
import os
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import peft
import pytest
import torch
from transformers import AutoTokenizer

from conftest import KEYS, launch, start, terminate

try:
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT_TEXTS = [f"the cat sat on the mat number {i} and the dog ran in the park" for i in range(12)]
BIO_TEXTS = [f"the cell splits and the protein folds in sample {i}" for i in range(10)]
TASK_TEXTS = ["the cell splits fast", "the protein folds slowly"]
OPTIONS = {"steps": 3, "batch_size": 2, "window": 16, "learning_rate": 1e-3}


@pytest.fixture(scope="module")
def hmi_files(served_files, tmp_path_factory):
    from symbiosis.plot import LowerLayers, build_table

    root = tmp_path_factory.mktemp("hmi") / "plot-root"
    tokenizer = AutoTokenizer.from_pretrained(served_files["model"])
    build_table(LowerLayers(served_files["model"], 2, dtype=torch.float64), tokenizer(ROOT_TEXTS)["input_ids"], root,
                dtype="float64")
    return {**served_files, "plot_root": root}


def _start(files, state):
    return start(files, state, training={}, hmi={"root": files["plot_root"], "min_corpus_tokens": 40})


@pytest.fixture(scope="module")
def hmi_server(hmi_files, tmp_path_factory):
    running = _start(hmi_files, tmp_path_factory.mktemp("hmi-state"))
    yield running
    running.stop()


def _upload(server, tenant, lines, purpose="hmi") -> str:
    data = io.BytesIO("\n".join(json.dumps(line) for line in lines).encode())
    data.name = "data.jsonl"
    return server.client(tenant).files.create(file=data, purpose=purpose).id


def _api(server, tenant, method, path, body=None):
    return httpx.request(method, server.url + "/v1/hmi" + path, json=body, timeout=60,
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def _wait(server, tenant, path, timeout=300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        row = _api(server, tenant, "GET", path).json()
        if row["status"] in ("ready", "failed"):
            return row
        assert time.monotonic() < deadline, row
        time.sleep(0.1)


def _cli(server, tenant, *args, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in BIO_TEXTS))
    args = [a if a != "CORPUS" else str(corpus) for a in args]
    env = {**os.environ, "SYMBIOSIS_API_KEY": KEYS[tenant], "SYMBIOSIS_BASE_URL": server.url + "/v1"}
    return subprocess.run([sys.executable, "-m", "symbiosis.cli", "hmi", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_domains_and_models_through_the_cli_and_the_api(hmi_server, hmi_files, tmp_path):
    done = _cli(hmi_server, "alice", "domain", "create", "bio", "--corpus", "CORPUS", "--alpha", "50", "--steps", "3",
                "--follow", "--interval", "0.1", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "bio" in done.stdout and "ready" in done.stdout
    bio = _api(hmi_server, "alice", "GET", "/domains/bio").json()
    tokenizer = AutoTokenizer.from_pretrained(hmi_files["model"])
    ids = tokenizer(BIO_TEXTS)["input_ids"]
    distinct = len({tuple(s[i:i + 3]) for s in ids for i in range(len(s) - 2)})
    assert bio["status"] == "ready" and bio["entries"]["3"] == math.ceil(distinct * 0.5) and bio["table_bytes"] > 0
    again = _cli(hmi_server, "alice", "domain", "update", "bio", "--corpus", "CORPUS", "--follow", "--interval", "0.1",
                 tmp_path=tmp_path)
    assert again.returncode == 0, again.stderr
    assert [v["version"] for v in _api(hmi_server, "alice", "GET", "/domains/bio").json()["versions"]] == [2, 1]

    assert _api(hmi_server, "bob", "GET", "/domains/bio").status_code == 404  # alice's alone
    task = _upload(hmi_server, "alice", [{"text": t} for t in TASK_TEXTS])
    refused = _api(hmi_server, "bob", "POST", "/models", {"name": "m", "domain": "bio", "training_file": task})
    assert refused.status_code == 404  # neither alice's domain nor alice's file
    made = _api(hmi_server, "alice", "POST", "/models", {"name": "triage", "domain": "bio", "training_file": task,
                                                         "steps": 4, "learning_rate": 1e-2, "rank": 4})
    assert made.status_code == 200, made.text
    model = _wait(hmi_server, "alice", "/models/triage")
    assert model["status"] == "ready", model["error"]
    assert model["domain"] == {"name": "bio", "version": 2}
    answer = _api(hmi_server, "alice", "POST", "/models/triage/generate", {"prompt": "the cell", "max_tokens": 5})
    assert answer.status_code == 200, answer.text

    # the library's answer: PLOT of (root, bio v2) and the adapter on plain transformers' upper layers
    from symbiosis.plot import Plot, PlotModel, PlotTable, UpperModel

    state = hmi_server.service.state.directory / "hmi"
    upper = UpperModel(hmi_files["model"], 2, dtype=torch.float64)
    upper.model = peft.PeftModel.from_pretrained(upper.model, state / "models" / model["id"] / "adapter")
    bio2 = PlotTable.open(state / "domains" / _api(hmi_server, "alice", "GET", "/domains/bio").json()["id"] / "table")
    expected = PlotModel(upper, Plot(PlotTable.open(hmi_files["plot_root"]), bio2)).generate(
        tokenizer("the cell")["input_ids"], 5)
    assert answer.json()["tokens"] == expected

    # generations that wait together run as one batch, each with its own tokens (those it gets alone)
    prompts = ["the cell", "a protein binds", "the gene is expressed in", "cells"]
    alone = {p: _api(hmi_server, "alice", "POST", "/models/triage/generate", {"prompt": p, "max_tokens": 4}).json()
             for p in prompts}
    hmi = hmi_server.service.hmi
    run_batch, gate = hmi._generator.work, threading.Event()
    hmi._generator.work = lambda: (gate.wait(60), run_batch())
    try:
        with ThreadPoolExecutor(2 * len(prompts)) as pool:
            answers = [pool.submit(_api, hmi_server, "alice", "POST", "/models/triage/generate",
                                   {"prompt": p, "max_tokens": 4}) for p in prompts * 2]
            deadline = time.monotonic() + 60
            while len(hmi._waiting) < len(answers) and time.monotonic() < deadline:
                time.sleep(0.01)
            gate.set()
            assert [a.result().json()["tokens"] for a in answers] == [alone[p]["tokens"] for p in prompts * 2]
    finally:
        hmi._generator.work = run_batch
    metrics = httpx.get(hmi_server.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['admin']}"}).text
    sizes = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
             if line.startswith("symbiosis:hmi_generation_batch_size_")}
    assert sizes['symbiosis:hmi_generation_batch_size_bucket{le="8.0"}'] - \
        sizes['symbiosis:hmi_generation_batch_size_bucket{le="4.0"}'] == 1  # the 8 waiting ones, one batch
    assert _api(hmi_server, "bob", "POST", "/models/triage/generate", {"prompt": "x"}).status_code == 404

    # waiting generations hold no worker thread: more of them than the pool has threads (40), and another tenant's
    # plain route (one that runs on that pool) still answers at once
    hmi._generator.work = lambda: (gate.wait(60), run_batch())
    gate.clear()
    try:
        with ThreadPoolExecutor(48) as pool:
            answers = [pool.submit(_api, hmi_server, "alice", "POST", "/models/triage/generate",
                                   {"prompt": "cells", "max_tokens": 1}) for _ in range(48)]
            deadline = time.monotonic() + 60
            while len(hmi._waiting) < len(answers) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(hmi._waiting) == len(answers)
            models = httpx.get(hmi_server.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['bob']}"},
                               timeout=10)
            assert models.status_code == 200
            gate.set()
            assert all(a.result().status_code == 200 for a in answers)
    finally:
        gate.set()
        hmi._generator.work = run_batch

    assert _cli(hmi_server, "alice", "domain", "delete", "bio", tmp_path=tmp_path).returncode == 0
    orphan = _api(hmi_server, "alice", "POST", "/models/triage/generate", {"prompt": "the cell"})
    assert orphan.status_code == 400 and "deleted" in orphan.json()["error"]["message"]
    assert _api(hmi_server, "alice", "GET", "/models/triage").json()["domain"] == "deleted"
    assert _cli(hmi_server, "alice", "model", "delete", "triage", tmp_path=tmp_path).returncode == 0
    assert not (state / "models" / model["id"]).exists()


def test_tenants_take_turns_at_the_long_steps(hmi_server, monkeypatch):
    """One worker runs the long steps: a tenant's model of 100,000 steps held another's one-step model queued until
    it ended. Now a step that has had its turn (SLICE_S, short here) while another tenant's waits saves a checkpoint
    and queues again behind it."""
    import symbiosis.serve.hmi.service as hmi_service

    monkeypatch.setattr(hmi_service, "SLICE_S", 0.2)
    texts = [{"text": t} for t in TASK_TEXTS]
    options = {"rank": 2, "learning_rate": 1e-3, "batch_size": 1}
    made = _api(hmi_server, "alice", "POST", "/models", {"name": "endless", "training_file": _upload(
        hmi_server, "alice", texts), "steps": 100_000, **options})
    assert made.status_code == 200, made.text
    deadline = time.monotonic() + 60
    # under way, a step done (on a loaded machine a first turn spent setting up could end before its first step)
    while not _api(hmi_server, "alice", "GET", "/models/endless").json()["progress"]["done"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    made = _api(hmi_server, "bob", "POST", "/models", {"name": "quick", "training_file": _upload(
        hmi_server, "bob", texts), "steps": 1, **options})
    assert made.status_code == 200, made.text
    assert _wait(hmi_server, "bob", "/models/quick", timeout=60)["status"] == "ready"
    endless = _api(hmi_server, "alice", "GET", "/models/endless").json()
    assert endless["status"] in ("running", "queued") and endless["progress"]["done"] > 0, endless
    assert _api(hmi_server, "alice", "DELETE", "/models/endless").status_code == 200
    assert _api(hmi_server, "bob", "DELETE", "/models/quick").status_code == 200


def test_bad_input_is_refused_with_its_reason(hmi_server):
    small = _upload(hmi_server, "bob", [{"text": "too few words"}])
    answer = _api(hmi_server, "bob", "POST", "/domains", {"name": "tiny", "corpus_file": small})
    assert answer.status_code == 400 and "a domain is built from at least 40" in answer.json()["error"]["message"]
    chat = _upload(hmi_server, "bob", [{"prompt": "a", "completion": "b"}], purpose="fine-tune")
    answer = _api(hmi_server, "bob", "POST", "/domains", {"name": "chat", "corpus_file": chat})
    assert answer.status_code == 400 and "uploaded for 'fine-tune'" in answer.json()["error"]["message"]
    corpus = _upload(hmi_server, "bob", [{"text": t} for t in BIO_TEXTS])
    for body, field in (({"name": "../up", "corpus_file": corpus}, "name"),
                        ({"name": "a", "corpus_file": corpus, "alpha": 150}, "alpha"),
                        ({"name": "a", "corpus_file": corpus, "steps": "many"}, "steps"),
                        ({"name": "..", "corpus_file": corpus}, "name")):  # a URL folds ".." away: unreachable
        answer = _api(hmi_server, "bob", "POST", "/domains", body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
    with pytest.raises(openai.BadRequestError, match="text"):
        _upload(hmi_server, "bob", [{"txt": "no text field"}])
    assert _api(hmi_server, "bob", "POST", "/models", {"name": "m", "domain": "nowhere",
                                                       "training_file": corpus}).status_code == 404
    assert _api(hmi_server, "bob", "POST", "/models/nothing/generate", {"prompt": "x"}).status_code == 404
    answer = _api(hmi_server, "bob", "POST", "/models", {"name": "m", "domain": "nowhere", "domain_version": True,
                                                         "training_file": corpus})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "domain_version", answer.text
    # a line past the context: a step's work and memory grow with it (52,000 tokens took ~100 s a step)
    long_line = _upload(hmi_server, "bob", [{"text": "the cell splits fast " * 200}])
    answer = _api(hmi_server, "bob", "POST", "/models", {"name": "long", "training_file": long_line})
    assert answer.status_code == 400 and "past the model's context" in answer.json()["error"]["message"], answer.text
    # a domain's next version starts from the one before: not while that one is still queued or running
    assert _api(hmi_server, "bob", "POST", "/domains", {"name": "growing", "corpus_file": corpus, "steps": 100_000,
                                                       "batch_size": 1}).status_code == 200
    answer = _api(hmi_server, "bob", "POST", "/domains/growing/versions", {"corpus_file": corpus, "steps": 1})
    assert answer.status_code == 409, answer.text
    assert _api(hmi_server, "bob", "DELETE", "/domains/growing").status_code == 200


def test_a_tenants_domains_and_models_are_bounded_in_bytes_and_versions(hmi_server):
    from symbiosis.serve.hmi.store import MODELS_TABLE

    hmi = hmi_server.service.hmi
    corpus = _upload(hmi_server, "bob", [{"text": t} for t in BIO_TEXTS])
    bounds = hmi.max_table_bytes, hmi.max_domain_versions, hmi.max_model_versions
    try:
        hmi.max_table_bytes = 1000  # the smallest domain table here is tens of kB
        answer = _api(hmi_server, "bob", "POST", "/domains", {"name": "too-big", "corpus_file": corpus, **OPTIONS})
        assert answer.status_code == 200, answer.text
        row = _wait(hmi_server, "bob", "/domains/too-big")
        assert row["status"] == "failed" and "TableTooLarge" in row["error"] and "past the 1000 bytes" in row["error"]
        assert str(hmi_server.service.state.directory) not in row["error"]
        hmi.max_domain_versions = hmi.store.domain_usage("bob")[0]
        answer = _api(hmi_server, "bob", "POST", "/domains", {"name": "one-more", "corpus_file": corpus, **OPTIONS})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "quota_exceeded", answer.text
        # models: a new one and a new version of one alike
        hmi.max_model_versions = hmi.store.count(MODELS_TABLE, "bob") + 1
        made = _api(hmi_server, "bob", "POST", "/models", {"name": "bounded", "training_file": corpus, "steps": 1})
        assert made.status_code == 200, made.text
        assert _wait(hmi_server, "bob", "/models/bounded", timeout=60)["status"] == "ready"
        for path, body in (("/models", {"name": "past", "training_file": corpus}),
                           ("/models/bounded/versions", {"training_file": corpus})):
            answer = _api(hmi_server, "bob", "POST", path, body)
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "quota_exceeded", answer.text
    finally:
        hmi.max_table_bytes, hmi.max_domain_versions, hmi.max_model_versions = bounds
    assert _api(hmi_server, "bob", "DELETE", "/models/bounded").status_code == 200
    assert _api(hmi_server, "bob", "DELETE", "/domains/too-big").status_code == 200


def test_a_domain_build_stopped_by_a_restart_resumes_to_the_uninterrupted_result(hmi_files, tmp_path):
    from safetensors.torch import load_file

    state = tmp_path / "state"
    first = _start(hmi_files, state)
    corpus = _upload(first, "alice", [{"text": t} for t in BIO_TEXTS])
    options = {**OPTIONS, "steps": 200, "alpha": 100}
    interrupted = _api(first, "alice", "POST", "/domains", {"name": "a", "corpus_file": corpus, **options}).json()
    deadline = time.monotonic() + 120
    while _api(first, "alice", "GET", "/domains/a").json()["progress"]["done"] < 25:  # past a checkpoint (every 20)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.stop()  # mid-way: the step stops where it is
    with sqlite3.connect(state / "symbiosis.db") as db:
        assert db.execute("SELECT status FROM hmi_domains").fetchall() == [("running",)]
    second = _start(hmi_files, state)
    try:
        resumed = _wait(second, "alice", "/domains/a")
        assert resumed["status"] == "ready", resumed["error"]
        _api(second, "alice", "POST", "/domains", {"name": "b", "corpus_file": corpus, **options})
        whole = _wait(second, "alice", "/domains/b")
        domains = state / "hmi" / "domains"
        a, b = (load_file(domains / row["id"] / "lower.safetensors") for row in (interrupted, whole))
        assert all(torch.equal(a[name], b[name]) for name in b)
        for length in (1, 2, 3):
            assert np.array_equal(np.load(domains / interrupted["id"] / "table" / f"values-{length}.npy"),
                                  np.load(domains / whole["id"] / "table" / f"values-{length}.npy"))
    finally:
        second.stop()


def test_the_serve_command_turns_hmi_on_with_plot_root(hmi_files, tmp_path):

    keys = tmp_path / "keys"
    keys.write_text(f"alice {KEYS['alice']}\n")
    process, url = launch(hmi_files["model"], tmp_path / "state", keys, "--plot-root", str(hmi_files["plot_root"]),
                          "--hmi-min-corpus-tokens", "40")
    try:
        answer = httpx.get(url + "/v1/hmi/domains", headers={"Authorization": f"Bearer {KEYS['alice']}"})
        assert answer.status_code == 200 and answer.json() == {"object": "list", "data": []}
    finally:
        terminate(process)
    process, url = launch(hmi_files["model"], tmp_path / "state2", keys)  # without it: no such routes
    try:
        assert httpx.get(url + "/v1/hmi/domains",
                         headers={"Authorization": f"Bearer {KEYS['alice']}"}).status_code == 404
    finally:
        terminate(process)


def test_a_batch_takes_the_tenants_in_turn():
    """A tenant with many generations waiting fills a batch only after every other tenant's next one."""
    from symbiosis.serve.hmi.service import _round_robin, _Waiting

    def waiting(tenant, i):
        return _Waiting({"tenant": tenant, "model_id": f"{tenant}-model"}, None, None), (tenant, i)
    arrivals = [waiting("flood", i) for i in range(5)] + [waiting("alice", 0), waiting("bob", 0), waiting("alice", 1)]
    order = {id(item): label for item, label in arrivals}
    assert [order[id(item)] for item in _round_robin([item for item, _ in arrivals])] == [
        ("flood", 0), ("alice", 0), ("bob", 0), ("flood", 1), ("alice", 1), ("flood", 2), ("flood", 3), ("flood", 4)]
