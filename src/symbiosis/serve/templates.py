"""Chat templates that tenants wrote (an adapter's own `chat_template.jinja`), rendered in worker processes.

A chat template is a program: transformers renders it in Jinja's sandbox, which keeps it from reaching Python's
internals but not from looping for minutes (`{% for i in range(99999) %}{% for j in range(99999) %}`) or
allocating gigabytes (`('x' * 3000000000)`), both holding the GIL of the process it runs in. So a template that is
not the operator's runs in a process of its own: the base tokenizer loaded there, `apply_chat_template` called
exactly as the service would, under an address-space limit (MEMORY_BYTES above what the worker holds once loaded),
a deadline (TIMEOUT_S: the worker is killed and replaced past it) and a bound on the text it returns (MAX_CHARS).

The wire is one JSON line each way over the worker's stdin/stdout (never a pickle): `{"template", "messages"}` in,
`{"text"}` or `{"error"}` out. WORKERS processes, started on first use; a tenant renders one template at a time, so
one tenant's slow templates hold at most one worker while the others' renders go on in the rest.

What the worker contains is a template's time and memory. Jinja's sandbox remains what keeps a template from
Python itself: the worker runs as the server's user, so a sandbox escape there would reach what the server reaches.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

TIMEOUT_S = 5.0  # a template's render, once a worker has it (the legitimate ones take milliseconds)
MEMORY_BYTES = 1 << 30  # what a render may allocate beyond the loaded worker
MAX_CHARS = 8 << 20  # of rendered text: as much as a request body may hold (the service tokenizes it next)
WORKERS = 2
OUT_OF_MEMORY = {"error": "the chat template used more memory than a render may"}  # the worker's answer then
STARTUP_S = 120.0  # a worker's import of transformers and load of the tokenizer


class TemplateError(Exception):
    """The template failed, ran too long, used too much memory or wrote too much: the request's own error."""


class _Worker:
    def __init__(self, tokenizer_dir: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "symbiosis.serve.templates", str(tokenizer_dir), str(MEMORY_BYTES), str(MAX_CHARS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        try:
            self._answer(STARTUP_S)  # {"ready": true} once it has the tokenizer
        except (TimeoutError, EOFError, ValueError):
            self.kill()
            raise OSError("the chat template renderer did not start") from None

    def render(self, request: bytes, timeout_s: float) -> dict:
        """The worker's answer to one request line; TimeoutError past `timeout_s` (the worker is then useless)."""
        self.process.stdin.write(request)
        self.process.stdin.flush()
        return self._answer(timeout_s)

    def _answer(self, timeout_s: float) -> dict:
        deadline, out, fd = time.monotonic() + timeout_s, bytearray(), self.process.stdout.fileno()
        while not out.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            out += chunk
            if len(out) > 12 * MAX_CHARS + 64:  # (JSON escapes a character in at most 12 bytes)
                raise EOFError
        return json.loads(out)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class TemplateRenderer:
    """`render(tenant, template, messages)`: the prompt text, from a worker thread (it blocks); TemplateError for
    the template's failures. `tokenizer_dir`: the base model's directory (its tokenizer's special tokens and
    settings are the template's as in the service)."""

    def __init__(self, tokenizer_dir: str | Path, workers: int = WORKERS, timeout_s: float = TIMEOUT_S):
        self.tokenizer_dir, self.timeout_s = Path(tokenizer_dir), timeout_s
        self._idle: queue.Queue = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)  # a place for a worker, started when first used
        self._tenants: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def render(self, tenant: str, template: str, messages: list[dict]) -> str:
        request = (json.dumps({"template": template, "messages": messages}) + "\n").encode()
        with self._lock:
            mine = self._tenants.setdefault(tenant, threading.Lock())
        with mine:
            worker = self._idle.get()
            try:
                worker = worker or _Worker(self.tokenizer_dir)  # (OSError if it does not start: the server's)
                answer = self._render(worker, request)
                if answer is None:
                    worker = None
            finally:
                self._idle.put(worker)
        if answer is None:
            raise TemplateError(f"the adapter's chat template did not render within {self.timeout_s:g} s, or "
                                "its renderer ran out of memory")
        if "error" in answer:
            raise TemplateError(str(answer["error"]))
        return answer["text"]

    def _render(self, worker: _Worker, request: bytes) -> dict | None:
        """The worker's answer; None, the worker killed, if it ran past the deadline or died (out of memory)."""
        try:
            return worker.render(request, self.timeout_s)
        except (TimeoutError, EOFError, OSError, ValueError):
            worker.kill()
            return None

    def close(self) -> None:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


def _serve(tokenizer_dir: str, memory_bytes: int, max_chars: int) -> None:
    """The worker: load the tokenizer, bound the address space, then answer request lines until stdin closes."""
    import resource

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with open("/proc/self/status") as status:  # what the loaded worker maps, in kB
        size = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + memory_bytes, size + memory_bytes))
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            text = tokenizer.apply_chat_template(request["messages"], chat_template=request["template"],
                                                 add_generation_prompt=True, tokenize=False)
            if not isinstance(text, str):
                raise TypeError("the template did not render to text")
            answer = {"text": text} if len(text) <= max_chars else \
                {"error": f"the chat template rendered over {max_chars} characters"}
        except MemoryError:
            answer = OUT_OF_MEMORY
        except Exception as e:  # noqa: BLE001 -- the template's own error (or one it provoked), for the tenant
            answer = {"error": f"cannot render these messages with the adapter's chat template: {str(e)[:500]}"}
        try:
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
        except MemoryError:
            sys.stdout.write(json.dumps(OUT_OF_MEMORY) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
