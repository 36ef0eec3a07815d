"""OpenAI's files and fine-tuning jobs API of `symbiosis serve`, driven by the official `openai` client: a file
checked line by line, a job that trains, reports its events and checkpoints, and whose model (and each checkpoint)
serves completions at once; cancel, pause, resume; other PEFT methods; a second tenant who sees none of it."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import KEYS, start, wait_for_job

LINES = [{"prompt": "the cat", "completion": " sat on the mat"}, {"prompt": "a dog", "completion": " ran in the park"},
         {"messages": [{"role": "user", "content": "what sat?"}, {"role": "assistant", "content": "the cat sat"}]},
         {"prompt": "birds", "completion": " sing in the tree"}]


@pytest.fixture(scope="module", params=["one_process", "fronts"])
def jobs_server(request, served_files, tmp_path_factory):
    """Every test here runs with the service's HTTP in its own process and behind a front (`--http-processes`):
    uploads, the jobs' event lists, the page."""
    running = start(served_files, tmp_path_factory.mktemp("jobs-state"), fronts=request.param == "fronts",
                    training={"checkpoint_every": 2, "max_running_jobs": 4})
    yield running
    running.stop()


def _jsonl(lines) -> io.BytesIO:
    data = io.BytesIO("\n".join(json.dumps(line) for line in lines).encode())
    data.name = "train.jsonl"
    return data




def _plain_greedy(jobs_server, served_files, model: str, prompt: str, tokens: int) -> str:
    """What plain transformers + PEFT (float64) says greedily with the job's adapter directory."""
    directory = jobs_server.service.jobs.resolve("alice", model)[1]
    tokenizer = jobs_server.service.tokenizer
    plain = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(served_files["model"],
                                                                                dtype=torch.float64), directory)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = plain.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    return tokenizer.decode(expected, skip_special_tokens=True)


def test_a_file_is_checked_line_by_line(jobs_server):
    client = jobs_server.client("alice")
    bad = io.BytesIO((json.dumps(LINES[0]) + "\n{not json\n").encode())
    bad.name = "bad.jsonl"
    with pytest.raises(openai.BadRequestError, match="line 2: not JSON"):
        client.files.create(file=bad, purpose="fine-tune")
    uploaded = client.files.create(file=_jsonl(LINES), purpose="fine-tune")
    assert uploaded.filename == "train.jsonl" and uploaded.purpose == "fine-tune" and uploaded.bytes > 0
    assert uploaded.id in [f.id for f in client.files.list().data]
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    with pytest.raises(openai.NotFoundError):
        jobs_server.client("bob").files.retrieve(uploaded.id)
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_a_tenant_keeps_a_bounded_number_of_files_and_bytes(jobs_server, monkeypatch):
    """Uploads had no quota: the service's disk is every tenant's."""
    jobs = jobs_server.service.jobs
    alice, bob = jobs_server.client("alice"), jobs_server.client("bob")
    held, _ = jobs.store.file_usage("alice")  # (what earlier tests left)
    monkeypatch.setattr(jobs, "max_files", held + 2)
    kept = [alice.files.create(file=_jsonl(LINES), purpose="fine-tune") for _ in range(2)]
    with pytest.raises(openai.BadRequestError, match=f"at most {held + 2} files") as refused:
        alice.files.create(file=_jsonl(LINES), purpose="fine-tune")
    assert refused.value.body["code"] == "quota_exceeded"
    assert bob.files.create(file=_jsonl(LINES), purpose="fine-tune").bytes > 0  # another tenant's own quota
    alice.files.delete(kept[0].id)  # room again
    assert alice.files.create(file=_jsonl(LINES), purpose="fine-tune").bytes > 0
    _, held_bytes = jobs.store.file_usage("alice")
    monkeypatch.setattr(jobs, "max_files", 10_000)
    monkeypatch.setattr(jobs, "max_file_bytes", held_bytes + kept[1].bytes - 1)
    with pytest.raises(openai.BadRequestError, match="bytes may be kept"):
        alice.files.create(file=_jsonl(LINES), purpose="fine-tune")


def test_a_job_trains_reports_and_serves_its_model_and_checkpoints(jobs_server, served_files):
    client = jobs_server.client("alice")
    training = client.files.create(file=_jsonl(LINES), purpose="fine-tune")
    validation = client.files.create(file=_jsonl(LINES[:2]), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-llama", training_file=training.id, validation_file=validation.id, suffix="poet", seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 3, "batch_size": 2, "learning_rate_multiplier": 20}}},
        extra_body={"peft": {"method": "lora", "config": {"r": 4, "lora_alpha": 8}}})  # the test engine's ranks <= 8
    assert job.status in ("validating_files", "queued", "running")
    job = wait_for_job(client, job.id, ("succeeded", "failed"))
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"ft:tiny-llama:poet:{job.id}" and job.trained_tokens > 0
    assert job.hyperparameters.n_epochs == 3 and job.hyperparameters.batch_size == 2
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    assert events[0].message == "The job has successfully completed"
    losses = [e.data["train_loss"] for e in reversed(events) if e.type == "metrics" and "train_loss" in e.data
              and "total_steps" in e.data]
    assert len(losses) == 6 and losses[-1] < losses[0]
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [6, 4, 2]
    assert all(c.metrics.valid_loss is not None for c in checkpoints)
    assert job.id in [j.id for j in client.fine_tuning.jobs.list(limit=50).data]

    # the model and each checkpoint answer at once; plain PEFT loads the checkpoint's directory
    prompt = "the cat"
    served = client.completions.create(model=job.fine_tuned_model, prompt=prompt, max_tokens=5, temperature=0)
    at_two = client.completions.create(model=checkpoints[-1].fine_tuned_model_checkpoint, prompt=prompt, max_tokens=5,
                                       temperature=0)
    assert served.choices[0].text == _plain_greedy(jobs_server, served_files, job.fine_tuned_model, prompt, 5)
    assert at_two.choices[0].text is not None

    bob = jobs_server.client("bob")  # none of it is bob's
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.jobs.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        bob.completions.create(model=job.fine_tuned_model, prompt=prompt, max_tokens=2)
    assert job.id not in [j.id for j in bob.fine_tuning.jobs.list().data]


def test_cancel_pause_and_resume(jobs_server):
    client = jobs_server.client("alice")
    training = client.files.create(file=_jsonl(LINES), purpose="fine-tune")
    long = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 50, "batch_size": 1}}}
    job = client.fine_tuning.jobs.create(model="tiny-llama", training_file=training.id, method=long, seed=1)
    wait_for_job(client, job.id, ("running",))
    # a step trained first: a pause before any resumes from the start (a busy machine got there in the suite)
    deadline = time.monotonic() + 300
    while not any(e.message.startswith("Step ") for e in client.fine_tuning.jobs.list_events(job.id, limit=100)):
        assert time.monotonic() < deadline, "the job trained no step"
        time.sleep(0.1)
    client.fine_tuning.jobs.pause(job.id)
    wait_for_job(client, job.id, ("paused",))
    with pytest.raises(openai.BadRequestError, match="cannot be paused"):
        client.fine_tuning.jobs.pause(job.id)
    client.fine_tuning.jobs.resume(job.id)
    resumed = wait_for_job(client, job.id, ("running",))
    assert resumed.status == "running"
    client.fine_tuning.jobs.cancel(job.id)
    cancelled = wait_for_job(client, job.id, ("cancelled",))
    assert cancelled.fine_tuned_model is None
    messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert "The job was cancelled" in messages and "The job was paused" in messages
    assert any(m.startswith("Resumed from the checkpoint at step") for m in messages)


def test_other_peft_methods_train_on_split_clients(jobs_server, served_files):
    client = jobs_server.client("alice")
    training = client.files.create(file=_jsonl(LINES), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-llama", training_file=training.id, seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}},
        extra_body={"peft": {"method": "loha", "config": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}}})
    job = wait_for_job(client, job.id, ("succeeded", "failed"))
    assert job.status == "succeeded", job.error
    directory = jobs_server.service.jobs.resolve("alice", job.fine_tuned_model)[1]
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(served_files["model"]), directory)
    assert loaded.peft_config["default"].peft_type == peft.PeftType.LOHA
    # the engine runs LoRA only: the LoHa model answers on a split client, as plain PEFT does, streamed or not
    expected = _plain_greedy(jobs_server, served_files, job.fine_tuned_model, "a dog", 6)
    served = client.completions.create(model=job.fine_tuned_model, prompt="a dog", max_tokens=6, temperature=0)
    assert served.choices[0].text == expected and served.choices[0].finish_reason == "length"
    streamed = client.completions.create(model=job.fine_tuned_model, prompt="a dog", max_tokens=6, temperature=0,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected
    chat = client.chat.completions.create(model=job.fine_tuned_model, max_tokens=3, temperature=0.8, seed=5,
                                          messages=[{"role": "user", "content": "what sat?"}])
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 3


def test_bad_jobs_are_refused_or_fail_with_the_reason(jobs_server):
    client = jobs_server.client("alice")
    training = client.files.create(file=_jsonl(LINES), purpose="fine-tune")
    cases = [({"model": "gpt-4o"}, "fine-tunes 'tiny-llama'"),
             ({"method": {"type": "dpo", "dpo": {}}}, "supervised fine-tuning only"),
             ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 0}}}}, "n_epochs"),
             ({"extra_body": {"peft": {"method": "glora"}}}, "not one this service trains"),
             ({"extra_body": {"peft": {"method": "lora", "config": {"rank": 4}}}}, "peft.config for lora"),
             # accepted once, and the job's thread then died on them: "running" for ever, with no error
             ({"extra_body": {"peft": {"method": "lora", "config": {"lora_alpha": [1]}}}}, "peft.config"),
             ({"extra_body": {"peft": {"method": "lora", "config": {"target_modules": 5}}}}, "peft.config"),
             # ranks past the service's bound, on either path (dropout sends LoRA to a split client)
             ({"extra_body": {"peft": {"method": "lora", "config": {"r": 10_000, "lora_dropout": 0.1}}}}, "0..256"),
             ({"extra_body": {"peft": {"method": "loha", "config": {"r": 10_000}}}}, "0..256"),
             ({"extra_body": {"peft": {"method": "lora", "config": {"r": 300}}}}, "0..256"),
             # fields that are no objects were a server error
             ({"extra_body": {"hyperparameters": [1]}}, "must be JSON objects"),
             ({"method": {"type": "supervised", "supervised": [1]}}, "must be JSON objects"),
             ({"method": {"type": "supervised", "supervised": {"hyperparameters": "x"}}}, "must be JSON objects"),
             # fields PEFT reads as files or repositories to load (a tokenizer, a pickled state dict, adapters)
             ({"extra_body": {"peft": {"method": "prompt_tuning", "config": {
                 "prompt_tuning_init_text": "x", "tokenizer_name_or_path": "/etc"}}}},
              "tokenizer_name_or_path: a field that loads"),
             ({"extra_body": {"peft": {"method": "prompt_tuning", "config": {"prompt_tuning_init": "TEXT"}}}},
              "prompt_tuning_init must be one of"),
             ({"extra_body": {"peft": {"method": "multitask_prompt_tuning", "config": {
                 "prompt_tuning_init_state_dict_path": "/etc/passwd"}}}}, "a field that loads"),
             ({"extra_body": {"peft": {"method": "xlora", "config": {"adapters": {"0": "/tmp"}}}}}, "a field that loads"),
             ({"extra_body": {"peft": {"method": "lora", "config": {"loftq_config": {"loftq_bits": 4}}}}},
              "a field that loads"),
             # sizes PEFT allocates by: bounded (a million virtual tokens took 8 GB of host memory)
             ({"extra_body": {"peft": {"method": "prompt_tuning", "config": {"num_virtual_tokens": 10**6}}}},
              "num_virtual_tokens must be an integer in 0..1024"),
             ({"extra_body": {"peft": {"method": "prompt_tuning", "config": {"token_dim": 10**6}}}},
              "the base model's"),
             ({"extra_body": {"peft": {"method": "lora", "config": {"rank_pattern": {"q_proj": 10**5}}}}},
              "rank_pattern.q_proj must be"),
             # a regular expression: the service's trainer read it as a module name, PEFT as a pattern
             ({"extra_body": {"peft": {"method": "lora", "config": {"target_modules": ".*v_proj"}}}},
              "a regular expression is not taken"),
             # keys and fields PEFT runs as regular expressions, holding the GIL (`(.|.)*Z` took minutes)
             ({"extra_body": {"peft": {"method": "lora", "config": {"alpha_pattern": {".{6}(.|.)*Z": 4}}}}},
              "not a module name"),
             ({"extra_body": {"peft": {"method": "lora", "config": {"rank_pattern": {"q_proj(": 4}}}}},
              "not a module name"),
             ({"extra_body": {"peft": {"method": "lora", "config": {"exclude_modules": "(.|.)*Z"}}}},
              "module names only"),
             ({"extra_body": {"peft": {"method": "lora", "config": {"layers_pattern": ["(a+)+$"]}}}},
              "module names only")]
    for changes, message in cases:
        arguments = {"model": "tiny-llama", "training_file": training.id, **changes}
        with pytest.raises(openai.BadRequestError, match=message):
            client.fine_tuning.jobs.create(**arguments)
    # NaN (which the client library will not write) was stored, and every later listing of the tenant's jobs failed
    nan = httpx.post(jobs_server.url + "/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {KEYS['alice']}",
                                                                         "content-type": "application/json"},
                     content=json.dumps({"model": "tiny-llama", "training_file": training.id,
                                         "peft": {"method": "lora", "config": {"lora_dropout": float("nan")}}}))
    assert nan.status_code == 400 and "numbers (finite)" in nan.json()["error"]["message"], nan.text
    client.fine_tuning.jobs.list()
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.create(model="tiny-llama", training_file="file-nothing")
    # too long for the model's context: found when the job checks its files, named by line
    long = client.files.create(file=_jsonl(LINES + [{"prompt": "the cat " * 200, "completion": " sat"}]),
                               purpose="fine-tune")
    job = wait_for_job(client, client.fine_tuning.jobs.create(model="tiny-llama", training_file=long.id).id, ("failed",))
    assert job.error.code == "invalid_training_file" and "line 5" in job.error.message


def test_lines_end_at_newlines_and_a_line_nested_too_deep_is_named(jobs_server):
    client = jobs_server.client("alice")
    # JSON strings may hold U+2028 and U+0085 raw; a reader splitting at them found two broken lines
    raw = '{"prompt": "a\u2028b\u0085c", "completion": " d"}'.encode()
    assert json.loads(raw)["prompt"] == "a\u2028b\u0085c"
    assert client.files.create(file=("raw.jsonl", raw), purpose="fine-tune").bytes == len(raw)
    with pytest.raises(openai.BadRequestError, match="line 2: not JSON this service reads: nested too deep"):
        client.files.create(file=("deep.jsonl", raw + b"\n" + b"[" * 100_000), purpose="fine-tune")


def test_a_job_cancelled_while_its_files_are_checked_stays_cancelled(jobs_server):
    client = jobs_server.client("alice")
    many = client.files.create(file=_jsonl(LINES * 500), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model="tiny-llama", training_file=many.id,
                                         method={"type": "supervised", "supervised": {"hyperparameters": {
                                             "n_epochs": 1, "batch_size": 8}}})
    assert client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    time.sleep(3)  # the check's tokenizing of 2,000 lines is over by then; it used to queue the job again
    assert client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    messages = [event.message for event in client.fine_tuning.jobs.list_events(job.id, limit=50).data]
    assert not any("queued" in message for message in messages), messages


def test_the_command_line_follows_a_job_to_its_end(jobs_server):
    import subprocess
    import sys

    from conftest import KEYS

    client = jobs_server.client("alice")
    training = client.files.create(file=_jsonl(LINES), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-llama", training_file=training.id, seed=2, extra_body={"peft": {"method": "lora", "config": {"r": 4}}},
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 2}}})
    command = [sys.executable, "-m", "symbiosis.cli", "jobs", "--base-url", jobs_server.url + "/v1", "--api-key",
               KEYS["alice"]]
    followed = subprocess.run(command + ["follow", job.id, "--interval", "0.2"], capture_output=True, text=True,
                              timeout=180)
    assert followed.returncode == 0, followed.stderr
    lines = followed.stdout.splitlines()
    assert lines[0].startswith("info  Validating training file")
    assert "[###############...............] 2/4  loss" in followed.stdout
    assert lines[-1].startswith(f"{job.id}  succeeded") and f"ft:tiny-llama:alice:{job.id}" in lines[-1]
    listed = subprocess.run(command + ["list"], capture_output=True, text=True, timeout=60)
    assert job.id in listed.stdout
    shown = subprocess.run(command + ["show", job.id], capture_output=True, text=True, timeout=60)
    assert "checkpoint step 4:" in shown.stdout
    unknown = subprocess.run(command + ["show", "ftjob-nothing"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode != 0 and "404: No such fine-tuning job" in unknown.stderr


def test_the_page_shows_a_jobs_losses_events_and_checkpoints_and_cancels_one(jobs_server, browser):
    from conftest import KEYS

    client = jobs_server.client("alice")
    training = client.files.create(file=_jsonl(LINES), purpose="fine-tune")
    lora = {"peft": {"method": "lora", "config": {"r": 4}}}
    done = client.fine_tuning.jobs.create(
        model="tiny-llama", training_file=training.id, validation_file=training.id, seed=2, extra_body=lora,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 2}}})
    wait_for_job(client, done.id, ("succeeded",))
    long = client.fine_tuning.jobs.create(
        model="tiny-llama", training_file=training.id, seed=2, extra_body=lora,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 50, "batch_size": 1}}})
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(jobs_server.url + "/ui")
    page.fill("#key", KEYS["alice"])
    page.click("button[type=submit]")
    page.click(f"#jobs tr[data-job='{done.id}']")
    page.wait_for_selector("#losses polyline[data-series='training loss']")
    points = page.eval_on_selector("#losses polyline[data-series='training loss']",
                                   "l => l.getAttribute('points').split(' ').length")
    assert points == 4  # 2 epochs of 2 steps
    assert page.eval_on_selector("#losses polyline[data-series='validation loss']", "l => l.getAttribute('points')")
    page.wait_for_selector("#events li:has-text('The job has successfully completed')")
    assert "step 4:" in page.inner_text("#checkpoints")
    page.click(f"#jobs tr[data-job='{long.id}'] button.cancel")
    assert wait_for_job(client, long.id, ("cancelled",)).status == "cancelled"
    page.wait_for_selector(f"#jobs tr[data-job='{long.id}'] td:has-text('cancelled')")
    assert not errors
    page.close()
