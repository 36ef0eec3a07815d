"""Shared pieces of the benchmarks: real model configs with random weights, LoRA configs, timing, output.

Every benchmark prints one JSON line per result (and appends it to $OUT/results.jsonl when OUT is set),
and runs its baseline (plain transformers + PEFT, one job per tenant) in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
# Shapes of the real models (random weights: no hub access; the work done is the same).
CONFIGS = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072),
    "llama-2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                        num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096),
    # Qwen3-30B-A3B's shapes (128 experts, 8 routed per token), cut to 12 of its 48 layers: 8.1B parameters,
    # 16 GB in bf16, so that one GPU holds PEFT processes of it to compare with
    "qwen3-30b-a3b-12l": dict(architecture="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                              moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                              num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
                              tie_word_embeddings=False),
    # Gemma-2-27B (the paper's largest run: executor over 4 GPUs, clients on 4 more)
    "gemma-2-27b": dict(architecture="gemma2", hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=256000,
                        sliding_window=4096, query_pre_attn_scalar=144, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, max_position_embeddings=8192),
    "tiny-moe": dict(architecture="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096),
}


def is_moe(name: str) -> bool:
    return CONFIGS[name].get("architecture") in ("qwen3_moe", "mixtral")


def model_classes(name: str):
    """(config class, model class) of a CONFIGS entry (Llama unless it names its architecture)."""
    import transformers

    return {"llama": (LlamaConfig, LlamaForCausalLM),
            "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
            "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
            "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}[
        CONFIGS[name].get("architecture", "llama")]
PAPER_LORAS = ("lora1_r8_q", "lora2_r64_q", "lora3_r8_qkvo", "lora4_r64_qkvo")  # paper Table 2
LORAS = {  # name -> (rank, target modules, other LoraConfig options)
    "lora1_r8_q": (8, ["q_proj"], {}),
    "lora2_r64_q": (64, ["q_proj"], {}),
    "lora3_r8_qkvo": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], {}),
    "lora4_r64_qkvo": (64, ["q_proj", "k_proj", "v_proj", "o_proj"], {}),
    "dora_r8_qkvo": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], {"use_dora": True}),
    "lora_r16_qkvo_a32": (16, ["q_proj", "k_proj", "v_proj", "o_proj"], {"lora_alpha": 32}),  # Tinker's parametrisation
}


def fleet_args(duration: float = 15.0) -> argparse.Namespace:
    """--model (a CONFIGS name) and --duration (seconds each fleet of tenant processes works)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(CONFIGS))
    parser.add_argument("--duration", type=float, default=duration)
    return parser.parse_args()


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def checkpoint(name: str, root: Path | None = None) -> Path:
    """A saved random-weight checkpoint with the shapes of `name` (made once, then reused)."""
    root = root or Path(os.environ.get("SYMBIOSIS_BENCH_MODELS", "/tmp/symbiosis-bench-models"))
    path = root / name
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config_class, model_class = model_classes(name)
    fields = {k: v for k, v in CONFIGS[name].items() if k != "architecture"}
    with torch.device(device()):
        model = model_class(config_class(**fields, dtype=dtype())).to(dtype())
    model.save_pretrained(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def with_tokenizer(model_dir: Path) -> Path:
    """The benchmark checkpoints have no tokenizer; a service needs one (a small BPE, as the demo's)."""
    if not (model_dir / "tokenizer.json").is_file():
        from symbiosis.demo import build_tokenizer

        build_tokenizer(["the cat sees a dog in the garden ."] * 50).save_pretrained(model_dir)
    return model_dir


def lora(name: str) -> LoraConfig:
    r, targets, options = LORAS[name]
    return LoraConfig(task_type="CAUSAL_LM", r=r, target_modules=targets, **{"lora_alpha": 2 * r, **options})


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_stream() -> None:
    """Wait for this thread's current CUDA stream only (other threads' tenants keep their GPU work)."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def train_step(model, optimizer, batch_size: int, seq_len: int, vocab: int) -> None:
    fit_step(transformers_loss(model), optimizer, torch.randint(0, vocab, (batch_size, seq_len), device=model.device))


def transformers_loss(model):
    """loss_fn(input_ids=, labels=) -> transformers' own loss, `model(...).loss` (whole logits)."""
    return lambda **inputs: model(**inputs).loss


def fit_step(loss_fn, optimizer, ids: torch.Tensor) -> torch.Tensor:
    """One fine-tuning step on `ids` [batch, seq] (as input and labels); returns the loss. loss_fn:
    transformers_loss(model), or partial(symbiosis.causal_lm_loss, model) (chunked, no whole logits)."""
    loss = loss_fn(input_ids=ids, labels=ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


WARMUP_ITERS = 3  # iterations run before timing starts


def time_interleaved(models: dict, batch_size=2, seq_len=512, warmup=WARMUP_ITERS, iters=10) -> dict[str, float]:
    """Median seconds per fine-tuning iteration (forward, backward, AdamW step) of each model, their
    iterations taken in turn (a, b, c, a, b, c, ...): a drift of the machine's speed, which on a CPU-bound
    step moves a baseline by up to 20% between runs, then falls on every model alike."""
    optimizers = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():
        model.train()
    for i in range(warmup + iters):
        for name, model in models.items():
            sync()
            start = time.perf_counter()
            train_step(model, optimizers[name], batch_size, seq_len, model.config.vocab_size)
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def task_cpu_s(native_id: int) -> float:
    """A thread of this process's CPU seconds so far, by its OS id (Linux's /proc/self/task/TID/stat: user +
    system; every thread, also those Python did not start), or NaN (not Linux, or the thread has ended)."""
    return _stat_cpu_s(Path(f"/proc/self/task/{native_id}/stat"))


def process_cpu_s(pid: int) -> float:
    """Another process's CPU seconds so far (all its threads; Linux's /proc/PID/stat), or NaN."""
    return _stat_cpu_s(Path(f"/proc/{pid}/stat"))


def _stat_cpu_s(stat: Path) -> float:
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def call_table(profiler, per: int, rows: int = 25) -> str:
    """A cProfile.Profile's functions by own time, in microseconds per `per` (pstats' own table rounds to ms)."""
    import pstats

    entries = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:rows]
    lines = [f"{'own us':>9} {'total us':>9} {'calls':>7}  function (per one of {per})"]
    for (file, line, function), (_, calls, own, total, _) in entries:
        where = f"{Path(file).name}:{line}({function})" if line else function
        lines.append(f"{own * 1e6 / per:9.1f} {total * 1e6 / per:9.1f} {calls / per:7.1f}  {where}")
    return "\n".join(lines) + "\n"


class GcPauses:
    """The cyclic garbage collector's pauses while open, per generation: {"0": [collections, ms], ...}; a
    collection holds the GIL, so in a service every thread waits for it (a full one walked everything made at
    start-up until the service froze it: docs/PERFORMANCE.md section 9)."""

    def __init__(self):
        self.by_generation: dict[str, list] = {}
        self._started: dict[int, float] = {}

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started[threading.get_ident()] = time.perf_counter()
        elif (began := self._started.pop(threading.get_ident(), None)) is not None:
            entry = self.by_generation.setdefault(str(info["generation"]), [0, 0.0])
            entry[0] += 1
            entry[1] = round(entry[1] + 1e3 * (time.perf_counter() - began), 2)

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


BENCH_KEY = "bench-key-0123456789abcdef"


def tiny_service(prefix: str, max_requests: int):
    """The service (`symbiosis serve`'s) on the tiny model, without hosted training, in a fresh temporary
    directory; one tenant, "bench", whose key is BENCH_KEY."""
    import tempfile

    from symbiosis.serve.service import Service

    model_dir = with_tokenizer(checkpoint("tiny"))
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    (workdir / "keys").write_text(f"bench {BENCH_KEY}\n")
    (workdir / "adapters").mkdir()
    return Service(model_dir, workdir / "state", workdir / "keys", adapter_root=workdir / "adapters",
                   max_requests=max_requests, max_requests_per_tenant=max_requests, training=None).start()


def emit(**record) -> None:
    record["mps"] = bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))  # run under MPS (run_all.sh MPS=1)?
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "results.jsonl", "a") as f:
            f.write(line + "\n")


class GpuSampler:
    """Peak device memory in use (all processes) and the GPU's utilisation (the share of time a kernel ran,
    as nvidia-smi reports it), sampled while a run goes on."""

    def __init__(self, interval: float = 0.2, baseline_mib: int | None = None):
        """baseline_mib: memory in use before whatever is to be measured started (default: on entering)."""
        self.interval, self.peak_mib, self._stop = interval, 0, threading.Event()
        self.baseline_mib = baseline_mib
        self.utilisation: list[tuple[float, int]] = []  # (time.time(), percent), one sample per interval
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> tuple[int, int]:
        """(MiB in use, utilisation %)"""
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,utilization.gpu",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5).stdout
            used, busy = out.splitlines()[0].split(",")
            return int(used), int(busy)
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return 0, 0

    def _run(self) -> None:
        while not self._stop.is_set():
            used, busy = self.read()
            self.peak_mib = max(self.peak_mib, used)
            self.utilisation.append((time.time(), busy))
            time.sleep(self.interval)

    def busy_share(self, since: float, until: float) -> float:
        """Mean GPU utilisation (0-1) between two time.time() instants, say a fleet's working window."""
        window = [busy for t, busy in self.utilisation if since <= t <= until]
        return sum(window) / len(window) / 100 if window else 0.0

    def __enter__(self):
        self.idle_mib = self.read()[0] if self.baseline_mib is None else self.baseline_mib
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def used_gib(self) -> float:
        return max(0, self.peak_mib - self.idle_mib) / 1024


def free_port() -> int:
    """A TCP port free on this host now (for a launcher that needs it named in advance)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_executor(model_dir: Path, url: str, policy: str = "opportunistic",
                   where: list[str] | None = None) -> subprocess.Popen:
    """A `symbiosis executor` process, returned once it answers; `where`: its placement arguments (default:
    `--device` this benchmark's device)."""
    import symbiosis

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen([sys.executable, "-m", "symbiosis.cli", "executor", "--model", str(model_dir),
                                "--listen", url, *(where or ["--device", device()]), "--dtype",
                                str(dtype()).removeprefix("torch."), "--policy", policy], env=env,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError("executor exited during start-up")
        try:
            symbiosis.connect(url, timeout=1.0).stats()
            return process
        except symbiosis.ExecutorUnavailable:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("executor did not start")


def serve_through_fronts(service, count: int):
    """The service's HTTP app behind `count` front processes (`symbiosis serve --http-processes`): the app on the
    bridge's event loop in a thread of this process (serve/bridge.py), the fronts accepting on a free loopback port
    (serve/front.py): (url, that thread, the fronts' process ids, what stops both)."""
    import tempfile

    from symbiosis.serve.app import MAX_UPLOAD_BYTES, create_app
    from symbiosis.serve.bridge import AsgiHost
    from symbiosis.serve.front import start_fronts, stop_fronts

    bridge = f"ipc://{tempfile.mkdtemp(prefix='bench-bridge-')}/bridge"
    thread, stop_host = AsgiHost(create_app(service), bridge).serve_in_thread()
    listener = socket.create_server(("127.0.0.1", 0), backlog=2048)
    fronts = start_fronts(listener, bridge, count, MAX_UPLOAD_BYTES)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    deadline = time.monotonic() + 60
    while True:  # up once a front answers
        try:
            with socket.create_connection(listener.getsockname(), timeout=5) as probe:
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if probe.recv(64).startswith(b"HTTP/1.1 200"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the front processes did not come up")
        time.sleep(0.2)

    def close() -> None:
        stop_fronts(fronts)
        stop_host()
        listener.close()
    return url, thread, [front.pid for front in fronts], close


def http_layouts(service, counts: str, server, url: str, loop_thread):
    """Each HTTP layout of `counts` (comma-separated: 0, the app's event loop `loop_thread` at `url`, uvicorn's
    `server`; N, behind N front processes, `serve_through_fronts`): ({N: (url, the loop's thread, the fronts'
    pids)}, what stops them all and the service)."""
    layouts, closing = {}, []
    for count in map(int, counts.split(",")):
        if count == 0:
            layouts[0] = (url, loop_thread, [])
        else:
            front_url, bridge_thread, pids, close = serve_through_fronts(service, count)
            layouts[count] = (front_url, bridge_thread, pids)
            closing.append(close)

    def close_all() -> None:
        for close in closing:
            close()
        server.should_exit = True
        service.close()
    return layouts, close_all
