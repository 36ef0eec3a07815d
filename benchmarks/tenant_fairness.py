"""One tenant's flood against another tenant's single request, on the hosted engine: how long the single request
takes alone, behind the flood admitted by arrival (every request unnamed: what the engine did before it knew
owners), and behind it with owners taking turns (what `symbiosis serve` does: each request names its tenant).

    python benchmarks/tenant_fairness.py --model tiny --flood 1024 --tokens 100

The flood is `--flood` sequences of a 4-token prompt, `--tokens` sampled tokens each (what one tenant's 4 requests
of 32 prompts x n=8 make); the single request is a 2-token prompt and one token, submitted once the flood is queued.
Each line: `single_ms` (submit to its one token), `flood_s` (the flood's wall time), for `mode` alone / arrival /
turns.
"""

from __future__ import annotations

import argparse
import time

from common import checkpoint, device, dtype, emit
from symbiosis.engine import Engine, SamplingParams


def run(engine: Engine, flood: int, tokens: int, owners: tuple[str | None, str | None] | None) -> tuple[float, float]:
    """(the single request's milliseconds, the flood's seconds); `owners` None: the single request alone."""
    started = time.perf_counter()
    flooding = [] if owners is None else [
        engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True),
                      owner=owners[0]) for i in range(flood)]
    time.sleep(0.2)  # the flood is queued and running
    asked = time.perf_counter()
    engine.submit([5, 6], SamplingParams(max_tokens=1), owner=None if owners is None else owners[1]).result()
    single_ms = (time.perf_counter() - asked) * 1000
    for handle in flooding:
        handle.result()
    return single_ms, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--flood", type=int, default=1024, help="the flooding tenant's sequences")
    parser.add_argument("--tokens", type=int, default=100, help="tokens each of them samples")
    parser.add_argument("--max-running", type=int, default=64)
    args = parser.parse_args()
    engine = Engine.from_pretrained(checkpoint(args.model), device=device(), dtype=dtype(), block_size=16,
                                    kv_blocks=args.max_running * (-(-(4 + args.tokens) // 16) + 1) + 16,
                                    max_running=args.max_running)
    engine.start()
    try:
        run(engine, 8, 4, ("a", "b"))  # warm: the step shapes
        for mode, owners in (("alone", None), ("arrival", (None, None)), ("turns", ("a", "b"))):
            single_ms, flood_s = run(engine, args.flood, args.tokens, owners)
            emit(bench="tenant_fairness", model=args.model, mode=mode, flood=0 if owners is None else args.flood,
                 tokens=args.tokens, max_running=args.max_running, single_ms=round(single_ms, 1),
                 flood_s=round(flood_s, 2))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
