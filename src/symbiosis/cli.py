"""`symbiosis` command line: `demo`, `serve` (the HTTP service), `executor` (serve the base layers, or print
another's --stats), `generate`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path


def _read_token(token_file: str | None) -> str | None:
    """A client's token (a bare token, or its `NAME TOKEN` line)."""
    from symbiosis.transport.auth import client_token

    if token_file is None:
        return None
    try:
        return client_token(token_file)
    except (OSError, ValueError) as e:
        raise SystemExit(f"token file {token_file}: {e}") from None


def executor_command(args: argparse.Namespace) -> int:
    """Serve the base layers of --model on --listen until SIGTERM / Ctrl-C, or print --stats of a running one."""
    # Read when the CUDA context is made: the hardware queues a GPU's streams share (8 by default). The executor
    # keeps a stream and an NCCL pair a `nccl://` client, whose send and receive kernels spin until their peer's
    # match is posted; past the queues a spinning kernel can hold up work queued behind it on a shared one: four
    # client threads over nccl:// hung at 8 (two calls on 2xH200) and ran at 32 (PERFORMANCE 14). Only here:
    # the other commands' GPU work was measured at the default.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    import torch
    import zmq

    import symbiosis
    from symbiosis.executor.policy import make_policy
    from symbiosis.transport.server import ExecutorServer

    if args.stats:
        token = _read_token(args.token_file)
        print(json.dumps(symbiosis.connect(args.stats, token=token, timeout=10).stats(), indent=2))
        return 0
    from symbiosis.transport.auth import Tenants

    try:
        tenants = Tenants.read(args.token_file) if args.token_file else None
    except (OSError, ValueError) as e:
        raise SystemExit(f"symbiosis executor: --token-file: {e}") from None
    if not args.model or not args.listen:
        raise SystemExit("symbiosis executor: --model and --listen are required (or --stats URL)")
    logging.basicConfig(level=logging.INFO, format="[executor] %(message)s", stream=sys.stderr)
    sys.setswitchinterval(5e-4)  # hand the GIL between the I/O and batching threads within 0.5 ms, not 5
    policy = make_policy(args.policy, None if args.max_wait_ms is None else args.max_wait_ms / 1e3)
    options = dict(policy=policy, max_call_tokens=args.max_call_tokens)
    if args.devices and "RANK" in os.environ and int(os.environ["RANK"]) > 0:  # a shard under torchrun
        from symbiosis.executor.sharded import serve_shard

        serve_shard(int(os.environ["RANK"]), args.model, args.devices.split(","), args.dtype, split=args.split)
        return 0
    try:
        if args.devices:  # under torchrun this is rank 0; GPUs alone: this process drives them all; else it
            # launches a shard process per device after the first
            from symbiosis.executor.peers import on_devices
            from symbiosis.executor.sharded import front, launch_sharded

            devices = args.devices.split(",")
            if "RANK" in os.environ:
                executor = front(args.model, devices, args.dtype, split=args.split, **options)
            elif all(d.startswith("cuda") for d in devices):
                executor = on_devices(args.model, devices, args.dtype, split=args.split, **options)
            else:
                executor = launch_sharded(args.model, devices, args.dtype, split=args.split, **options)
        else:
            device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
            executor = symbiosis.Executor.from_pretrained(args.model, device=device, dtype=args.dtype, **options)
        server = ExecutorServer(executor, args.listen, tenants, client_timeout=args.client_timeout,
                                max_attaches=args.max_attaches, max_attaches_per_tenant=args.max_attaches_per_tenant)
    except (symbiosis.SymbiosisError, ValueError) as e:
        raise SystemExit(f"symbiosis executor: {e}") from None
    except zmq.ZMQError as e:
        raise SystemExit(f"symbiosis executor: cannot listen on {args.listen}: {e}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    mib = executor.weights.nbytes / 2**20
    where = f"{executor.device}" if not args.devices else f"sharded over {args.devices}, {mib:.1f} MiB on rank 0"
    print(f"[executor] serving {len(executor.weights.layers)} base layers ({mib:.1f} MiB) of {args.model} on "
          f"{server.url} ({where}, {executor.dtype}, policy {policy.name})", file=sys.stderr, flush=True)
    stop.wait()
    server.stop()
    executor.close()
    print("[executor] stopped", file=sys.stderr, flush=True)
    return 0


def executor_session(model):
    """The session of a split model, also when wrapped by PEFT."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.symbiosis_session


def generate_command(args: argparse.Namespace) -> int:
    """Generate text: on the hosted engine (the base loaded here, every prompt batched in one engine, each with
    the adapter), or, with --executor, on a split model attached to a running executor. Streams a single prompt."""
    from transformers import AutoTokenizer

    import symbiosis

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    try:
        if args.executor:
            return _generate_split(args, tokenizer)
        return _generate_engine(args, tokenizer)
    except symbiosis.SymbiosisError as e:
        print(f"symbiosis generate: {e}", file=sys.stderr)
        return 2


def _generate_engine(args: argparse.Namespace, tokenizer) -> int:
    from symbiosis.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, tokenizer=tokenizer,
                                    max_lora_rank=args.max_lora_rank).start()
    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p or 1.0,
                                top_k=args.top_k or 0, seed=args.seed, stop=tuple(args.stop or ()))
        adapter = ("cli", args.adapter) if args.adapter else None
        handles = [engine.submit(tokenizer(prompt)["input_ids"], params, adapter) for prompt in args.prompt]
        if len(handles) == 1:
            for token in handles[0]:
                print(token.text, end="", flush=True)
            print()
        else:
            for prompt, handle in zip(args.prompt, handles):
                print(json.dumps({"prompt": prompt, "text": handle.result().text}))
    finally:
        engine.close()
    return 0


def _generate_split(args: argparse.Namespace, tokenizer) -> int:
    import symbiosis
    from symbiosis.client.generate import generate_text, load_adapter

    if len(args.prompt) != 1:
        raise symbiosis.errors.BadCall("a split model generates one --prompt at a time")
    executor = symbiosis.connect(args.executor, token=_read_token(args.token_file), timeout=args.timeout)
    model = symbiosis.from_pretrained(args.model, executor, device=args.device, name="generate")
    try:
        if args.adapter:
            model = load_adapter(model, args.adapter)
        generate_text(model, tokenizer, args.prompt[0], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, stream=True)
    finally:
        executor_session(model).close()
    return 0


def serve_command(args: argparse.Namespace) -> int:
    """Serve the base model to tenants over HTTP: OpenAI's API on the hosted engine (and the executor to split
    tenants with --executor-listen), state in --state-dir, until SIGTERM / Ctrl-C; SIGHUP reloads --api-keys."""
    import uvicorn

    import symbiosis
    from symbiosis.serve.app import create_app
    from symbiosis.serve.keys import KeyFileError
    from symbiosis.serve.service import Service

    logging.basicConfig(level=logging.INFO, format="[serve] %(message)s", stream=sys.stderr)
    try:
        service = Service(args.model, args.state_dir, args.api_keys, adapter_root=args.adapter_root,
                          device=args.device, dtype=args.dtype, executor_listen=args.executor_listen,
                          served_name=args.served_model_name, max_requests=args.max_requests,
                          max_requests_per_tenant=args.max_requests_per_tenant,
                          engine_options={"kv_blocks": args.kv_blocks, "block_size": args.block_size,
                                          "max_lora_rank": args.max_lora_rank, "adapter_slots": args.adapter_slots,
                                          "adapter_host_bytes": args.adapter_host_mib << 20,
                                          "adapter_device_bytes": None if args.adapter_gpu_mib is None else
                                          args.adapter_gpu_mib << 20},
                          training=None if args.no_training else {
                              "persist_every": args.persist_every, "max_pass_tokens": args.max_pass_tokens,
                              "keep_answers_s": args.keep_answers, "resident_models": args.resident_models,
                              "max_models_per_tenant": args.max_models_per_tenant,
                              "max_checkpoint_bytes_per_tenant": int(args.max_checkpoint_gib_per_tenant * 2**30),
                              "tokenizer_id": args.tokenizer_id, "max_running_jobs": args.max_running_jobs,
                              "max_running_jobs_per_tenant": args.max_running_jobs_per_tenant,
                              "checkpoint_every": args.checkpoint_every,
                              "devices": args.train_devices.split(",") if args.train_devices else None},
                          hmi=None if args.plot_root is None else {
                              "root": args.plot_root, "min_corpus_tokens": args.hmi_min_corpus_tokens})
    except (symbiosis.SymbiosisError, KeyFileError, ValueError, OSError) as e:
        raise SystemExit(f"symbiosis serve: {e}") from None
    signal.signal(signal.SIGHUP, lambda *_: service.reload_keys())
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn stops on these, then hands them on: to a no-op
        signal.signal(sig, lambda *_: None)
    service.start()
    logging.getLogger("symbiosis.serve").info("serving %s as %r on http://%s:%d (%s, %s)%s", args.model,
                                              service.base_name, args.host, args.port, service.executor.device,
                                              service.executor.dtype, f"; executor on {service.server.url}"
                                              if service.server is not None else "")
    try:
        if args.http_processes:
            _serve_through_fronts(create_app(service), args)
        else:
            uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning", access_log=False)
    finally:
        service.close()
    return 0


def _serve_through_fronts(app, args: argparse.Namespace) -> None:
    """--http-processes N: N front processes (serve/front.py) accept on this process's listening socket and forward
    each request to `app`, run here on an event loop of its own (serve/bridge.py), until SIGTERM / Ctrl-C."""
    import asyncio
    import shutil
    import socket
    import tempfile

    from symbiosis.serve.app import MAX_UPLOAD_BYTES
    from symbiosis.serve.bridge import AsgiHost, new_event_loop
    from symbiosis.serve.front import start_fronts, stop_fronts

    family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((args.host, args.port), family=family, backlog=2048)
    folder = tempfile.mkdtemp(prefix="symbiosis-fronts-")  # (0700: the bridge's socket is this user's alone)
    url = f"ipc://{folder}/bridge"
    fronts = start_fronts(listener, url, args.http_processes, MAX_UPLOAD_BYTES)

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await AsgiHost(app, url).serve(stop)
    loop = new_event_loop()
    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
        stop_fronts(fronts)
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)


def demo_command(args: argparse.Namespace) -> int:
    """Several tenants fine-tuning and generating on one shared base model, each its own process."""
    from symbiosis.demo import run_demo

    return run_demo(Path(args.workdir), steps=args.steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="symbiosis", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help=demo_command.__doc__)
    demo.add_argument("--workdir", default="demo-out", help="where the base model and adapters are written")
    demo.add_argument("--steps", type=int, default=60, help="fine-tuning steps per training tenant")
    demo.set_defaults(run=demo_command)

    generate = commands.add_parser("generate", help=generate_command.__doc__)
    generate.add_argument("--executor", help="URL of a running executor: generate on a split model attached to it "
                          "(default: on the hosted engine, in this process)")
    generate.add_argument("--model", required=True, help="the model directory (the executor's, with --executor)")
    generate.add_argument("--adapter", help="a PEFT adapter directory (safetensors)")
    generate.add_argument("--prompt", required=True, action="append", help="repeatable: the engine batches them")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", help="stop when this text is generated (repeatable)")
    generate.add_argument("--device", default="cpu", help="where the engine (or the split client) computes (cpu, cuda:0, ...)")
    generate.add_argument("--dtype", default=None, help="the engine's dtype, e.g. bfloat16 (default: the checkpoint's)")
    generate.add_argument("--max-lora-rank", type=int, default=64, help="the engine's largest adapter rank")
    generate.add_argument("--token-file", help="file holding the executor's token")
    generate.add_argument("--timeout", type=float, default=60.0)
    generate.set_defaults(run=generate_command)

    serve = commands.add_parser("serve", help=serve_command.__doc__)
    serve.add_argument("--model", required=True, help="Hugging Face model directory (config, safetensors, tokenizer)")
    serve.add_argument("--state-dir", required=True, help="where the SQLite database and the service's files live")
    serve.add_argument("--api-keys", required=True, help="`TENANT_NAME API_KEY` lines; the tenant `admin` reads "
                       "/metrics and everyone's usage; SIGHUP reloads the file")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", default="cpu", help="cpu, cuda:0, ...")
    serve.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    serve.add_argument("--adapter-root", help="the directory tenants' adapters are loaded from (lora_path is "
                       "relative to it); without it no adapter can be loaded")
    serve.add_argument("--executor-listen", help="also serve the executor here (ipc://... or tcp://...) to split "
                       "tenants, who attach with their API key as token")
    serve.add_argument("--http-processes", type=int, default=0, help="HTTP in this many front processes of its "
                       "own, this process's interpreter left to the engine (0: HTTP in this process)")
    serve.add_argument("--served-model-name", help="the base model's name in the API (default: the directory's)")
    serve.add_argument("--max-requests", type=int, default=256, help="HTTP requests generating at once, in all")
    serve.add_argument("--max-requests-per-tenant", type=int, default=64, help="... of one tenant")
    serve.add_argument("--kv-blocks", type=int, default=512, help="KV cache blocks")
    serve.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    serve.add_argument("--max-lora-rank", type=int, default=64)
    serve.add_argument("--adapter-slots", type=int, default=8, help="adapters on the device at once")
    serve.add_argument("--adapter-gpu-mib", type=int, help="device memory for adapter slots (MiB; instead of "
                       "--adapter-slots: as many slots as it holds)")
    serve.add_argument("--adapter-host-mib", type=int, default=4096, help="host memory for adapters read lately "
                       "(MiB; least recently used evicted; every adapter stays on disk)")
    serve.add_argument("--no-training", action="store_true", help="no hosted training (neither the Tinker API nor "
                       "fine-tuning jobs)")
    serve.add_argument("--max-running-jobs", type=int, default=8, help="fine-tuning jobs training at once, in all")
    serve.add_argument("--max-running-jobs-per-tenant", type=int, default=2, help="... of one tenant")
    serve.add_argument("--checkpoint-every", type=int, default=50, help="a fine-tuning job's checkpoint every N steps "
                       "(and at the end of every epoch)")
    serve.add_argument("--persist-every", type=int, default=1, help="write each training model's state to the state "
                       "dir every N optimizer steps (1: every step, before it is answered)")
    serve.add_argument("--keep-answers", type=float, default=3600, metavar="SECONDS", help="how long the Tinker "
                       "API keeps an answered request (for late polls and resubmissions) before pruning it")
    serve.add_argument("--resident-models", type=int, default=64, help="Tinker training models kept in memory (on "
                       "the trainer's device) when idle; the least recently used others are read back from the state "
                       "dir at their next request")
    serve.add_argument("--max-models-per-tenant", type=int, default=1000, help="Tinker training models one tenant "
                       "may have (they are never deleted: each keeps its state on disk)")
    serve.add_argument("--max-checkpoint-gib-per-tenant", type=float, default=64, help="the bytes of Tinker "
                       "checkpoints one tenant may keep (deleting some makes room)")
    serve.add_argument("--max-pass-tokens", type=int, default=16384, help="tokens of one batched training pass")
    serve.add_argument("--train-devices", help="hosted training's devices, comma-separated (default: --device): a "
                       "copy of the base on each but --device's, each training model on one of them")
    serve.add_argument("--plot-root", help="a PLOT root table (`symbiosis plot build`): enables HMI's domains and "
                       "models (/v1/hmi, `symbiosis hmi`) over the layers it stands in for")
    serve.add_argument("--hmi-min-corpus-tokens", type=int, default=10_000, help="the smallest corpus a domain is "
                       "built from")
    serve.add_argument("--tokenizer-id", help="what the Tinker API tells clients to load as the tokenizer (default: "
                       "the model directory, for clients on this machine; else e.g. the base model's hub name)")
    serve.set_defaults(run=serve_command)

    from symbiosis.serve.jobs import cli as jobs_cli

    jobs_cli.add_parser(commands)
    from symbiosis.serve.hmi import cli as hmi_cli

    hmi_cli.add_parser(commands)

    executor = commands.add_parser("executor", help=executor_command.__doc__)
    executor.add_argument("--model", help="Hugging Face model directory (config.json + safetensors)")
    executor.add_argument("--listen", help="ipc:///path/to/socket or tcp://host:port")
    executor.add_argument("--device", default=None, help="cuda:0, cpu, ... (default: cuda:0 if there is a GPU)")
    executor.add_argument("--devices", default=None,
                          help="spread the base layers over these devices: GPUs of this machine (cuda:0,cuda:1) are "
                               "driven by this process; otherwise (cpu,cpu; torch.distributed) it launches a shard "
                               "process per device after the first, or, under torchrun, each rank takes the device of "
                               "its rank and rank 0 listens")
    executor.add_argument("--split", choices=["layers", "columns"], default="layers",
                          help="with --devices: whole decoder layers per device, or every layer's output columns over "
                               "all devices")
    executor.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    executor.add_argument("--policy", default="opportunistic", choices=["opportunistic", "lockstep", "none"])
    executor.add_argument("--max-wait-ms", type=float, default=None, help="batching wait budget per call")
    executor.add_argument("--max-call-tokens", type=int, default=1 << 20, help="largest call accepted")
    executor.add_argument("--client-timeout", type=float, default=30.0,
                          help="seconds without a call or heartbeat before a client is detached")
    executor.add_argument("--token-file", help="`NAME TOKEN` lines, one per tenant (or one bare token): clients must "
                          "present a tenant's token; the tenant `admin` may read every tenant's --stats")
    executor.add_argument("--max-attaches", type=int, default=256, help="clients attached at once, in all")
    executor.add_argument("--max-attaches-per-tenant", type=int, default=64, help="clients of one tenant at once")
    executor.add_argument("--stats", metavar="URL", help="print the stats of the executor at URL and exit")
    executor.set_defaults(run=executor_command)

    args = parser.parse_args(argv)
    # Before torch loads (this module does not import it): PyTorch's OpenMP threads otherwise keep spinning
    # after each operation, taking the cores that the other processes of a deployment (executor, clients,
    # demo tenants, all inheriting this) are waiting for; ~10x per call on a 2-core host (README).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
