"""What one tenant may keep on the service's disk through the Tinker API (serve/tinker/service.py): training
models (never deleted) and checkpoints' bytes. Past either bound the request fails as the tenant's own error, naming
the quota; another tenant is not affected, and deleting checkpoints makes room again. The official `tinker` SDK on
loopback."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import tinker_server

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")

TINKER_KEYS = {"alice": "tml-alice-0123456789abcdef", "bob": "tml-bob-0123456789abcdefgh",
               "carol": "tml-carol-0123456789abcdefg"}


quota_server = tinker_server(TINKER_KEYS, training={"max_models_per_tenant": 2, "max_checkpoint_bytes_per_tenant": 1})


def _client(server, tenant):
    return tinker.ServiceClient(base_url=server.url, api_key=TINKER_KEYS[tenant])


def test_a_tenant_past_its_models_is_refused_and_another_is_not(quota_server):
    alice, bob = _client(quota_server, "alice"), _client(quota_server, "bob")
    first = alice.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1).result()
    alice.create_lora_training_client(base_model="tiny-llama", rank=4, seed=2).result()
    with pytest.raises(tinker.RequestFailedError, match="quota exceeded: you have 2 training models"):
        alice.create_lora_training_client(base_model="tiny-llama", rank=4, seed=3).result()
    path = first.save_state("for-a-copy").result().path
    with pytest.raises(tinker.RequestFailedError, match="quota exceeded"):  # a model made from a checkpoint too
        alice.create_training_client_from_state(path).result()
    bob.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1).result()  # bob's own count
    assert len(quota_server.service.tinker.store.models("alice", 0, 10)[0]) == 2


def test_checkpoints_past_the_bytes_are_refused_until_some_are_deleted(quota_server):
    bob = _client(quota_server, "bob")
    training = bob.create_lora_training_client(base_model="tiny-llama", rank=4, seed=7).result()
    training.save_state("first").result()  # the bound is 1 byte: the first fits (nothing was held)
    with pytest.raises(tinker.RequestFailedError, match="quota exceeded: your checkpoints hold"):
        training.save_state("second").result()
    with pytest.raises(tinker.RequestFailedError, match="quota exceeded"):
        training.save_weights_for_sampler("sampler").result()
    rest = bob.create_rest_client()
    rest.delete_checkpoint(training.model_id, "weights/first").result()
    training.save_state("second").result()  # room again


def test_concurrent_creates_of_one_tenant_pass_its_bound_together_no_more(quota_server, monkeypatch):
    """Creates run on worker threads: each counted the tenant's models and then wrote its own, so all of a burst
    passed a bound that one at a time would stop. The first write is held open until every create has been sent."""
    service = quota_server.service.tinker
    write, sent = service._write, threading.Event()

    def slow_write(*args, **kwargs):
        sent.wait(5)
        time.sleep(0.2)
        return write(*args, **kwargs)

    monkeypatch.setattr(service, "_write", slow_write)
    carol = _client(quota_server, "carol")

    def create(seed):
        try:
            carol.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
            return "made"
        except tinker.RequestFailedError as e:
            assert "quota exceeded" in str(e)
            return "refused"

    with ThreadPoolExecutor(6) as pool:
        outcomes = [pool.submit(create, seed) for seed in range(6)]
        time.sleep(1.0)  # the six requests on their way, some waiting in the first one's write
        sent.set()
        outcomes = sorted(outcome.result(timeout=120) for outcome in outcomes)
    assert outcomes == ["made"] * 2 + ["refused"] * 4
    assert service.store.models("carol", 0, 10)[1] == 2
