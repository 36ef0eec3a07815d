"""`symbiosis hmi domain|model ...`: HMI's lifecycle on a running `symbiosis serve`, through its HTTP API; and
`symbiosis plot build`: a PLOT table built offline (the service's root table), resumable (run it again).

    symbiosis hmi domain create bio --corpus bio.jsonl --alpha 50 --follow      # lines of {"text": ...}
    symbiosis hmi domain update bio --corpus more-bio.jsonl --follow             # version 2, from version 1
    symbiosis hmi model create triage --domain bio --data tickets.jsonl --follow
    symbiosis hmi model generate triage --prompt "patient reports"
    symbiosis hmi domain delete bio
    symbiosis plot build --model ./llama --lower-layers 16 --corpus web.jsonl --out ./plot-root
"""

from __future__ import annotations

import json
import sys
import time

from symbiosis.serve.http_cli import add_connection, call, upload

COMMAND = "symbiosis hmi"
BAR = 30


def _line(row: dict) -> str:
    progress = row["progress"]
    stage = f"{progress['stage']} {progress['done']}/{progress['total']}" if progress["stage"] else ""
    return f"{row['name']:<20} v{row['version']:<3} {row['status']:<8} {stage}".rstrip()


def _follow(args, path: str) -> int:
    """Poll until the newest version is ready (0) or failed (1), drawing its progress."""
    while True:
        row = call(args, path, command=COMMAND)
        progress = row["progress"]
        if progress["stage"] and progress["total"]:
            done = min(BAR, round(BAR * progress["done"] / progress["total"]))
            print(f"\r{progress['stage']:<12} [{'#' * done}{'.' * (BAR - done)}] {progress['done']}/{progress['total']}",
                  end="", file=sys.stderr, flush=True)
        if row["status"] in ("ready", "failed"):
            print(file=sys.stderr)
            print(_line(row) + (f"  {row['error']}" if row["error"] else ""))
            return 0 if row["status"] == "ready" else 1
        time.sleep(args.interval)


def _options(args, keys) -> dict:
    return {key: getattr(args, key) for key in keys if getattr(args, key, None) is not None}


def domain_create(args) -> int:
    body = {"corpus_file": upload(args, args.corpus, "hmi", COMMAND),
            **_options(args, ("alpha", "steps", "learning_rate", "window"))}
    if args.action == "create":
        row = call(args, "/hmi/domains", "POST", {"name": args.name, **body}, COMMAND)
    else:
        row = call(args, f"/hmi/domains/{args.name}/versions", "POST", body, COMMAND)
    print(_line(row))
    return _follow(args, f"/hmi/domains/{args.name}") if args.follow else 0


def model_create(args) -> int:
    body = {"training_file": upload(args, args.data, "hmi", COMMAND), **_options(args, ("steps", "learning_rate",
                                                                                          "rank"))}
    if args.action == "create":
        row = call(args, "/hmi/models", "POST", {"name": args.name, "domain": args.domain, **body}, COMMAND)
    else:
        row = call(args, f"/hmi/models/{args.name}/versions", "POST", body, COMMAND)
    print(_line(row))
    return _follow(args, f"/hmi/models/{args.name}") if args.follow else 0


def listing(args) -> int:
    for row in call(args, f"/hmi/{args.kind}s", command=COMMAND)["data"]:
        print(_line(row))
    return 0


def show(args) -> int:
    print(json.dumps(call(args, f"/hmi/{args.kind}s/{args.name}", command=COMMAND), indent=2))
    return 0


def delete(args) -> int:
    answer = call(args, f"/hmi/{args.kind}s/{args.name}", "DELETE", command=COMMAND)
    print(f"deleted {args.kind} {answer['name']} ({answer['versions']} versions)")
    return 0


def generate(args) -> int:
    answer = call(args, f"/hmi/models/{args.name}/generate", "POST",
                  {"prompt": args.prompt, "max_tokens": args.max_tokens}, COMMAND)
    print(answer["text"])
    return 0


def plot_build(args) -> int:
    """Tokenize the corpus with the model's tokenizer, build the table (a root, or a domain's over --root)."""
    import torch
    from transformers import AutoTokenizer

    from symbiosis.errors import SymbiosisError
    from symbiosis.plot import LowerLayers, PlotTable, build_table
    from symbiosis.train.data import DataError, check_lines, parse_text_line

    try:
        lines = check_lines(open(args.corpus, "rb").read(), parse_text_line)
        corpus = AutoTokenizer.from_pretrained(args.model)([line["text"] for line in lines])["input_ids"]
        lower = LowerLayers(args.model, args.lower_layers, args.device,
                            getattr(torch, args.model_dtype) if args.model_dtype else None)
        root = PlotTable.open(args.root) if args.root else None

        def progress(done, total):
            print(f"\rbuilding {done}/{total}", end="", file=sys.stderr, flush=True)

        table = build_table(lower, corpus, args.out, n=args.n, alpha=args.alpha, root=root, dtype=args.dtype,
                            values=args.values, min_tokens=args.min_corpus_tokens, progress=progress)
    except (OSError, DataError, SymbiosisError, ValueError) as e:
        raise SystemExit(f"symbiosis plot build: {e}") from None
    print(file=sys.stderr)
    print(json.dumps({"table": str(table.directory), "entries": table.entries(), "bytes": table.nbytes}))
    return 0


def add_parser(commands) -> None:
    hmi = commands.add_parser("hmi", help="HMI's domains and models on a running `symbiosis serve`")
    add_connection(hmi)
    kinds = hmi.add_subparsers(dest="kind", required=True)
    for kind, create in (("domain", domain_create), ("model", model_create)):
        parser = kinds.add_parser(kind, help=f"{kind}s: create, update, list, show, delete"
                                  + (", generate" if kind == "model" else ""))
        actions = parser.add_subparsers(dest="action", required=True)
        for action in ("create", "update"):
            made = actions.add_parser(action, help="a new " + kind if action == "create" else "its next version")
            made.add_argument("name")
            if kind == "domain":
                made.add_argument("--corpus", required=True, help='JSONL lines of {"text": ...}')
                made.add_argument("--alpha", type=float, help="percent of the corpus's most frequent n-grams kept")
                made.add_argument("--window", type=int)
            else:
                made.add_argument("--data", required=True, help='JSONL lines of {"text": ...}')
                made.add_argument("--rank", type=int)
                if action == "create":
                    made.add_argument("--domain", help="a domain (default: the root alone)")
            made.add_argument("--steps", type=int)
            made.add_argument("--learning-rate", type=float)
            made.add_argument("--follow", action="store_true", help="show progress until it is ready or failed")
            made.add_argument("--interval", type=float, default=1.0)
            made.set_defaults(run=create)
        actions.add_parser("list").set_defaults(run=listing)
        for action, run in (("show", show), ("delete", delete)):
            one = actions.add_parser(action)
            one.add_argument("name")
            one.set_defaults(run=run)
        if kind == "model":
            gen = actions.add_parser("generate", help="greedy tokens from the model's newest ready version")
            gen.add_argument("name")
            gen.add_argument("--prompt", required=True)
            gen.add_argument("--max-tokens", type=int, default=16)
            gen.set_defaults(run=generate)

    plot = commands.add_parser("plot", help="PLOT tables offline")
    plot_actions = plot.add_subparsers(dest="action", required=True)
    build = plot_actions.add_parser("build", help="build a table from a corpus (run again to resume)")
    build.add_argument("--model", required=True)
    build.add_argument("--lower-layers", type=int, required=True, help="k: the table stands in for layers 0..k-1")
    build.add_argument("--corpus", required=True, help='JSONL lines of {"text": ...}')
    build.add_argument("--out", required=True)
    build.add_argument("--root", help="build a domain table over this root table")
    build.add_argument("--alpha", type=float, default=100.0, help="a domain table's percent of n-grams kept")
    build.add_argument("--n", type=int, default=3, help="the longest fragment (tri-grams by default)")
    build.add_argument("--dtype", default="float16", choices=["float16", "float32", "float64"])
    build.add_argument("--values", default="context", choices=["context", "alone"],
                       help="a fragment's value: its mean in the corpus's context (default), or run alone (HMI's)")
    build.add_argument("--model-dtype", help="the lower layers' dtype (default: the checkpoint's)")
    build.add_argument("--device", default="cpu")
    build.add_argument("--min-corpus-tokens", type=int, default=0)
    build.set_defaults(run=plot_build)
