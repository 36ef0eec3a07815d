"""The base layers over several devices of one process (executor/peers.py): the single executor's numbers, for
every layer's calls and a split model's training step (on two GPUs: test_sharded.py); tenants on threads and CUDA
streams of their own get their own results from shared batches."""

from __future__ import annotations

import threading

import pytest
import torch

import symbiosis
from helpers import assert_close, assert_same_step_on
from symbiosis.executor.peers import PeerLayer, on_devices


def _every_call_agrees(ours, theirs, layer_specs, same, device="cpu", dtype=torch.float64):
    torch.manual_seed(0)
    for layer_id, spec in layer_specs.items():
        x = torch.randn(5, spec.in_features, dtype=dtype, device=device)
        g = torch.randn(5, spec.out_features, dtype=dtype, device=device)
        same(ours.forward(layer_id, x), theirs.forward(layer_id, x), layer_id)
        same(ours.forward_nobias(layer_id, x), theirs.forward_nobias(layer_id, x), layer_id)
        same(ours.backward(layer_id, g), theirs.backward(layer_id, g), layer_id)
        same(ours.weight_norms(layer_id), theirs.weight_norms(layer_id), layer_id)
        assert torch.equal(ours.fetch(layer_id)[0], theirs.fetch(layer_id)[0])


@pytest.mark.parametrize("devices, split", [(2, "layers"), (2, "columns"), (3, "columns")])
def test_layers_over_devices_of_one_process_equal_the_single_executor(devices, split, checkpoints):
    path, auto_class = checkpoints("llama")
    single = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    spread = on_devices(path, ["cpu"] * devices, dtype=torch.float64, split=split)
    try:
        assert set(spread.placement.values()) == (set(range(devices)) if split == "layers" else {-1})
        assert spread.layer_specs == single.layer_specs
        if split == "layers":  # whole layers on the other device are PeerLayers, called through the executor
            assert any(isinstance(layer, PeerLayer) for layer in spread.weights.layers.values())
        exact = lambda a, b, what: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=what)  # noqa: E731
        close = lambda a, b, what: assert_close(a, b, what, 1e-12)  # noqa: E731
        same = exact if split == "layers" else close
        _every_call_agrees(spread.attach(spread.fingerprint, "a"), single.attach(single.fingerprint, "a"),
                           single.layer_specs, same)
        # a split model's training step: q/k/v and gate/up grouped (a group on the other device is its own call)
        assert_same_step_on(path, auto_class, [single, spread], "rslora_all_linear", rtol=0 if split == "layers"
                            else 1e-12)
    finally:
        spread.close()
        single.close()


def test_a_gpu_listed_twice_or_missing_is_refused(checkpoints):
    path, _ = checkpoints("llama")
    with pytest.raises(ValueError, match="each GPU once"):
        on_devices(path, ["cuda:0", "cuda:0"])
    missing = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"no GPU cuda:{missing} here"):
        on_devices(path, ["cpu", f"cuda:{missing}"])


@pytest.mark.gpu
@pytest.mark.parametrize("devices", [1, 2])
def test_tenants_on_streams_of_their_own_get_their_own_results_from_shared_batches(devices, checkpoints):
    """Eight threads, each on a CUDA stream of its own, call every layer at once (batched: policy opportunistic),
    each with inputs it writes right before the call: each gets what its call alone gives (float64; a
    GEMM of other rows may sum in another order)."""
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} GPUs")
    path, _ = checkpoints("llama")
    single = symbiosis.Executor.from_pretrained(path, device="cuda:0", dtype=torch.float64)
    executor = on_devices(path, [f"cuda:{i}" for i in range(devices)], dtype=torch.float64) if devices > 1 else \
        symbiosis.Executor.from_pretrained(path, device="cuda:0", dtype=torch.float64)
    sessions = [executor.attach(executor.fingerprint, f"t{i}") for i in range(8)]
    alone = single.attach(single.fingerprint, "alone")
    failures: list[str] = []

    def tenant(i: int) -> None:
        stream = torch.cuda.Stream("cuda:0")
        generator = torch.Generator("cuda:0").manual_seed(i)
        with torch.cuda.stream(stream):
            for _ in range(3):
                for layer_id, spec in executor.layer_specs.items():
                    x = torch.randn(64, spec.in_features, dtype=torch.float64, device="cuda:0", generator=generator)
                    x = x * 2 + 1  # written on this stream right before the call
                    y = sessions[i].forward(layer_id, x)
                    y = y * 1  # read on this stream right after
                    stream.synchronize()
                    if not torch.allclose(y, alone.forward(layer_id, x), rtol=1e-12, atol=1e-12):
                        failures.append(f"tenant {i}, {layer_id}")

    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    executor.close()
    single.close()
    assert not failures, failures[:5]
