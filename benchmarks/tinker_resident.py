"""The Tinker API's training models in memory (`symbiosis serve --resident-models`): the service's resident memory
after one tenant's `--models` LoRA models of rank `--rank` each train one step, for each budget of `--budgets`, each
in a fresh process (so that no budget's memory is another's).

    python benchmarks/tinker_resident.py --models 60 --rank 256 --budgets 64,4

The service runs in the process, on the tiny model (`common.checkpoint("tiny")`, float32 on the CPU), with the
official `tinker` SDK on loopback. Each line: `rss_before_gib` (the service started), `rss_after_gib` (every model
trained one step), `in_memory` (models the service holds when idle), `seconds` (the whole loop: reads back from disk
included).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import checkpoint, emit, with_tokenizer

TINKER_KEY = "tml-bench-0123456789abcdef"


def rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def measure(models: int, rank: int, budget: int) -> dict:
    """In this process: the service with `budget` resident models, `models` models trained a step each."""
    import torch
    import uvicorn

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    from symbiosis.serve.app import create_app
    from symbiosis.serve.service import Service

    workdir = Path(tempfile.mkdtemp(prefix="symbiosis-bench-tinker-"))
    (workdir / "keys").write_text(f"bench {TINKER_KEY}\n")
    (workdir / "adapters").mkdir()
    service = Service(with_tokenizer(checkpoint("tiny")), workdir / "state", workdir / "keys",
                      adapter_root=workdir / "adapters", dtype=torch.float32, served_name="tiny",
                      training={"resident_models": budget}).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=TINKER_KEY)
    before, started, datum = rss_gib(), time.perf_counter(), None
    for seed in range(models):
        training = client.create_lora_training_client(base_model="tiny", rank=rank, seed=seed).result()
        if datum is None:
            ids = list(range(1, 33))
            datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    result = {"bench": "tinker_resident", "models": models, "rank": rank, "resident_models": budget,
              "rss_before_gib": round(before, 2), "rss_after_gib": round(rss_gib(), 2),
              "in_memory": len(service.tinker.loras), "seconds": round(time.perf_counter() - started, 1)}
    client.close("success")
    server.should_exit = True
    service.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=60)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--budgets", default="64,4", help="resident-model budgets, comma-separated, one process each")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child's budget: print its result
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.models, args.rank, args.one)), flush=True)
        return
    for budget in (int(b) for b in args.budgets.split(",")):
        child = subprocess.run([sys.executable, __file__, "--models", str(args.models), "--rank", str(args.rank),
                                "--one", str(budget)], capture_output=True, text=True, check=True)
        result = json.loads(child.stdout.strip().splitlines()[-1])
        result.pop("bench")
        emit(bench="tinker_resident", **result)


if __name__ == "__main__":
    main()
