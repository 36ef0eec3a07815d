"""N FSDP2 + PEFT jobs at once over this machine's GPUs (one `fsdp_job.py` torchrun each): the baseline of the
sharded executor with N adapters (paper Fig. 15-16). One JSON line per N: the jobs' aggregate tokens/s, and
whether they fit (a job that runs out of memory fails the line: that many do not fit).

    python benchmarks/fsdp_fleet.py --model llama-2-13b --jobs 1,2,4 --gpus 2
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from common import CONFIGS, checkpoint, emit, free_port

HERE = Path(__file__).resolve().parent


def _cause(stderr: str) -> str:
    """What a failed job died of: its last line that names an error (torchrun's summary, which ends its stderr,
    says only which rank exited)."""
    named = [line for line in stderr.splitlines() if re.search(r"(Error|Exception|out of memory)\b", line)]
    return (named[-1] if named else stderr[-400:]).strip()[:400]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-2-13b", choices=sorted(CONFIGS))
    parser.add_argument("--jobs", default="1,2,4")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--lora", default="lora3_r8_qkvo")
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    checkpoint(args.model)  # written once, before the jobs read it
    for n in [int(j) for j in args.jobs.split(",")]:
        runs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus),
                                  "--master-port", str(free_port()), str(HERE / "fsdp_job.py"), "--model", args.model,
                                  "--lora", args.lora, "--seq-len", str(args.seq_len), "--duration",
                                  str(args.duration)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(n)]
        results, failures = [], []
        for run in runs:
            out, err = run.communicate()
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            (results if run.returncode == 0 and lines else failures).append(lines[-1] if lines else _cause(err))
        line = dict(bench="fsdp_fleet", model=args.model, lora=args.lora, gpus=args.gpus, jobs=n, fits=not failures)
        if results and not failures:
            line.update(tokens_per_s=sum(r["tokens_per_s"] for r in results),
                        median_iter_s=max(r["median_iter_s"] for r in results),
                        peak_gib_per_gpu_per_job=max(r["peak_gib_per_gpu"] for r in results))
        else:
            line.update(failure=str(failures[0])[-400:] if failures else "no result")
        emit(**line)
        if failures:
            break  # more jobs fit no better


if __name__ == "__main__":
    main()
