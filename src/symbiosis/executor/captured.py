"""Block calls replayed from CUDA graphs (`Executor(capture_blocks=True)`, `symbiosis executor --capture-blocks`).

A decoder tail's forward is ~17 kernels and its backward ~35 plus an autograd pass (executor/store.py:
`DecoderTail`); each costs the executor's thread 5-10 us to launch, and over nccl:// that launching is on the call's
critical path: the GPU runs the kernels faster than the host issues them (`benchmarks/remote_chain.py` on two
H100s, 2026-11-28: a tail's forward took 286 us a call in process, of which 251 us the host's issuing, against 52 us
for one layer). Replayed from a graph, a call is three launches: its input copied into the graph's, the graph, its
output copied out.

A call is captured the second time its (block, op, shape, dtype, device) is seen (the first runs eagerly: a batch
shape met once is not worth a graph's memory), after one more eager run on the capturing stream (lazy
initializations, such as cuBLAS's workspace, must not happen inside a capture). Only calls of at most `max_rows`
rows are captured, and at most `max_graphs` graphs are kept, least recently used out: each holds its own memory
pool, the intermediates of one call (~80 MB for a Llama-3.2-1B tail's forward at 1,024 rows). A capture that fails
(out of memory, an operation that cannot be captured) leaves that call eager for good. Replays are serialized by a
lock and by an event: a graph's input and output buffers are its own, so a replay on one stream waits for the last
replay's output to have been copied out on another.

Not yet run on a GPU: off by default until `tests/unit/executor/test_captured.py`'s GPU test and
`benchmarks/run_all.sh remote_captured_2gpu` have run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import torch

DEFAULT_MAX_GRAPHS = 128  # two per block (forward, backward) for 32 decoder layers at two batch shapes
DEFAULT_MAX_ROWS = 8192


def _capturable(x: torch.Tensor) -> bool:
    """On a GPU, and not inside another capture (a client's own graph of its step)."""
    return x.is_cuda and not torch.cuda.is_current_stream_capturing()


class _Graph:
    """One captured call: its graph and the static tensors it reads and writes."""

    def __init__(self, call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
        stream = torch.cuda.current_stream(x.device)
        self.input = x.clone()
        side = torch.cuda.Stream(x.device)
        side.wait_stream(stream)  # the input copied (not part of the graph: captured work starts after this wait)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            call(self.input)  # a warm-up on the capturing stream first, as torch.cuda.graph asks
            # Not torch.cuda.graph(): it synchronizes the whole device first, which would wait for the transports'
            # pending sends and receives, each waiting for a client. thread_local: the executor's other threads
            # (the transports') may use the GPU meanwhile.
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.output = call(self.input)
            finally:
                self.graph.capture_end()
        stream.wait_stream(side)
        self.done: torch.cuda.Event | None = None  # recorded after the latest replay's output was copied out

    def replay(self, x: torch.Tensor) -> torch.Tensor:
        stream = torch.cuda.current_stream(x.device)
        if self.done is not None:
            stream.wait_event(self.done)
        self.input.copy_(x)
        self.graph.replay()
        y = self.output.clone()
        self.done = torch.cuda.Event()
        self.done.record(stream)
        return y

    def release(self) -> None:
        """Before the graph goes: its last replay done. Its input and its pool's memory return to the allocator,
        which knows nothing of the streams that replayed it, and could hand them out while a replay still runs."""
        if self.done is not None:
            self.done.synchronize()


class CapturedCalls:
    """Calls of blocks replayed from CUDA graphs, one per (key, shape, dtype, device); see the module docstring."""

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS, max_rows: int = DEFAULT_MAX_ROWS):
        if max_graphs < 1 or max_rows < 1:
            raise ValueError(f"max_graphs and max_rows must be positive (got {max_graphs}, {max_rows})")
        self.max_graphs, self.max_rows = max_graphs, max_rows
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # least recently used first
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # keys run once eagerly, not yet captured
        self._eager: set[tuple] = set()  # keys whose capture failed
        self._lock = threading.Lock()
        self.captures = self.replays = self.failures = 0

    def __call__(self, key: tuple, call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """call(x), from a graph where it can be: `key` names what `call` computes (the block and the op)."""
        if x.shape[0] > self.max_rows or not _capturable(x):
            return call(x)
        key = (*key, tuple(x.shape), x.dtype, x.device)
        with self._lock:
            graph = self._graphs.get(key)
            if graph is None and key not in self._eager:
                if key in self._seen:
                    graph = self._capture(key, call, x)
                else:
                    self._remember(key)
            if graph is not None:
                self._graphs.move_to_end(key)
                self.replays += 1
                return graph.replay(x)
        return call(x)

    def _remember(self, key: tuple) -> None:
        self._seen[key] = None
        while len(self._seen) > 4 * self.max_graphs:
            self._seen.popitem(last=False)

    def _capture(self, key: tuple, call, x: torch.Tensor) -> _Graph | None:
        del self._seen[key]
        try:
            graph = _Graph(call, x)
        except (torch.OutOfMemoryError, RuntimeError):  # the call then runs eagerly (and raises if it is bad)
            self.failures += 1
            self._eager.add(key)
            return None
        self.captures += 1
        self._graphs[key] = graph
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)[1].release()
        return graph
