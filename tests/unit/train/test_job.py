"""Fine-tuning jobs: data checked line by line, chats trained on their assistant turns only, and a job stopped
anywhere (at a pause, or killed between checkpoints) that resumes from its last checkpoint ends with the adapter
of a run never stopped; on the batched trainer (LoRA) and on a split client (any PEFT method)."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from transformers import AutoTokenizer

import symbiosis
from symbiosis.train import LoraSpec, Trainer
from symbiosis.train.data import DataError, check_lines, tokenize
from symbiosis.train.job import HostedBackend, Hyperparameters, JobFailed, JobRunner, SplitBackend
from symbiosis.train.scheduler import TrainingQueue

LINES = [{"prompt": "the cat", "completion": " sat on the mat"}, {"prompt": "a dog", "completion": " ran in the park"},
         {"messages": [{"role": "user", "content": "what sat?"}, {"role": "assistant", "content": "the cat"}]},
         {"prompt": "birds", "completion": " sing in the tree"}, {"prompt": "", "completion": "the sun is warm"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from symbiosis.demo import build_base_model

    model = build_base_model(tmp_path_factory.mktemp("job") / "base", pretrain_steps=0, log=lambda *_: None)
    executor = symbiosis.Executor.from_pretrained(model, dtype=torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = tokenize(check_lines("\n".join(json.dumps(line) for line in LINES).encode()), tokenizer, 128)
    return model, executor, tokenizer, examples


def test_lines_are_checked_one_by_one():
    good = json.dumps(LINES[0])
    cases = {"{not json": "line 2: not JSON", '{"messages": []}': "line 2: messages must be a non-empty list",
             '{"messages": [{"role": "pirate", "content": "arr"}]}': "line 2: message 0: role must be one of",
             '{"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]}':
                 "line 2: message 0: empty or missing content",
             '{"messages": [{"role": "user", "content": "hi"}]}': "line 2: no assistant message to train on",
             '{"prompt": "a"}': "line 2: prompt and completion must both be strings",
             '{"text": "a"}': 'line 2: each line must hold "messages"'}
    for bad, message in cases.items():
        with pytest.raises(DataError, match=message):
            check_lines(f"{good}\n{bad}\n".encode())
    with pytest.raises(DataError, match="no examples"):
        check_lines(b"\n\n")


def test_a_chat_trains_on_its_assistant_turns_only(base):
    _, _, tokenizer, examples = base
    chat = examples[2]
    trained = [t for t, w in zip(chat.tokens, chat.weights) if w]
    assert tokenizer.decode(trained).strip().startswith("the cat")
    assert "what sat" not in tokenizer.decode(trained)
    completion = examples[0]
    assert tokenizer.decode([t for t, w in zip(completion.tokens, completion.weights) if w],
                            skip_special_tokens=True).strip() == "sat on the mat"
    with pytest.raises(DataError, match="line 1: .* more than the model's context of 5"):
        tokenize([{"prompt": "the cat sat on the mat again", "completion": " and again"}], tokenizer, 5)
    with pytest.raises(DataError, match="line 1: token id \\d+ is outside the model's vocabulary of 3"):
        tokenize([{"prompt": "the", "completion": " cat"}], tokenizer, None, vocab=3)


def _run(backend, examples, directory, stop_at=None, crash_at=None, validation=None, multiplier=5.0):
    stops = {"asked": 0}

    def stop():
        stops["asked"] += 1
        return "pause" if stop_at is not None and stops["asked"] == stop_at else None

    reports = []

    def report(kind, **fields):
        reports.append((kind, fields))
        if crash_at is not None and kind == "metrics" and fields["step"] == crash_at:
            raise KeyboardInterrupt("killed")  # between checkpoints: the steps since the last one are redone

    runner = JobRunner(backend, examples, validation, Hyperparameters(n_epochs=3, batch_size=2, learning_rate_multiplier=multiplier),
                       seed=11, base_learning_rate=1e-3, checkpoint_every=2, directory=directory, base_model="base",
                       report=report, stop=stop)
    try:
        return runner.run(runner.resume()), reports
    except KeyboardInterrupt:
        return "killed", reports


def _hosted(base, trainer, queue, key):
    return HostedBackend(trainer, queue, key, LoraSpec(rank=4, seed=3, alpha=8.0, modules=("q_proj", "v_proj", "down_proj")))


def test_a_lora_job_resumed_after_a_pause_or_a_kill_ends_as_one_never_stopped(base, tmp_path):
    model, executor, _, examples = base
    trainer = Trainer(model, executor)
    queue = TrainingQueue(trainer).start()
    try:
        status, reports = _run(_hosted(base, trainer, queue, "whole"), examples, tmp_path / "whole",
                               validation=examples[:2])
        assert status == "succeeded"
        losses = [f["train_loss"] for kind, f in reports if kind == "metrics"]
        assert len(losses) == 9 and losses[-1] < losses[0]
        checkpoints = [f for kind, f in reports if kind == "checkpoint"]
        assert [c["step"] for c in checkpoints] == [2, 3, 4, 6, 8, 9]  # every 2 steps (3 a epoch), each epoch end
        assert all("valid_loss" in c["metrics"] for c in checkpoints)
        expected = _hosted(base, trainer, queue, "read")
        expected.load(tmp_path / "whole" / "checkpoints" / "step-9")

        for stopped in ("paused", "killed"):
            directory = tmp_path / stopped
            first = _hosted(base, trainer, queue, f"{stopped}-1")
            status, _ = _run(first, examples, directory, stop_at=4 if stopped == "paused" else None,
                             crash_at=7 if stopped == "killed" else None)
            assert status == stopped
            resumed = _hosted(base, trainer, queue, f"{stopped}-2")
            assert _run(resumed, examples, directory)[0] == "succeeded"
            for name, tensor in expected.lora.named_tensors().items():
                torch.testing.assert_close(resumed.lora.named_tensors()[name], tensor, rtol=1e-9, atol=1e-12)
    finally:
        queue.stop()


@pytest.mark.parametrize("config", [peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                   feedforward_modules=["down_proj"]),
                                    peft.LoHaConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"])],
                         ids=["ia3", "loha"])
def test_any_peft_method_runs_as_a_split_client_and_resumes_exactly(base, tmp_path, config):
    model, executor, _, examples = base
    status, reports = _run(SplitBackend(model, executor, config, seed=4), examples, tmp_path / "whole", multiplier=50)
    assert status == "succeeded"
    losses = [f["train_loss"] for kind, f in reports if kind == "metrics"]
    assert sum(losses[-3:]) < sum(losses[:3]), losses  # the last epoch against the first (the same examples)
    assert _run(SplitBackend(model, executor, config, seed=4), examples, tmp_path / "cut", crash_at=5,
                multiplier=50)[0] == "killed"
    resumed = SplitBackend(model, executor, config, seed=4)
    assert _run(resumed, examples, tmp_path / "cut", multiplier=50)[0] == "succeeded"
    from safetensors.torch import load_file

    whole = load_file(tmp_path / "whole" / "checkpoints" / "step-9" / "adapter_model.safetensors")
    cut = load_file(tmp_path / "cut" / "checkpoints" / "step-9" / "adapter_model.safetensors")
    for name, tensor in whole.items():
        torch.testing.assert_close(cut[name], tensor, rtol=1e-9, atol=1e-12)


def test_a_diverging_job_fails_with_the_reason_and_the_queue_trains_on(base, tmp_path):
    model, executor, _, examples = base
    trainer = Trainer(model, executor)
    queue = TrainingQueue(trainer).start()
    try:
        with pytest.raises(JobFailed, match="the training loss became (nan|inf) at step") as failed:
            # a rate that makes the first step's LoRA B matrices ~1e297: the hidden states then pass float32's range,
            # which the RMSNorms compute in, and the loss is NaN. (At 1e36 they reached ~1e33, whose squares
            # overflowed float32: the norms returned zeros and the loss sat at log(vocab), finite, in this venv.)
            _run(_hosted(base, trainer, queue, "diverging"), examples, tmp_path / "diverging", multiplier=1e300)
        assert failed.value.code == "training_diverged"
        # the other tenants' work goes on in the same queue
        assert _run(_hosted(base, trainer, queue, "healthy"), examples, tmp_path / "healthy")[0] == "succeeded"
    finally:
        queue.stop()
