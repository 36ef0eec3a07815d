"""The Tinker API of `symbiosis serve`, driven by the official `tinker` SDK on loopback: a supervised loop whose
first loss is plain transformers' (float64), sampling from the trained adapter (its greedy tokens plain PEFT's, and
the same checkpoint as an OpenAI `model`), save/load round trips with optimizer state, two tenants training at
once who cannot see each other's runs, bad requests answered as the SDK's errors."""

from __future__ import annotations

import json
import math
import os
import threading
import time

import openai
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import start_with_tinker_keys

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

TINKER_KEYS = {"alice": "tml-alice-0123456789abcdef", "bob": "tml-bob-0123456789abcdef"}
TEXT = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree."


@pytest.fixture(scope="module", params=["one_process", "fronts"])
def training_server(request, served_files, tmp_path_factory):
    """Every test here runs with the service's HTTP in its own process and behind a front (`--http-processes`)."""
    # two trainers (`--train-devices cpu,cpu`: a base copy each), the training models placed on both: every test
    # here runs across them
    running = start_with_tinker_keys(served_files, tmp_path_factory, TINKER_KEYS, fronts=request.param == "fronts",
                                     training={"devices": ["cpu", "cpu"]})
    yield running
    running.stop()


def _client(server, tenant="alice"):
    return tinker.ServiceClient(base_url=server.url, api_key=TINKER_KEYS[tenant])


def _datum(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    weights = [0.0] * 3 + [1.0] * (len(ids) - 4)  # the first tokens as a prompt: not trained on
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}), ids, weights


def test_a_supervised_loop_starts_at_plain_transformers_loss_and_learns(training_server, served_files):
    service = _client(training_server)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=1).result()
    tokenizer = training.get_tokenizer()
    datum, ids, weights = _datum(tokenizer, TEXT)
    plain = AutoModelForCausalLM.from_pretrained(served_files["model"], dtype=torch.float64)
    with torch.no_grad():  # LoRA's B starts at zero: the first loss is the base model's
        logprobs = plain(torch.tensor([ids[:-1]])).logits[0].log_softmax(-1)
    expected = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    losses = []
    for step in range(6):
        result = training.forward_backward([datum], "cross_entropy").result()
        if step == 0:
            assert result.metrics["loss:sum"] == pytest.approx(float(-(expected * torch.tensor(weights)).sum()), rel=1e-9)
            torch.testing.assert_close(result.loss_fn_outputs[0]["logprobs"].to_torch().double(), expected.float().double(),
                                       rtol=1e-6, atol=1e-6)
        losses.append(result.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert losses[-1] < 0.8 * losses[0], losses
    service.close("success")


def test_sampling_from_the_trained_adapter_gives_plain_peft_greedy_tokens(training_server, served_files):
    service = _client(training_server)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=8, seed=2, train_unembed=False).result()
    datum, ids, _ = _datum(training.get_tokenizer(), TEXT)
    for _ in range(3):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2))
    path = training.save_weights_for_sampler("greedy").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    prompt = ids[:6]
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, temperature=0.0,
                                                                                        stop=[])).result()
    directory = training_server.service.tinker.resolve("alice", path)[1]
    plain = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(served_files["model"], dtype=torch.float64),
                                           directory)
    expected = plain.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert [s.tokens for s in result.sequences] == [expected, expected]
    assert all(s.stop_reason == "length" for s in result.sequences)
    direct = training.save_weights_and_get_sampling_client()  # the same weights, without naming them
    assert direct.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(
        max_tokens=6, temperature=0.0, stop=[])).result().sequences[0].tokens == expected
    with torch.no_grad():  # compute_logprobs: the prompt's log-probabilities under the adapter
        logits = plain(torch.tensor([prompt])).logits[0].log_softmax(-1)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert scored[0] is None
    torch.testing.assert_close(torch.tensor(scored[1:], dtype=torch.float64),
                               logits[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], rtol=1e-6, atol=1e-6)
    # the checkpoint is an OpenAI `model` of its tenant at once, and nobody else's
    openai_client = training_server.client("alice")
    completion = openai_client.completions.create(model=path, prompt=prompt, max_tokens=6, temperature=0)
    assert completion.choices[0].text == training_server.service.tokenizer.decode(expected, skip_special_tokens=True)
    with pytest.raises(openai.NotFoundError):
        training_server.client("bob").completions.create(model=path, prompt=prompt, max_tokens=2)
    service.close("success")


def test_requests_sent_behind_a_load_train_the_loaded_state(training_server, monkeypatch):
    """load_state, then a forward_backward and an optimizer step sent before the load has run: they train the
    loaded state, as when the load is awaited first. (They were bound to the state the load replaced: their
    gradients and step went to a discarded copy, with no error.)"""
    service, tinker_api = _client(training_server), training_server.service.tinker
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=5).result()
    datum, _, _ = _datum(training.get_tokenizer(), TEXT)
    adam = types.AdamParams(learning_rate=5e-3)

    def step():
        training.forward_backward([datum], "cross_entropy")
        return training.optim_step(adam)
    step().result()
    path = training.save_state("behind-a-load").result().path
    step().result()  # moves on from the checkpoint
    training.load_state(path).result()  # the reference: the load awaited, then a step
    expected = step().result().metrics["grad_norm:mean"]
    expected_loss = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]

    load_into, model = tinker_api.load_into, training.model_id
    queue = tinker_api.queue._queue(model)  # (the model's trainer's: two here)

    def after_the_next_request(*args):  # the load runs once the model's next request waits in its queue
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with queue._lock:
                if any(seq > queue._next[model] for seq in queue._queues.get(model, {})):
                    break
            time.sleep(0.01)
        return load_into(*args)
    monkeypatch.setattr(tinker_api, "load_into", after_the_next_request)
    loaded = training.load_state(path)
    stepped = step()
    loaded.result()
    assert stepped.result().metrics["grad_norm:mean"] == pytest.approx(expected, rel=1e-12)
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(expected_loss,
                                                                                                      rel=1e-12)


def test_save_and_load_state_carry_the_adapter_and_its_optimizer(training_server):
    service = _client(training_server)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=3).result()
    datum, _, _ = _datum(training.get_tokenizer(), TEXT)
    adam = types.AdamParams(learning_rate=5e-3)
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(adam)
    path = training.save_state("after-two").result().path
    assert path.endswith("/weights/after-two")
    saved_loss = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    with_optimizer = service.create_training_client_from_state_with_optimizer(path).result()
    without = service.create_training_client_from_state(path).result()
    losses = []
    for client in (training, with_optimizer, without):  # one more step each, from the same state
        client.forward_backward([datum], "cross_entropy")
        client.optim_step(adam).result()
        losses.append(client.forward([datum], "cross_entropy").result().metrics["loss:sum"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-12), "the optimizer state came back with the weights"
    assert losses[2] != pytest.approx(losses[0], rel=1e-6), "fresh AdamW moments take another step"
    training.load_state(path).result()  # back to the checkpoint, in place
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(saved_loss, rel=1e-12)
    rest = service.create_rest_client()
    checkpoints = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.checkpoint_id for c in checkpoints] == ["weights/after-two"]
    rest.delete_checkpoint(training.model_id, "weights/after-two").result()
    assert rest.list_checkpoints(training.model_id).result().checkpoints == []
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        service.create_training_client_from_state(path).result()
    service.close("success")


def test_two_tenants_train_at_once_and_see_only_their_own(training_server):
    outcomes = {}

    def train(tenant, seed):
        service = _client(training_server, tenant)
        training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
        datum, _, _ = _datum(training.get_tokenizer(), TEXT if tenant == "alice" else TEXT[::-1])
        futures = []
        for _ in range(4):
            futures.append(training.forward_backward([datum], "cross_entropy"))
            training.optim_step(types.AdamParams(learning_rate=5e-3))
        losses = [f.result().metrics["loss:sum"] for f in futures]
        outcomes[tenant] = (training.model_id, training.save_state("mine").result().path, losses)
        service.close("success")

    threads = [threading.Thread(target=train, args=(tenant, seed)) for seed, tenant in enumerate(TINKER_KEYS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert set(outcomes) == {"alice", "bob"}
    for _, _, losses in outcomes.values():
        assert losses[-1] < losses[0]
    replicas = training_server.service.training_queue
    assert len(replicas.trainers) == 2 and set(replicas.homes.values()) == {0, 1}  # models on both trainers
    assert all(queue.passes > 0 for queue in replicas.queues)
    bob = _client(training_server, "bob")
    alice_model, alice_path, _ = outcomes["alice"]
    rest = bob.create_rest_client()
    assert alice_model not in [run.training_run_id for run in rest.list_training_runs(limit=100).result().training_runs]
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(alice_model).result()
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        bob.create_training_client_from_state(alice_path).result()
    bob.close("success")


def test_bad_requests_are_the_sdks_errors(training_server):
    service = _client(training_server)
    with pytest.raises(tinker.BadRequestError, match="trains 'tiny-llama' only"):
        service.create_lora_training_client(base_model="someone/else", rank=4).result()
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    datum, ids, _ = _datum(training.get_tokenizer(), TEXT)
    with pytest.raises(tinker.RequestFailedError, match="not supported") as failed:
        training.forward_backward([datum], "dro").result()
    assert failed.value.category == types.RequestErrorCategory.User
    outside = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                          loss_fn_inputs={"target_tokens": [10_000] * (len(ids) - 1), "weights": [1.0] * (len(ids) - 1)})
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        training.forward_backward([outside], "cross_entropy").result()
    short = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:3]})
    with pytest.raises(tinker.RequestFailedError, match="target_tokens of shape"):
        training.forward_backward([short], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="beta1 must be below 1") as failed:
        training.optim_step(types.AdamParams(learning_rate=1e-3, beta1=1.5)).result()
    assert failed.value.category == types.RequestErrorCategory.User
    # the model goes on after its failed requests
    assert training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
    assert "grad_norm:mean" in training.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics
    service.close("success")


def test_a_malformed_sampling_prompt_and_a_sampler_save_without_its_seq_are_refused_before_anything_runs(
        training_server):
    """Prompts not shaped as chunks of tokens were server errors; a sampler save without its sampling session's seq
    wrote the checkpoint (counted against the tenant's quota) before the missing field failed the request."""
    from conftest import httpx

    service = _client(training_server)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=6).result()
    url, headers = training_server.url + "/api/v1/", {"X-API-Key": TINKER_KEYS["alice"]}
    for prompt in ([1, 2], "abc", 5, {"chunks": [{"type": "encoded_text", "tokens": 5}]},
                   {"chunks": [{"type": "encoded_text", "tokens": None}]},
                   {"chunks": [{"type": "encoded_text", "tokens": [True, 1]}]}):
        refused = httpx.post(url + "asample", headers=headers, json={"prompt": prompt, "num_samples": 1,
                                                                      "sampling_params": {}, "seq_id": 1})
        assert refused.status_code == 400 and "prompt" in refused.json()["error"], (prompt, refused.text)
    checkpoints = len(training_server.service.tinker.store.checkpoints("alice"))
    refused = httpx.post(url + "save_weights_for_sampler", headers=headers,
                         json={"model_id": training.model_id, "seq_id": 1})
    assert refused.status_code == 400 and "sampling_session_seq_id" in refused.json()["error"], refused.text
    assert len(training_server.service.tinker.store.checkpoints("alice")) == checkpoints


def test_a_resubmitted_request_gets_the_first_ones_answer_and_runs_once(training_server):
    """The SDK retries a submission with the same seq_id (and a new idempotency key): it is one request."""
    from conftest import httpx

    service = _client(training_server)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=4).result()
    datum, _, _ = _datum(training.get_tokenizer(), TEXT)
    training.forward_backward([datum], "cross_entropy").result()  # seq 1
    headers = {"X-API-Key": TINKER_KEYS["alice"]}
    body = {"model_id": training.model_id, "seq_id": 2, "type": "optim_step",
            "adam_params": {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                            "grad_clip_norm": 0.0}}
    first = httpx.post(training_server.url + "/api/v1/optim_step", json=body, headers=headers).json()
    again = httpx.post(training_server.url + "/api/v1/optim_step", json=body, headers=headers).json()
    assert first["request_id"] == again["request_id"]
    answer = httpx.post(training_server.url + "/api/v1/retrieve_future", json={"request_id": first["request_id"]},
                        headers=headers, timeout=60).json()
    assert "metrics" in answer
    assert training_server.service.tinker.loras[training.model_id].steps == 1, "the step ran once"
    # a request of another kind under a seq_id used already is refused: it got the first one's answer (an
    # optim_step at seq_id 0 the model's create_model; a save_weights an optim_step's metrics, nothing saved)
    for route, reused in (("optim_step", {**body, "seq_id": 0}),
                          ("save_weights", {"model_id": training.model_id, "seq_id": 2, "path": "mine"})):
        refused = httpx.post(training_server.url + "/api/v1/" + route, json=reused, headers=headers)
        assert refused.status_code == 400 and "needs a seq_id of its own" in refused.json()["error"], refused.text
    # another tenant's request id is not found
    other = httpx.post(training_server.url + "/api/v1/retrieve_future", json={"request_id": first["request_id"]},
                       headers={"X-API-Key": TINKER_KEYS["bob"]})
    assert other.status_code == 404
    service.close("success")


def test_a_diverged_model_gets_its_non_finite_loss_not_a_server_error(training_server):
    """A learning rate far too large makes the loss inf or NaN: the tenant gets that loss (JSON's NaN/Infinity,
    which the SDK's parser reads), not a 500 from re-encoding it as strict JSON."""
    service = _client(training_server)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=3).result()
    datum, _, _ = _datum(training.get_tokenizer(), TEXT)
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e30)).result()
    result = training.forward_backward([datum], "cross_entropy").result()
    assert not math.isfinite(result.metrics["loss:sum"])
    stepped = training.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # its gradients are not finite
    assert not math.isfinite(stepped.metrics["grad_norm:mean"])
    service.close("success")


def test_the_training_loops_plain_routes_refuse_bad_requests_as_the_other_routes_do(training_server, caplog,
                                                                                    monkeypatch):
    """retrieve_future, forward_backward and optim_step are answered before FastAPI (app.PlainRoutes): their
    errors are still the API's ({"error", "detail"} with a status the SDK does not retry), their access-log line
    names the tenant, and an unexpected failure is a logged 500 that leaves the service answering."""
    from conftest import httpx

    url, alice = training_server.url + "/api/v1/", {"X-API-Key": TINKER_KEYS["alice"]}
    cases = [("retrieve_future", {}, b'{"request_id": "x"}', 401, "invalid API key"),
             ("retrieve_future", alice, b"not json", 400, "not JSON"),
             ("retrieve_future", alice, b"[1, 2]", 400, "not a JSON object"),
             ("retrieve_future", alice, b'{"request_id": "nobody-s"}', 404, "no request"),
             ("optim_step", alice, b'{"model_id": "m", "seq_id": 1}', 400, "adam_params"),
             ("optim_step", alice, b'{"model_id": "m", "seq_id": "1", "adam_params": {}}', 400, "seq_id must be"),
             # (these were server errors, which the SDK retries)
             ("optim_step", alice, b'{"model_id": "m", "seq_id": ' + str(2**70).encode() + b', "adam_params": {}}',
              400, "seq_id must be"),
             ("retrieve_future", alice, b"[" * 100_000 + b"]" * 100_000, 400, "nested too deep"),
             ("create_model", alice, b'{"session_id": "s", "model_seq_id": 0, "lora_config": [1]}', 400,
              "lora_config must be a JSON object"),
             ("create_model", alice, b'{"session_id": "s", "model_seq_id": 0, "optimizer_config": "adamw"}', 400,
              "optimizer_config must be a JSON object"),
             # (a rank of 2.9 was taken as 2, "false" as true)
             ("create_model", alice, b'{"session_id": "s", "model_seq_id": 0, "lora_config": {"rank": 2.9}}', 400,
              "rank and seed are integers"),
             ("create_model", alice, b'{"session_id": "s", "model_seq_id": 0, "lora_config": {"train_attn": "false"}}',
              400, "booleans"),
             ("forward_backward", alice, b"\xff\x00 not a protobuf", 400, ""),
             ("forward_backward", {**alice, "Content-Encoding": "zstd"}, b"", 400, "uncompressed")]
    with caplog.at_level("INFO", logger="symbiosis.serve.access"):
        for route, headers, body, status, message in cases:
            response = httpx.post(url + route, content=body, headers=headers)
            assert response.status_code == status, (route, body, response.text)
            assert message in response.json()["error"] and response.headers["x-request-id"]
        too_big = httpx.post(url + "optim_step", content=b"{" + b" " * (9 << 20) + b"}", headers=alice)
        assert too_big.status_code == 413
        for listing in ("training_runs", "checkpoints"):  # an offset past SQLite's integers was a server error
            assert httpx.get(url + f"{listing}?offset={2**70}", headers=alice).status_code == 200
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "symbiosis.serve.access"]
    assert {(line["path"], line["tenant"]) for line in lines if line["status"] == 404} == \
        {("/api/v1/retrieve_future", "alice")}

    def broken(*_):
        raise RuntimeError("the database went away")
    monkeypatch.setattr(training_server.service.tinker.store, "request", broken)
    with caplog.at_level("ERROR", logger="symbiosis.serve"):
        failed = httpx.post(url + "retrieve_future", json={"request_id": "x"}, headers=alice)
    assert failed.status_code == 500 and "logged" in failed.json()["error"]["message"]
    assert any("unexpected error on /api/v1/retrieve_future" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert httpx.post(url + "retrieve_future", json={"request_id": "x"}, headers=alice).status_code == 404


def test_a_tenant_cannot_pile_up_pending_requests(training_server, monkeypatch):
    """Requests whose seq_id never comes stay pending: past the tenant's bound a new one is refused with 429 and
    Retry-After (the SDK waits and retries), another tenant's go on, and the refused tenant's answered requests
    make room again."""
    from conftest import httpx
    from symbiosis.serve.tinker import service as tinker_service

    monkeypatch.setattr(tinker_service, "MAX_PENDING_PER_TENANT", 3)
    alice = _client(training_server).create_lora_training_client(base_model="tiny-llama", rank=4).result()
    url, headers = training_server.url + "/api/v1/", {"X-API-Key": TINKER_KEYS["alice"]}
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}

    def step(seq_id):
        return httpx.post(url + "optim_step", json={"model_id": alice.model_id, "seq_id": seq_id, "adam_params": adam},
                          headers=headers)
    waiting = [step(1000 + i) for i in range(3)]  # seq 1 never comes: these wait for ever
    assert all(r.status_code == 200 for r in waiting)
    refused = step(2000)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "3 requests pending" in refused.json()["error"]
    bob = _client(training_server, "bob").create_lora_training_client(base_model="tiny-llama", rank=4).result()
    datum, _, _ = _datum(bob.get_tokenizer(), TEXT)
    assert bob.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
    monkeypatch.setattr(tinker_service, "MAX_PENDING_PER_TENANT", 4)  # room for one: it is answered and frees it
    assert alice.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
    assert alice.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0


def test_old_answers_are_pruned_but_each_models_newest_and_an_old_seq_id_is_refused_not_queued(training_server,
                                                                                               monkeypatch):
    """Answered requests older than keep_answers_s are deleted (at start and every PRUNE_EVERY_S, on a thread of
    their own), all but each model's newest: its seq_id is where the model's queue goes on after a restart. A
    resubmitted seq_id whose answer was pruned fails as the user's error; it does not wait in the queue for ever."""
    import time

    from conftest import httpx
    from symbiosis.serve.tinker import service as tinker_service

    tinker_api, store = training_server.service.tinker, training_server.service.tinker.store
    service = _client(training_server)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    datum, _, _ = _datum(training.get_tokenizer(), TEXT)
    for _ in range(3):
        training.forward_backward([datum], "cross_entropy").result()
    model = training.model_id

    def seqs():
        return sorted(row["seq_id"] for row in store._query("SELECT seq_id FROM tinker_requests WHERE owner = ?",
                                                            (model,)))
    assert seqs() == [0, 1, 2, 3]  # create_model's, then three forward_backward
    store._change("UPDATE tinker_requests SET finished = finished - ? WHERE owner = ?",
                  (2 * tinker_api.keep_answers_s, model))
    monkeypatch.setattr(tinker_service, "PRUNE_EVERY_S", 0.0)  # the next submission prunes, on its own thread
    assert training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0  # seq 4
    deadline = time.monotonic() + 30
    while seqs() != [4] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seqs() == [4]
    store._change("UPDATE tinker_requests SET finished = finished - ? WHERE owner = ?",
                  (2 * tinker_api.keep_answers_s, model))
    assert store.prune(tinker_api.keep_answers_s) == 0 and seqs() == [4]  # the newest stays, however old
    headers = {"X-API-Key": TINKER_KEYS["alice"]}
    body = {"model_id": model, "seq_id": 2, "type": "optim_step",  # seq 2's answer was pruned
            "adam_params": {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                            "grad_clip_norm": 0.0}}
    pending = tinker_api._pending_of.get("alice", 0)  # (an earlier test's requests wait for ever)
    submitted = httpx.post(training_server.url + "/api/v1/optim_step", json=body, headers=headers)
    assert submitted.status_code == 200, submitted.text
    answer = httpx.post(training_server.url + "/api/v1/retrieve_future",
                        json={"request_id": submitted.json()["request_id"]}, headers=headers, timeout=60).json()
    assert answer["category"] == "user" and "no longer kept" in answer["error"], answer
    assert tinker_api._pending_of.get("alice", 0) == pending, "the refused request is not left pending"
    assert training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0  # seq 5 goes on
    service.close("success")
