"""Hosted training over replicas of the base: each adapter lives on one replica, the replicas' queues run at once,
and every adapter trains as it does alone."""

from __future__ import annotations

import threading

import pytest
import torch

from symbiosis.train import HostedLora, LoraSpec, Work
from symbiosis.train.lora import AdamParams
from symbiosis.train.replicas import Replicas
from symbiosis.train.scheduler import Operation
from symbiosis.train.trainer import Datum
from matrix import make_checkpoint


def _datums(seed: int, count: int = 2, length: int = 7) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    return [Datum(torch.randint(0, 128, (length,), generator=generator).tolist(),
                  {"target_tokens": torch.randint(0, 128, (length,), generator=generator),
                   "weights": torch.ones(length, dtype=torch.float64)}) for _ in range(count)]


def _adapter(trainer, seed: int) -> HostedLora:
    lora = HostedLora(LoraSpec(rank=4, seed=seed), trainer.targets, trainer.device, trainer.dtype)
    with torch.no_grad():
        lora.flat.copy_(torch.randn(lora.flat.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return lora


def _call(replicas, key: str, seq: int, **operation):
    done, outcome = threading.Event(), {}
    replicas.submit(key, Operation(seq, lambda r: (outcome.update(r=r), done.set()),
                                   lambda e: (outcome.update(e=e), done.set()), **operation))
    assert done.wait(60), "no answer"
    if "e" in outcome:
        raise outcome["e"]
    return outcome["r"]


TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="two GPUs")


@pytest.mark.parametrize("devices", [("cpu", "cpu"), pytest.param(("cuda:0", "cuda:1"), marks=[pytest.mark.gpu,
                                                                                              TWO_GPUS])])
def test_adapters_spread_over_replicas_train_as_each_alone(tmp_path, devices):
    make_checkpoint("llama", tmp_path)
    replicas = Replicas.on_devices(tmp_path, list(devices), dtype=torch.float64, max_pass_tokens=4096).start()
    # (on the replicas' first device: the rotary embeddings are made in float32, whose sin and cos differ in
    # their last bits between a CPU and a GPU)
    alone = Replicas.on_devices(tmp_path, [devices[0]], dtype=torch.float64).trainers[0]
    assert [str(t.device) for t in replicas.trainers] == list(devices)
    try:
        keys = [f"tenant-{i}" for i in range(4)]
        homes = [replicas.place(key) for key in keys]
        assert [replicas.homes[key] for key in keys] == [0, 1, 0, 1]  # the replica with the fewest adapters
        assert replicas.place(keys[0]) is homes[0]  # kept
        loras = [_adapter(trainer, i) for i, trainer in enumerate(homes)]
        references = [_adapter(alone, i) for i in range(len(keys))]
        losses: dict = {}

        def tenant(i: int) -> None:  # two steps of forward_backward + optim_step, as a training loop sends them
            replicas.open(keys[i], 0)
            for step in range(2):
                result = _call(replicas, keys[i], 2 * step, work=Work(loras[i], _datums(10 * i + step),
                                                                      "cross_entropy"))
                losses[(i, step)] = result.losses
                _call(replicas, keys[i], 2 * step + 1, call=lambda metrics: metrics,
                      step=(loras[i], AdamParams(0.05)))

        threads = [threading.Thread(target=tenant, args=(i,)) for i in range(len(keys))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert all(queue.passes > 0 for queue in replicas.queues)  # both replicas trained
        for i, reference in enumerate(references):
            for step in range(2):
                result = alone.run([Work(reference, _datums(10 * i + step), "cross_entropy")])[0]
                assert losses[(i, step)] == pytest.approx(result.losses, rel=1e-10)
                reference.step(learning_rate=0.05)
            torch.testing.assert_close(loras[i].flat.cpu(), reference.flat.cpu(), rtol=1e-9, atol=1e-12)
    finally:
        replicas.stop()


def test_an_adapter_never_placed_is_refused_and_a_closed_one_is_forgotten(tmp_path):
    make_checkpoint("llama", tmp_path)
    replicas = Replicas.on_devices(tmp_path, ["cpu", "cpu"], dtype=torch.float64)
    with pytest.raises(KeyError, match="never placed"):
        replicas.open("nobody", 0)
    replicas.place("a")
    replicas.open("a", 0)
    replicas.close("a")
    assert "a" not in replicas.homes
    for devices, problem in ((["cpu", "gpu7"], "'gpu7' is not a device"), (["cuda:99"], "no GPU cuda:99 here"),
                             (["cuda"], "no GPU cuda here"), (["meta"], "runs on CPUs and CUDA GPUs"),
                             (["cuda:0", "cuda:0"], "each GPU once")):
        with pytest.raises(ValueError, match=problem):
            Replicas.on_devices(tmp_path, devices)
