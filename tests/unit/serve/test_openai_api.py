"""OpenAI's inference API of `symbiosis serve`, driven by the official `openai` client against a real server on
loopback: models, completions and chat (streaming or not) equal to plain transformers + PEFT, tenants' adapters
kept apart, errors as the client's exception classes, overload, cancellation, metrics and usage."""

from __future__ import annotations

import json
import threading
import time

import openai
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import KEYS, httpx, load, start

PROMPTS = ["the cat sees", "my sister finds a red ball", "roses are"]
LONG_RUNNING = "my sister finds a red ball"  # the tiny random model's greedy answer never ends with </s>


def plain_generate(files, adapter: str | None, ids: list[int], new_tokens: int):
    """(new token ids, their log-probabilities) from transformers (+ PEFT), greedy, float64."""
    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float64, experts_implementation="eager")
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, files["adapters"] / adapter)
    sequence = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    new = sequence[0, len(ids):].tolist()
    with torch.no_grad():  # generate() hands its scores out in float32: the log-probabilities again, in float64
        logits = model(sequence).logits[0, len(ids) - 1:-1]
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(new)[:, None])[:, 0].tolist()
    return new, logprobs


@pytest.fixture(scope="module", params=["one_process", "fronts"])
def loaded(request, served_files, tmp_path_factory):
    """The service with three adapters loaded: its HTTP in its own process, and in a front (serve/front.py) that
    forwards each request to it (`symbiosis serve --http-processes`): every test that uses it runs on both."""
    server = start(served_files, tmp_path_factory.mktemp("state"), fronts=request.param == "fronts")
    for tenant, name, path in (("alice", "poet", "alice/poet"), ("alice", "counter", "alice/counter"),
                               ("bob", "writer", "bob/writer")):
        assert load(server, tenant, name, path).status_code == 200
    yield server
    server.stop()


def test_models_list_the_base_and_only_the_callers_adapters(loaded):
    alice = {m.id: m for m in loaded.client("alice").models.list().data}
    bob = {m.id: m for m in loaded.client("bob").models.list().data}
    assert set(alice) == {"tiny-llama", "poet", "counter"} and set(bob) == {"tiny-llama", "writer"}
    assert alice["tiny-llama"].model_extra["parent"] is None
    assert alice["poet"].model_extra["parent"] == "tiny-llama"
    assert loaded.client("alice").models.retrieve("poet").id == "poet"
    with pytest.raises(openai.NotFoundError) as other:
        loaded.client("bob").models.retrieve("poet")
    with pytest.raises(openai.NotFoundError) as nowhere:
        loaded.client("bob").models.retrieve("no-such-model")
    assert str(other.value).replace("poet", "X") == str(nowhere.value).replace("no-such-model", "X")


@pytest.mark.parametrize("model, adapter", [("tiny-llama", None), ("poet", "alice/poet"), ("counter", "alice/counter")])
def test_greedy_completions_equal_plain_transformers_and_peft(loaded, served_files, model, adapter):
    tokenizer = AutoTokenizer.from_pretrained(served_files["model"])
    result = loaded.client("alice").completions.create(model=model, prompt=PROMPTS, max_tokens=8, temperature=0,
                                                       logprobs=2)
    assert [c.index for c in result.choices] == [0, 1, 2]
    completion_tokens = 0
    for prompt, choice in zip(PROMPTS, result.choices):
        ids = tokenizer(prompt)["input_ids"]
        expected, logprobs = plain_generate(served_files, adapter, ids, 8)
        assert choice.text == tokenizer.decode(expected, skip_special_tokens=True), (choice.logprobs.tokens, expected)
        assert choice.logprobs.token_logprobs == pytest.approx(logprobs, rel=1e-9, abs=1e-9)
        assert len(choice.logprobs.top_logprobs[0]) == 2
        assert choice.finish_reason == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")
        completion_tokens += len(expected)
    assert result.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert result.usage.completion_tokens == completion_tokens


def test_chat_uses_the_template_and_streams_the_same_text(loaded, served_files):
    tokenizer = AutoTokenizer.from_pretrained(served_files["model"])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    client = loaded.client("alice")
    reply = client.chat.completions.create(model="poet", messages=messages, max_tokens=10, temperature=0)
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]
    expected, _ = plain_generate(served_files, "alice/poet", ids, 10)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="poet", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason


def test_an_adapter_with_its_own_chat_template_is_rendered_with_it(loaded, served_files):
    import shutil

    tokenizer = AutoTokenizer.from_pretrained(served_files["model"])
    directory = served_files["adapters"] / "alice" / "templated"
    if not directory.exists():
        shutil.copytree(served_files["adapters"] / "alice" / "poet", directory)
    template = "{{ bos_token }}question : {% for m in messages %}{{ m['content'] }} {% endfor %}answer :"
    (directory / "chat_template.jinja").write_text(template)
    assert load(loaded, "alice", "templated", "alice/templated").status_code == 200
    messages = [{"role": "user", "content": "the cat"}]
    reply = loaded.client("alice").chat.completions.create(model="templated", messages=messages, max_tokens=6,
                                                           temperature=0)
    ids = tokenizer(tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)["input_ids"]
    assert reply.usage.prompt_tokens == len(ids)
    expected, _ = plain_generate(served_files, "alice/templated", ids, 6)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_raw_event_stream_ends_with_done(loaded):
    with httpx.stream("POST", loaded.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS['bob']}"},
                      json={"model": "writer", "prompt": "the cat", "max_tokens": 3, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_a_finished_requests_objects_are_freed_without_the_cyclic_collector(loaded):
    """Answers, streams and several choices, directly and through a front: once answered, nothing of an HTTP
    request's generation (its choices, tokens, the engine's requests) waits in a reference cycle for the cyclic
    collector, whose collections stop every thread (the engine's sink held its generation, which held the engine's
    requests: ~37 objects a request did)."""
    import gc

    from symbiosis.engine.engine import Token
    from symbiosis.engine.scheduler import Request
    from symbiosis.serve.generation import Choice, Generation

    client = loaded.client("alice")
    client.completions.create(model="poet", prompt="the cat", max_tokens=4)  # (first use: the adapter read)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(3):
            client.completions.create(model="poet", prompt="the cat", max_tokens=4, n=2, logprobs=1)
            list(client.chat.completions.create(model="counter", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, stream=True))
        time.sleep(0.2)  # (the server's side of the last answer let go)
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, (Generation, Choice, Token, Request))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic == []


def test_seeded_sampling_repeats_and_n_gives_distinct_choices(loaded):
    client = loaded.client("alice")
    ask = dict(model="tiny-llama", prompt="the farmer", max_tokens=12, temperature=1.0, seed=7, n=3)
    first, second = client.completions.create(**ask), client.completions.create(**ask)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(loaded.service.model_path)("the farmer")["input_ids"])


def test_streams_of_several_choices_carry_each_choices_text_finish_and_usage(loaded):
    """Behind a front, tokens are relayed and their chunks written by the front (bridge.py): the same texts,
    finish reasons and usage as the answer that is not streamed."""
    client = loaded.client("alice")
    for create, text in ((client.completions.create, lambda c: c.text),
                         (client.chat.completions.create, lambda c: c.message.content)):
        ask = dict(model="poet", max_tokens=9, temperature=1.0, seed=11, n=2)
        ask.update(prompt="the farmer") if create == client.completions.create else \
            ask.update(messages=[{"role": "user", "content": "the farmer"}])
        whole = create(**ask)
        chunks = list(create(**ask, stream=True, stream_options={"include_usage": True}))
        texts, finishes = ["", ""], [None, None]
        for chunk in chunks[:-1]:
            for choice in chunk.choices:
                piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
                texts[choice.index] += piece
                finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        assert texts == [text(c) for c in whole.choices]
        assert finishes == [c.finish_reason for c in whole.choices]
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_with_wake_ups_deferred_streams_and_answers_are_the_same(loaded, monkeypatch):
    """The engine's `defer_wakeups` (the loop woken once a step, before the engine waits for the device): the same
    text streamed and not, and nothing left undelivered when the engine goes idle."""
    client = loaded.client("alice")
    ask = dict(model="poet", prompt="the cat sees", max_tokens=10, temperature=0)
    plain = client.completions.create(**ask).choices[0].text
    monkeypatch.setattr(loaded.service.engine, "defer_wakeups", True)
    assert client.completions.create(**ask).choices[0].text == plain
    assert "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True)) == plain


def test_a_generation_that_fails_midway_ends_its_stream_with_an_error_event(loaded, monkeypatch):
    from symbiosis.engine import Finished, GenerationError, Token

    class Failing:  # three tokens, then the failure the engine reports for NaN logits
        def submit(self, prompt, params, adapter=None, events=None, owner=None):
            for i in range(3):
                events.put(Token(id=5, text=f" t{i}"))
            events.put(Finished(None, GenerationError("the model's logits are NaN", retryable=False)))
            return self

        def cancel(self):
            pass
    monkeypatch.setattr(loaded.service, "generator_for", lambda adapter: Failing())
    pieces = []
    with pytest.raises(openai.APIError, match="NaN"):
        for chunk in loaded.client("alice").completions.create(model="tiny-llama", prompt="the cat", max_tokens=5,
                                                                stream=True):
            pieces.append(chunk.choices[0].text)
    assert pieces == [" t0", " t1", " t2"]
    assert loaded.service.admission.running["alice"] == 0  # the stream left admission


def test_a_relay_that_fails_ends_its_stream_with_a_server_error_and_no_other(loaded, monkeypatch):
    """Behind a front, a failure while relaying one stream's token (a bug, logged) ends that stream with a server
    error event; the streams whose events came in the same bunch go on whole."""
    from symbiosis.engine import Finished, Token
    from symbiosis.serve import bridge

    if loaded.stop_host is None:
        pytest.skip("relaying is the front's")

    class AtOnce:  # every request's tokens at its submission: several requests' events in one bunch
        def submit(self, prompt, params, adapter=None, events=None, owner=None):
            for i in range(4):
                events.put(Token(id=5, text=" boom" if prompt[0] == 13 and i == 2 else f" t{i}"))
            events.put(Finished("length"))
            return self

        def cancel(self):
            pass
    chunk = bridge._Exchange.chunk

    def failing(self, index, text):
        if text == " boom":
            raise RuntimeError("a bug")
        chunk(self, index, text)
    monkeypatch.setattr(bridge._Exchange, "chunk", failing)
    monkeypatch.setattr(loaded.service, "generator_for", lambda adapter: AtOnce())
    client, results = loaded.client("alice"), {}

    def stream(name, prompt):
        try:
            results[name] = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny-llama", prompt=prompt, max_tokens=4, stream=True))
        except openai.APIError as e:
            results[name] = e
    threads = [threading.Thread(target=stream, args=(f"s{i}", [13 if i == 0 else 14, 5])) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert isinstance(results["s0"], openai.APIError) and "failed to stream" in str(results["s0"])
    assert all(results[f"s{i}"] == " t0 t1 t2 t3" for i in range(1, 6))


def test_a_relayed_token_chunk_is_the_chunk_the_service_writes():
    """A front writes a token's chunk from (prefix, middle, suffix) and the token's text (bridge.py): byte for byte
    what the service writes itself, for texts that JSON escapes."""
    from types import SimpleNamespace

    from symbiosis.engine import Token
    from symbiosis.serve.openai_api import _Chunks

    service = SimpleNamespace(fingerprint="fp_0123")
    for chat in (False, True):
        chunks = _Chunks(service, SimpleNamespace(model="m", logprobs=None if not chat else False), chat)
        prefix, middle, suffix = (part.encode() for part in chunks.token_format())
        for index, text in ((0, " plain"), (3, 'a "quote" \\ and \n'), (1, "caf\u00e9 \u2603")):
            written = chunks.token(SimpleNamespace(index=index), Token(id=1, text=text))
            assert prefix + str(index).encode() + middle + json.dumps(text).encode() + suffix == written
            assert json.loads(written[len(b"data: "):])["choices"][0]["index"] == index


def test_errors_come_as_the_clients_exception_classes(loaded):
    alice, bob = loaded.client("alice"), loaded.client("bob")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=loaded.url + "/v1", api_key="wrong-key-0123456789", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as foreign:
        bob.completions.create(model="poet", prompt="hi", max_tokens=2)
    assert foreign.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long:
        alice.completions.create(model="tiny-llama", prompt="the cat " * 200, max_tokens=2)
    assert long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as temperature:
        alice.completions.create(model="tiny-llama", prompt="hi", temperature=3.0)
    assert temperature.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        alice.completions.create(model="tiny-llama", prompt="hi", extra_body={"best_of": 3})
    with pytest.raises(openai.BadRequestError):
        alice.completions.create(model="tiny-llama", prompt="hi", echo=True)
    with pytest.raises(openai.BadRequestError):
        alice.completions.create(model="tiny-llama", prompt=[[1, 10**9]], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as top:  # (was answered without any log-probabilities)
        alice.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      top_logprobs=2)
    assert top.value.body["param"] == "top_logprobs"
    response = httpx.post(loaded.url + "/v1/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {KEYS['alice']}", "content-type": "application/json"})
    assert response.status_code == 400 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    huge = httpx.post(loaded.url + "/v1/completions", content=b"x" * (9 << 20),
                      headers={"Authorization": f"Bearer {KEYS['alice']}", "content-type": "application/json"})
    assert huge.status_code == 413
    # without its length (chunked): found while the route parses it, and answered 413 too, not 400
    chunked = httpx.post(loaded.url + "/v1/completions", content=iter([b"x" * (1 << 20)] * 9),
                         headers={"Authorization": f"Bearer {KEYS['alice']}", "content-type": "application/json"})
    assert chunked.status_code == 413 and "over" in chunked.json()["error"]["message"], chunked.text
    assert httpx.get(loaded.url + "/v1/nothing-here", headers={"Authorization": f"Bearer {KEYS['alice']}"}).status_code == 404


def test_adapter_paths_and_names_are_confined(loaded, served_files, tmp_path):
    root = served_files["adapters"]
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape").symlink_to(outside, target_is_directory=True) if not (root / "escape").exists() else None
    pickled = root / "pickled"
    pickled.mkdir(exist_ok=True)
    (pickled / "adapter_config.json").write_text((root / "alice" / "poet" / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    refused = {
        ("x", "/etc"): "relative",
        ("x", str(root / "alice" / "poet")): "relative",
        ("x", "../adapters/alice/poet"): "`..`",
        ("x", "alice/../../base"): "`..`",
        ("x", "escape"): "outside the adapter root",
        ("x", "pickled"): "adapter_model.safetensors",
        ("x", "nowhere"): "no adapter directory",
        ("bad name!", "alice/poet"): "lora_name",
        ("tiny-llama", "alice/poet"): "lora_name",
        ("poet", "alice/poet"): "already",  # alice has one of that name
    }
    for (name, path), message in refused.items():
        response = load(loaded, "alice", name, path)
        assert response.status_code == 400, (name, path, response.text)
        assert message in response.json()["error"]["message"], (name, path, response.text)
    # another tenant cannot unload alice's adapter, and learns nothing from trying
    response = httpx.post(loaded.url + "/v1/unload_lora_adapter", json={"lora_name": "poet"},
                          headers={"Authorization": f"Bearer {KEYS['bob']}"})
    assert response.status_code == 404
    assert "poet" in {m.id for m in loaded.client("alice").models.list().data}
    # an adapter for another base is refused when loaded, with the engine's reason
    config = json.loads((root / "shared" / "extra" / "adapter_config.json").read_text())
    wrong = root / "wrong-shapes"
    wrong.mkdir(exist_ok=True)
    from safetensors.torch import save_file
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 7),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(96, 4)},
              wrong / "adapter_model.safetensors")
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    response = load(loaded, "alice", "wrong", "wrong-shapes")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_adapter"
    assert str(root) not in response.text  # the server's own paths are not the tenant's business


def test_unloading_makes_the_adapter_unknown_and_a_shared_directory_serves_two_tenants(loaded):
    assert load(loaded, "alice", "extra", "shared/extra").status_code == 200
    assert load(loaded, "bob", "extra", "shared/extra").status_code == 200
    for tenant in ("alice", "bob"):
        assert loaded.client(tenant).completions.create(model="extra", prompt="hi", max_tokens=2).choices
    response = httpx.post(loaded.url + "/v1/unload_lora_adapter", json={"lora_name": "extra"},
                          headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert response.status_code == 200
    with pytest.raises(openai.NotFoundError):
        loaded.client("alice").completions.create(model="extra", prompt="hi", max_tokens=2)
    assert loaded.client("bob").completions.create(model="extra", prompt="hi", max_tokens=2).choices


def test_an_adapter_whose_file_turns_unreadable_after_its_load_is_that_requests_400(loaded, served_files):
    import shutil

    root = served_files["adapters"]
    broken = root / "alice" / "turns-bad"
    shutil.copytree(root / "alice" / "poet", broken, dirs_exist_ok=True)
    assert load(loaded, "alice", "turns-bad", "alice/turns-bad").status_code == 200
    # a different size and time: not the copy the host tier holds, so it is read again, and fails there
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file at all")
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            loaded.client("alice").completions.create(model="turns-bad", prompt="hi", max_tokens=2, stream=stream)
        assert refused.value.code == "invalid_adapter" and str(root) not in str(refused.value)
    assert loaded.client("alice").completions.create(model="poet", prompt="hi", max_tokens=2).choices
    assert httpx.post(loaded.url + "/v1/unload_lora_adapter", json={"lora_name": "turns-bad"},
                      headers={"Authorization": f"Bearer {KEYS['alice']}"}).status_code == 200


def test_metrics_are_the_admins_and_usage_is_counted_per_tenant(loaded):
    loaded.client("bob").completions.create(model="writer", prompt="a dog", max_tokens=3, temperature=0)
    with pytest.raises(openai.PermissionDeniedError):
        loaded.client("bob").get("/../metrics", cast_to=httpx.Response)
    metrics = httpx.get(loaded.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['admin']}"}).text
    for name in ("symbiosis:num_requests_running", "symbiosis:num_requests_waiting", "symbiosis:kv_cache_usage_perc",
                 "symbiosis:time_to_first_token_seconds_bucket", "symbiosis:inter_token_latency_seconds_bucket",
                 "symbiosis:e2e_request_latency_seconds_count", "symbiosis:executor_batches_total",
                 'symbiosis:generation_tokens_total{model="writer",tenant="bob"}', "symbiosis:adapter_slots_used",
                 "symbiosis:adapter_host_bytes", 'symbiosis:adapter_lookups_total{tier="disk"}'):
        assert name in metrics, name
    usage = httpx.get(loaded.url + "/v1/usage", headers={"Authorization": f"Bearer {KEYS['bob']}"}).json()["data"]
    assert {row["tenant"] for row in usage} == {"bob"} and any(row["model"] == "writer" for row in usage)
    assert httpx.get(loaded.url + "/v1/usage?of=alice", headers={"Authorization": f"Bearer {KEYS['bob']}"}).status_code == 403
    everyone = httpx.get(loaded.url + "/v1/usage", headers={"Authorization": f"Bearer {KEYS['admin']}"}).json()["data"]
    assert {"alice", "bob"} <= {row["tenant"] for row in everyone}
    assert httpx.get(loaded.url + "/health").json()["status"] == "ok"


def test_a_client_that_goes_away_frees_its_kv_blocks(loaded):
    pool = loaded.service.engine.pool
    with httpx.stream("POST", loaded.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS['alice']}"},
                      json={"model": "poet", "prompt": LONG_RUNNING, "max_tokens": 100, "stream": True,
                            "temperature": 0}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert pool.free < pool.num_blocks  # then the client closes the stream
    deadline = time.monotonic() + 20
    while pool.free < pool.num_blocks or loaded.service.engine.has_work():
        assert time.monotonic() < deadline, "the abandoned request still holds KV blocks"
        time.sleep(0.05)
    # not streaming: a client that times out is abandoned too
    with pytest.raises(openai.APITimeoutError):
        loaded.client("alice", timeout=0.3).completions.create(model="tiny-llama", prompt=LONG_RUNNING, max_tokens=100)
    deadline = time.monotonic() + 20
    while pool.free < pool.num_blocks or loaded.service.engine.has_work():
        assert time.monotonic() < deadline, "the abandoned request still holds KV blocks"
        time.sleep(0.05)


def test_past_the_limits_requests_get_429_with_retry_after(served_files, tmp_path):
    running = start(served_files, tmp_path / "state", max_requests=3, max_requests_per_tenant=2)
    engine, step = running.service.engine, running.service.engine.step
    engine.step = lambda: time.sleep(0.05) or step()  # slow steps: the streams below are still running when asked
    try:
        headers = {"Authorization": f"Bearer {KEYS['alice']}"}
        body = {"model": "tiny-llama", "prompt": LONG_RUNNING, "max_tokens": 100, "stream": True, "temperature": 0}
        with httpx.stream("POST", running.url + "/v1/completions", headers=headers, json=body) as one, \
                httpx.stream("POST", running.url + "/v1/completions", headers=headers, json=body) as two:
            lines = [one.iter_lines(), two.iter_lines()]  # kept: a dropped iterator closes its stream
            assert all(next(line).startswith("data: ") for line in lines)
            with pytest.raises(openai.RateLimitError) as own:
                running.client("alice").completions.create(model="tiny-llama", prompt="hi", max_tokens=1)
            assert own.value.response.headers["retry-after"] == "1"
            with httpx.stream("POST", running.url + "/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {KEYS['bob']}"}) as three:
                lines.append(three.iter_lines())
                assert next(lines[-1]).startswith("data: ")
                with pytest.raises(openai.RateLimitError) as total:
                    running.client("admin").completions.create(model="tiny-llama", prompt="hi", max_tokens=1)
                assert total.value.body["code"] == "server_busy"
        deadline = time.monotonic() + 20
        while sum(running.service.admission.running.values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert running.client("alice").completions.create(model="tiny-llama", prompt="hi", max_tokens=1).choices
    finally:
        running.stop()


def test_adapters_and_usage_outlive_a_restart(served_files, tmp_path):
    state = tmp_path / "state"
    first = start(served_files, state)
    try:
        assert load(first, "bob", "kept", "bob/writer").status_code == 200
        first.client("bob").completions.create(model="kept", prompt="hi", max_tokens=2)
    finally:
        first.stop()
    second = start(served_files, state)
    try:
        assert "kept" in {m.id for m in second.client("bob").models.list().data}
        assert second.client("bob").completions.create(model="kept", prompt="hi", max_tokens=2).choices
        usage = {row["model"]: row for row in second.service.state.usage("bob")}
        assert usage["kept"]["requests"] == 2
    finally:
        second.stop()


@pytest.mark.parametrize("fronts", [False, True], ids=["one_process", "fronts"])
def test_many_concurrent_streams_over_several_adapters_lose_nothing_and_mix_nothing(served_files, tmp_path, fronts):
    """Load: 200 concurrent streaming requests over the base and three adapters of two tenants, each checked
    against the same request run alone (greedy: the same text whatever else is batched); through a front too,
    where every stream's chunks share the bridge's bunches."""
    loaded = start(served_files, tmp_path / "state", fronts=fronts, max_requests=256, max_requests_per_tenant=128)
    try:
        for tenant, name, path in (("alice", "poet", "alice/poet"), ("alice", "counter", "alice/counter"),
                                   ("bob", "writer", "bob/writer")):
            assert load(loaded, tenant, name, path).status_code == 200
        _many_streams(loaded)
    finally:
        loaded.stop()


def _many_streams(loaded):
    jobs = [(tenant, model, PROMPTS[i % len(PROMPTS)]) for i, (tenant, model) in enumerate(
        [("alice", "poet"), ("alice", "counter"), ("bob", "writer"), ("bob", "tiny-llama")] * 50)]
    alone = {}
    for tenant, model, prompt in set(jobs):
        alone[tenant, model, prompt] = loaded.client(tenant).completions.create(
            model=model, prompt=prompt, max_tokens=4, temperature=0).choices[0].text
    results, errors = [None] * len(jobs), []

    def run(i, tenant, model, prompt):
        try:
            stream = loaded.client(tenant, timeout=120).completions.create(model=model, prompt=prompt, max_tokens=4,
                                                                           temperature=0, stream=True)
            results[i] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results == [alone[job] for job in jobs]


def test_a_mixture_of_experts_base_is_served_as_plain_transformers_and_peft(served_files, tmp_path):
    """`symbiosis serve` over a Mixtral base (the demo's tokenizer, random weights): its experts in the executor,
    an attention adapter in the engine; completions equal plain transformers (eager experts) + PEFT."""
    import shutil

    import transformers

    from conftest import write_lora

    tokenizer = AutoTokenizer.from_pretrained(served_files["model"])
    config = transformers.MixtralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(7)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    adapters = tmp_path / "adapters"
    write_lora(tmp_path / "moe", adapters / "alice" / "moe-lora", 5, ["q_proj", "v_proj"])
    files = {**served_files, "model": tmp_path / "moe", "adapters": adapters}
    running = start(files, tmp_path / "state")
    try:
        assert load(running, "alice", "moe-lora", "alice/moe-lora").status_code == 200
        for model, adapter in (("tiny-llama", None), ("moe-lora", "alice/moe-lora")):
            result = running.client("alice").completions.create(model=model, prompt=PROMPTS[:2], max_tokens=6,
                                                                temperature=0, logprobs=1)
            for prompt, choice in zip(PROMPTS, result.choices):
                ids = tokenizer(prompt)["input_ids"]
                expected, logprobs = plain_generate(files, adapter, ids, 6)
                assert choice.text == tokenizer.decode(expected, skip_special_tokens=True)
                assert choice.logprobs.token_logprobs == pytest.approx(logprobs, rel=1e-9, abs=1e-9)
    finally:
        running.stop()
    shutil.rmtree(tmp_path / "state", ignore_errors=True)


def test_each_request_is_logged_once_without_its_prompt_or_key(loaded, caplog):
    """The access log: one JSON line a request (its id also in `x-request-id`, its tenant, path and status), for a
    streamed completion too; never the prompt or the key."""
    prompt = "a secret prompt that must stay out of the logs"
    with caplog.at_level("INFO", logger="symbiosis.serve.access"):
        with httpx.stream("POST", loaded.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS['alice']}"},
                          json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "stream": True}) as response:
            assert response.status_code == 200
            body = "".join(response.iter_text())
            request_id = response.headers["x-request-id"]
        refused = httpx.get(loaded.url + "/v1/models", headers={"Authorization": "Bearer not-a-key"})
        # the stream's line is written once its last chunk went, maybe after the client read it: wait for it here,
        # while INFO is captured (a line written after this block would be filtered out)
        deadline = time.monotonic() + 10
        while len([r for r in caplog.records if r.name == "symbiosis.serve.access"]) < 2 and \
                time.monotonic() < deadline:
            time.sleep(0.02)
    assert body.rstrip().endswith("data: [DONE]")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "symbiosis.serve.access"]
    streamed = [line for line in lines if line["request_id"] == request_id]
    assert len(streamed) == 1 and streamed[0]["tenant"] == "alice" and streamed[0]["status"] == 200
    assert streamed[0]["path"] == "/v1/completions" and streamed[0]["method"] == "POST"
    denied = [line for line in lines if line["request_id"] == refused.headers["x-request-id"]]
    assert len(denied) == 1 and denied[0]["status"] == 401 and denied[0]["tenant"] is None
    text = caplog.text
    assert prompt not in text and KEYS["alice"] not in text and "not-a-key" not in text


def test_long_prompts_are_tokenized_off_the_event_loop():
    """The tokenizer holds the event loop, every tenant's, while it runs (a 7.8 MB prompt stalled another
    tenant's GET /v1/models for 7 s): long prompts go to a worker thread, short ones stay (no hand-off)."""
    import asyncio
    import threading

    from symbiosis.serve.openai_api import OFF_LOOP_CHARS, _tokenized

    async def threads():
        return (threading.get_ident(), await _tokenized(threading.get_ident, [10, 20]),
                await _tokenized(threading.get_ident, [OFF_LOOP_CHARS, 1]))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # a loop of its own (a test before may leave one running on this thread)
        loop, short, long = pool.submit(asyncio.run, threads()).result()
    assert short == loop != long


def _adapter_copy(root, name: str):
    """A fresh copy of alice's poet adapter under the root, as `name`."""
    import shutil

    directory = root / "hostile" / name
    if directory.is_symlink():
        directory.unlink()
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(root / "alice" / "poet", directory)
    return directory


def test_every_file_an_adapter_is_read_from_stays_in_the_root_on_every_use(loaded, served_files, tmp_path):
    root = served_files["adapters"]
    secret = tmp_path / "secret.txt"
    secret.write_text("{{ 'the server secret' }}")
    for name in ("chat_template.jinja", "tokenizer_config.json", "symbiosis.json"):
        directory = _adapter_copy(root, f"link-{name}")
        (directory / name).symlink_to(secret)
        response = load(loaded, "alice", f"link-{name}", f"hostile/link-{name}")
        assert response.status_code == 400 and "not a file inside the adapter root" in response.text, response.text
    # loaded while inside, then swapped for a symlink leading out: refused on its next use, the path not shown
    directory = _adapter_copy(root, "swapped")
    assert load(loaded, "alice", "swapped", "hostile/swapped").status_code == 200
    assert loaded.client("alice").completions.create(model="swapped", prompt="hi", max_tokens=2).choices
    outside = tmp_path / "outside-adapter"
    directory.rename(outside)
    (outside / "chat_template.jinja").write_text("{{ 'outside' }}")
    directory.symlink_to(outside, target_is_directory=True)
    for chat in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            if chat:
                loaded.client("alice").chat.completions.create(model="swapped", messages=[{"role": "user",
                                                                                           "content": "hi"}])
            else:
                loaded.client("alice").completions.create(model="swapped", prompt="hi", max_tokens=2)
        assert "outside the adapter root" in str(refused.value) and str(root) not in str(refused.value)
    assert loaded.client("alice").completions.create(model="poet", prompt="hi", max_tokens=2).choices


def test_hostile_adapter_configs_are_refused_at_load_with_the_reason(loaded, served_files):
    root = served_files["adapters"]
    deep = "[" * 100_000 + "]" * 100_000
    cases = {  # name: (file, its text, the error's words)
        "regex": ("adapter_config.json", {"alpha_pattern": {".{6}(.|.)*Z": 4.0}}, "not a module name"),
        "bad-regex": ("adapter_config.json", {"alpha_pattern": {"q_proj(": 4.0}}, "not a module name"),
        "huge-alpha": ("adapter_config.json", {"lora_alpha": 1e300}, "beyond the range"),
        "deep-config": ("adapter_config.json", deep, "nested too deep"),
        "deep-record": ("symbiosis.json", deep, "nested too deep"),
        "big-config": ("adapter_config.json", " " * (5 << 20), "too large"),
    }
    for name, (file, content, words) in cases.items():
        directory = _adapter_copy(root, name)
        if isinstance(content, dict):
            config = json.loads((directory / file).read_text())
            content = json.dumps({**config, **content})
        (directory / file).write_text(content)
        started = time.monotonic()
        response = load(loaded, "alice", name, f"hostile/{name}")
        assert response.status_code == 400 and words in response.json()["error"]["message"], (name, response.text)
        assert time.monotonic() - started < 5, name
    # too many files to look through for pickles
    directory = _adapter_copy(root, "crowded")
    for i in range(4100):
        (directory / f"junk{i}.txt").touch()
    response = load(loaded, "alice", "crowded", "hostile/crowded")
    assert response.status_code == 400 and "more than 4096 files" in response.text
    # an alpha_pattern of module names is taken, as PEFT takes it: the same output as PEFT's
    directory = _adapter_copy(root, "patterned")
    config = json.loads((directory / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"model.layers.0.self_attn.q_proj": 1.5, "v_proj": 20.0}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    assert load(loaded, "alice", "patterned", "hostile/patterned").status_code == 200
    tokenizer = AutoTokenizer.from_pretrained(served_files["model"])
    ids = tokenizer(PROMPTS[0])["input_ids"]
    reply = loaded.client("alice").completions.create(model="patterned", prompt=ids, max_tokens=5, temperature=0)
    expected, _ = plain_generate(served_files, "hostile/patterned", ids, 5)
    assert reply.choices[0].text == tokenizer.decode(expected)


def test_a_loaded_adapter_is_not_walked_again_on_each_request(loaded, monkeypatch):
    import symbiosis.engine.adapters as engine_adapters

    assert loaded.client("alice").completions.create(model="poet", prompt="hi", max_tokens=2).choices
    walked = []
    monkeypatch.setattr(engine_adapters, "check_adapter_directory", lambda d: walked.append(d) or d)
    assert loaded.client("alice").completions.create(model="poet", prompt="hi", max_tokens=2).choices
    assert walked == []


def test_a_tenants_chat_template_runs_bounded_in_a_worker_and_holds_up_no_one(loaded, served_files):
    root = served_files["adapters"]
    templates = loaded.service.templates
    timeout = templates.timeout_s
    templates.timeout_s = 2.0
    try:
        hostile = {
            "loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
                      "did not render within 2 s"),
            "memory": ("{{ ('x' * 3000000000)[:2] }}", "memory"),
            "raises": ("{{ raise_exception('no system messages here') }}", "no system messages here"),
        }
        for name, (template, words) in hostile.items():
            directory = _adapter_copy(root, f"template-{name}")
            (directory / "chat_template.jinja").write_text(template)
            assert load(loaded, "alice", f"template-{name}", f"hostile/template-{name}").status_code == 200
        outcome = {}

        def chat(name: str) -> None:
            started = time.monotonic()
            try:
                loaded.client("alice").chat.completions.create(
                    model=f"template-{name}", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            except openai.BadRequestError as e:
                outcome[name] = (str(e), time.monotonic() - started)
        threads = [threading.Thread(target=chat, args=(name,)) for name in hostile]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        started = time.monotonic()  # meanwhile another tenant's chat (the base's template) and /health
        assert loaded.client("bob").chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "the cat"}], max_tokens=2).choices
        assert httpx.get(loaded.url + "/health").status_code == 200
        assert time.monotonic() - started < 1.5
        for thread in threads:
            thread.join(60)
        for name, (_, words) in hostile.items():
            assert words in outcome[name][0], (name, outcome.get(name))
        assert outcome["loops"][1] < 15
        # the renderer recovered: a good template renders again
        (root / "hostile" / "template-raises" / "chat_template.jinja").write_text(
            "{% for m in messages %}{{ m['content'] }} {% endfor %}answer :")
        assert loaded.client("alice").chat.completions.create(
            model="template-raises", messages=[{"role": "user", "content": "the cat"}], max_tokens=2).choices
    finally:
        templates.timeout_s = timeout
