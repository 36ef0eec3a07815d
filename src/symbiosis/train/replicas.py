"""Hosted training over several GPUs, a copy of the base on each: every adapter lives on one replica (a `Trainer`
over that GPU's executor, with its own `TrainingQueue`), and the replicas' passes run at once, each its own GPU's.

    replicas = Replicas.on_devices("path/to/model", ["cuda:0", "cuda:1"], dtype=torch.bfloat16).start()
    trainer = replicas.place("tenant-a")           # the replica this adapter lives on, from now on
    lora = HostedLora(spec, trainer.targets, trainer.device, trainer.dtype)
    replicas.open("tenant-a", 0); replicas.submit("tenant-a", Operation(...))

Where the base fits one GPU beside a pass's activations (Llama-2-13B on an 80 GB H100: 26 GB of weights, 12
tenants' 512-token datums a pass), this needs no pipeline: each GPU trains its share of the tenants at one GPU's
speed, none waiting for another's stage (train/model.py's `_place` pipelines a base split over GPUs instead, for a
base that does not fit one). The price is a copy of the frozen base a GPU. An adapter's replica is chosen when it
is placed (the one with the fewest adapters) and kept: its matrices, gradients and optimizer state are on that GPU,
and its requests run in that replica's passes, in its `seq` order as `TrainingQueue` keeps it.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from symbiosis.train.scheduler import Operation, TrainingQueue
from symbiosis.train.trainer import Trainer


class Replicas:
    def __init__(self, trainers: list[Trainer], **queue_options):
        if not trainers:
            raise ValueError("no trainers")
        self.queues = [TrainingQueue(trainer, **queue_options) for trainer in trainers]
        self.homes: dict[str, int] = {}  # adapter key -> its replica's index
        self._lock = threading.Lock()

    @classmethod
    def on_devices(cls, path, devices: list[str | torch.device], dtype=None, executor=None,
                   **queue_options) -> "Replicas":
        """A replica on each of `devices` (a base copy on each), over the checkpoint at `path`; `executor`, one
        already on one of them (a service's), is that device's instead of a copy."""
        from symbiosis.executor.executor import Executor
        from symbiosis.executor.peers import checked_devices

        trainers = [Trainer(path, executor if executor is not None and device == executor.device else
                            Executor.from_pretrained(path, device=device, dtype=dtype))
                    for device in checked_devices(devices)]
        return cls(trainers, **queue_options)

    @property
    def trainers(self) -> list[Trainer]:
        return [queue.trainer for queue in self.queues]

    @property
    def passes(self) -> int:
        return sum(queue.passes for queue in self.queues)

    @property
    def overlapped(self) -> int:
        return sum(queue.overlapped for queue in self.queues)

    @property
    def seconds(self) -> dict[str, float]:
        """Each replica's runner's seconds (TrainingQueue.seconds), summed."""
        return {what: sum(queue.seconds[what] for queue in self.queues) for what in self.queues[0].seconds}

    def place(self, key: str) -> Trainer:
        """The trainer adapter `key` lives on (chosen at its first call: the replica with the fewest adapters), on
        whose device and dtype its `HostedLora` is to be made."""
        with self._lock:
            if key not in self.homes:
                counts = [0] * len(self.queues)
                for home in self.homes.values():
                    counts[home] += 1
                self.homes[key] = counts.index(min(counts))
            return self.queues[self.homes[key]].trainer

    def _queue(self, key: str) -> TrainingQueue:
        with self._lock:
            if key not in self.homes:
                raise KeyError(f"{key!r} was never placed (Replicas.place)")
            return self.queues[self.homes[key]]

    def open(self, key: str, next_seq: int) -> None:
        self._queue(key).open(key, next_seq)

    def close(self, key: str) -> None:
        self._queue(key).close(key)
        with self._lock:
            self.homes.pop(key, None)

    def submit(self, key: str, operation: Operation) -> None:
        self._queue(key).submit(key, operation)

    def skip(self, key: str, seq: int) -> None:
        self._queue(key).skip(key, seq)

    def next_seq(self, key: str) -> int | None:
        return self._queue(key).next_seq(key)

    def waiting(self) -> set[str]:
        return set().union(*(queue.waiting() for queue in self.queues))

    def submit_call(self, call: Callable[[], object], done: Callable[[object], None],
                    fail: Callable[[Exception], None]) -> None:
        """A call of no adapter: on the first replica's thread, between its passes (a call that runs a pass runs
        `trainers[0]`'s, which no other thread runs at the same time)."""
        self.queues[0].submit_call(call, done, fail)

    def start(self) -> "Replicas":
        for queue in self.queues:
            queue.start()
        return self

    def stop(self) -> None:
        for queue in self.queues:
            queue.stop()
