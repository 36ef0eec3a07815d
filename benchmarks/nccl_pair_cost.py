"""The host's cost of one `nccl://` pair's point-to-point calls, alone: rank 1 (GPU 1) sends a tensor and receives
one back, rank 0 (GPU 0) receives it and sends it back, over the two-rank group the transport makes
(`transport/collective.py: _group`). The seconds rank 1 spends inside `send` and `recv` (the host's launch of the
operation, not its transfer) and the round trip's wall time. A remote call makes one of each on both sides, so
their cost is paid ~4 times a call, ~500 times a Llama-3.2-1B step. Rank 1's figures are printed, for the
transport's setting (torch's NCCL flight recorder off) and for torch's default (on) in turn
(docs/PERFORMANCE.md section 14):

    python benchmarks/nccl_pair_cost.py
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

SHAPES = ((1024, 2048), (1024, 8192))  # a 1B model's hidden states, and its MLP's, at 1,024 tokens
ROUNDS, WARM_UP = 300, 20


def one_rank(rank: int, port: int, label: str) -> None:
    from symbiosis.transport.collective import _group

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    group = _group("nccl", store, rank, 60.0, device)
    peer, figures = 1 - rank, {}
    send_s = recv_s = started = 0.0  # (the warm-up's rounds are added too, then reset)
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        for i in range(ROUNDS + WARM_UP):
            if i == WARM_UP:
                torch.cuda.synchronize()
                started, send_s, recv_s = time.perf_counter(), 0.0, 0.0
            if rank == 1:  # the client (timed): send, then receive the answer; neither waits on the host
                t0 = time.perf_counter()
                sending = group.send([x], peer, 0)
                t1 = time.perf_counter()
                group.recv([y], peer, 0).wait()
                send_s, recv_s = send_s + t1 - t0, recv_s + time.perf_counter() - t1
                x = y * 1.0
            else:  # the executor: receive, then send it back
                group.recv([y], peer, 0).wait()
                sending = group.send([y * 1.0], peer, 0)
        torch.cuda.synchronize()
        figures[f"{rows}x{cols}"] = {"send_us": round(send_s / ROUNDS * 1e6, 1), "recv_us": round(recv_s / ROUNDS * 1e6, 1),
                                     "round_trip_us": round((time.perf_counter() - started) / ROUNDS * 1e6, 1)}
    del sending
    if rank == 1:
        print(json.dumps({"bench": "nccl_pair_cost", "label": label, **figures}), flush=True)
    group.abort()


# what each run sets in both ranks' environment: the transport's default, and torch's own (its flight recorder on)
SETTINGS = {"recorder_off": {}, "flight_recorder": {"TORCH_FR_BUFFER_SIZE": "2000"}}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank":
        one_rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        os._exit(0)  # (the group's threads are not joined at teardown)
    for label, setting in SETTINGS.items():
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        env = {**os.environ, **setting, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src") + os.pathsep +
               os.environ.get("PYTHONPATH", "")}
        ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(port), label], env=env)
                 for r in (0, 1)]
        for process in ranks:
            process.wait(timeout=120)


if __name__ == "__main__":
    main()
