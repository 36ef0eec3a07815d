"""The training queue: each adapter's operations in seq order, every waiting adapter in every pass, a big request
spread over passes without changing its result."""

from __future__ import annotations

import time

import pytest
import torch

import symbiosis
from symbiosis.train import HostedLora, LoraSpec, Trainer, Work
from symbiosis.train.scheduler import Operation, TrainingQueue
from symbiosis.train.trainer import Datum
from matrix import make_checkpoint


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    path = tmp_path_factory.mktemp("queue") / "base"
    make_checkpoint("llama", path)
    return Trainer(path, symbiosis.Executor.from_pretrained(path, dtype=torch.float64))


def _work(trainer, seed, datums, length=6):
    generator = torch.Generator().manual_seed(seed)
    lora = HostedLora(LoraSpec(rank=4, seed=seed), trainer.targets, trainer.device, trainer.dtype)
    with torch.no_grad():
        for _, b in lora.layers.values():
            b.copy_(torch.empty(b.shape, dtype=b.dtype).normal_(0, 0.1, generator=generator))  # (b on any device)
    data = [Datum(torch.randint(0, 128, (length,), generator=generator).tolist(),
                  {"target_tokens": torch.randint(0, 128, (length,), generator=generator),
                   "weights": torch.ones(length, dtype=torch.float64)}) for _ in range(datums)]
    return Work(lora, data, "cross_entropy")


def _operation(seq, log, work=None, call=None):
    return Operation(seq, done=lambda result: log.append((seq, result)), fail=lambda e: log.append((seq, e)),
                     work=work, call=call)


def test_a_small_request_is_not_held_up_by_a_big_one_and_the_big_one_is_unchanged(trainer):
    # passes of 24 tokens: the first shared (12 tokens, 2 datums of 6, for each), then 4 datums a pass alone
    queue = TrainingQueue(trainer, max_pass_tokens=24)
    big, small = _work(trainer, 1, 20), _work(trainer, 2, 1)
    expected = trainer.run([_work(trainer, 1, 20)])[0]  # the same datums and matrices, in one pass
    reference_grads = {n: t.grad.clone() for n, t in expected_grads(trainer, 1).items()}
    queue.open("big", 0)
    queue.open("small", 0)
    log = []
    queue.submit("big", _operation(0, log, work=big))
    queue.submit("small", _operation(0, log, work=small))
    assert queue.seconds == {"gather": 0.0, "steps": 0.0, "pass": 0.0}
    queue.round()
    assert [entry[0] for entry in log] == [0] and log[0][1].losses and len(log[0][1].losses) == 1, \
        "the small request finished in the first pass"
    first_pass = queue.seconds["pass"]
    assert first_pass > 0 and queue.seconds["gather"] >= 0
    while queue.round():
        pass
    big_result = log[1][1]
    assert queue.passes == 1 + 5
    assert queue.seconds["pass"] > first_pass  # the runner's time, counted up pass after pass
    assert big_result.losses == pytest.approx(expected.losses, rel=1e-12)
    for name, tensor in big.lora.named_tensors().items():  # gradients add up across the passes
        torch.testing.assert_close(tensor.grad, reference_grads[name], rtol=1e-12, atol=1e-14)


def test_a_pass_is_bounded_by_its_padded_rows_not_its_tokens(trainer, monkeypatch):
    """A pass pads every datum to its longest. One 12-token datum before 40 one-token datums was one pass of 41
    rows x 12 (every datum's tokens, 52, under the bound of 24): rows x the longest is what is bounded now."""
    queue = TrainingQueue(trainer, max_pass_tokens=24)
    ragged = _work(trainer, 3, 1, length=12)
    ragged.datums += _work(trainer, 4, 40, length=1).datums
    padded, launch = [], trainer.launch

    def counting(works):
        datums = [d for work in works for d in work.datums]
        padded.append(len(datums) * max(len(d.tokens) for d in datums))
        return launch(works)
    monkeypatch.setattr(trainer, "launch", counting)
    queue.open("ragged", 0)
    log = []
    queue.submit("ragged", _operation(0, log, work=ragged))
    while queue.round():
        pass
    assert len(log) == 1 and not isinstance(log[0][1], Exception) and len(log[0][1].losses) == 41
    assert max(padded) <= 24 and padded[0] == 24, padded  # the long datum with one short one, then the short alone


def test_an_answer_that_cannot_be_kept_fails_its_request_and_the_queue_goes_on(trainer):
    queue = TrainingQueue(trainer, max_pass_tokens=24)
    log = []

    def unkept(result):
        raise OverflowError("string or blob too big")  # (as SQLite said of a 1 GB answer)
    queue.open("a", 0)
    queue.submit("a", Operation(0, done=unkept, fail=lambda e: log.append(("a", e)), work=_work(trainer, 5, 1)))
    while queue.round():
        pass
    assert len(log) == 1 and isinstance(log[0][1], OverflowError)
    queue.open("b", 0)
    queue.submit("b", _operation(0, log, work=_work(trainer, 6, 1)))
    while queue.round():
        pass
    assert log[1][0] == 0 and log[1][1].losses


def expected_grads(trainer, seed):
    work = _work(trainer, seed, 20)
    trainer.run([work])
    return work.lora.named_tensors()


def test_operations_run_in_seq_order_calls_between_passes(trainer):
    queue = TrainingQueue(trainer)
    queue.open("a", 5)
    log = []
    queue.submit("a", _operation(7, log, call=lambda: "seven"))
    queue.submit("a", _operation(6, log, work=_work(trainer, 3, 2)))
    assert not queue.round(), "nothing runs before seq 5 comes"
    queue.submit("a", _operation(5, log, call=lambda: "five"))
    while queue.round():
        pass
    assert [seq for seq, _ in log] == [5, 6, 7] and log[0][1] == "five" and log[2][1] == "seven"


def test_a_failing_call_fails_alone_and_a_skipped_seq_lets_the_queue_go_on(trainer):
    queue = TrainingQueue(trainer)
    queue.open("a", 0)
    log = []

    def broken():
        raise ValueError("no such checkpoint")

    queue.submit("a", _operation(0, log, call=broken))
    queue.submit("a", _operation(2, log, call=lambda: "two"))
    queue.round()
    assert isinstance(log[0][1], ValueError)
    queue.skip("a", 1)
    queue.round()
    assert log[1] == (2, "two")


def test_the_optimizer_steps_of_a_round_run_together_and_each_answers_its_own(trainer, monkeypatch):
    """Three adapters' optimizer steps waiting at once: one `launch_steps` for all, each result from its own
    metrics; a step whose follow-up fails fails alone."""
    import symbiosis.train.scheduler as scheduler
    from symbiosis.train.lora import AdamParams

    calls = []
    real = scheduler.launch_steps
    monkeypatch.setattr(scheduler, "launch_steps", lambda steps: calls.append(len(steps)) or real(steps))
    queue, log = TrainingQueue(trainer), []
    works = {key: _work(trainer, seed, 1) for seed, key in enumerate("abc")}
    for key, work in works.items():
        queue.open(key, 0)
        queue.submit(key, _operation(0, log, work=work))
    queue.round()  # one pass: every adapter has gradients now

    def broken(metrics):
        raise RuntimeError("could not write the state")

    for key, work in works.items():
        follow_up = broken if key == "c" else (lambda metrics, key=key: (key, metrics["learning_rate:mean"]))
        queue.submit(key, Operation(1, done=lambda result: log.append((1, result)),
                                    fail=lambda e: log.append((1, e)), call=follow_up,
                                    step=(work.lora, AdamParams(0.01 if key == "a" else 0.02))))
    queue.round()
    assert calls == [3]
    answers = [result for seq, result in log if seq == 1]
    assert answers[:2] == [("a", 0.01), ("b", 0.02)] and isinstance(answers[2], RuntimeError)
    assert all(work.lora.steps == 1 and not work.lora.has_gradients() for work in works.values())


@pytest.mark.parametrize("ahead", ["both", "one"])
def test_steps_of_loops_that_send_ahead_are_answered_once_the_pass_is_queued(trainer, monkeypatch, ahead):
    """Loops that send their next forward_backward before their step's answer: the round queues the steps, then the
    pass (which sees the stepped matrices), and answers the steps while the pass runs, before the pass's answers.
    Where one loop waits for its step's answer instead, every step is answered before the pass."""
    from symbiosis.train.lora import AdamParams

    import contextlib

    @contextlib.contextmanager
    def answering():  # each group of answers in one (the service's: one database transaction)
        log.append("[")
        yield
        log.append("]")

    log = []
    queue = TrainingQueue(trainer, max_gather_s=0, answering=answering)
    real_launch = trainer.launch
    real_run = lambda works: real_launch(works).results()  # noqa: E731 -- a pass not logged
    monkeypatch.setattr(trainer, "launch", lambda works: log.append("pass") or real_launch(works))
    works = {key: _work(trainer, seed, 1) for seed, key in enumerate("ab")}
    for key, work in works.items():
        queue.open(key, 0)
        queue.submit(key, _operation(0, log, work=work))
    queue.round()
    log.clear()
    second = {}
    for key, work in works.items():
        queue.submit(key, Operation(1, done=lambda result, key=key: log.append((key, "step", result)),
                                    fail=lambda e: log.append(e), call=lambda metrics: metrics["grad_norm:mean"],
                                    step=(work.lora, AdamParams(0.01))))
        if ahead == "both" or key == "a":
            datum = _work(trainer, 7, 1).datums
            second[key] = Work(work.lora, datum, "cross_entropy")
            queue.submit(key, Operation(2, done=lambda result, key=key: log.append((key, "pass", result)),
                                        fail=lambda e: log.append(e), work=second[key]))
    before = {key: real_run([Work(w.lora, w.datums, "cross_entropy", backward=False)])[0].loss
              for key, w in second.items()}
    queue.round()
    kinds = [entry if isinstance(entry, str) else entry[1] for entry in log]
    assert all(not isinstance(entry, Exception) for entry in log), log
    if ahead == "both":
        assert kinds == ["pass", "[", "step", "step", "]", "[", "pass", "pass", "]"], \
            "steps answered while the pass runs"
    else:
        assert kinds == ["[", "step", "step", "]", "pass", "[", "pass", "]"], \
            "a loop waiting for its answer gets it before the pass"
        queue.round()
    assert all(work.lora.steps == 1 for work in works.values())
    for key, w in second.items():  # the pass ran on the stepped matrices (which it does not change)
        loss = next(entry[2].loss for entry in log if not isinstance(entry, str) and entry[:2] == (key, "pass"))
        after = real_run([Work(w.lora, w.datums, "cross_entropy", backward=False)])[0].loss
        assert loss == pytest.approx(after, rel=1e-12) and abs(loss - before[key]) > 1e-9
    assert all(step > 0 for _, kind, step in (e for e in log if not isinstance(e, str)) if kind == "step")


def test_steps_sent_with_their_pass_by_loops_that_wait_are_answered_with_the_pass(trainer):
    """tinker-cookbook's loop: forward_backward and optim_step sent together, then both answers awaited. The step
    is queued while the pass runs: it is taken right after the pass (on that pass's gradients) and answered in the
    pass's group of answers, not in a round of its own; a step with a request queued behind it (a loop that sends
    ahead) is left to the next round."""
    from symbiosis.train.lora import AdamParams

    import contextlib

    @contextlib.contextmanager
    def answering():
        log.append("[")
        yield
        log.append("]")

    log = []
    queue = TrainingQueue(trainer, max_gather_s=0, answering=answering)
    works = {key: _work(trainer, seed, 1) for seed, key in enumerate("abc")}
    for key, work in works.items():
        queue.open(key, 0)
        queue.submit(key, Operation(0, done=lambda result, key=key: log.append((key, "pass")),
                                    fail=lambda e: log.append(e), work=work))
        queue.submit(key, Operation(1, done=lambda result, key=key: log.append((key, "step", result)),
                                    fail=lambda e: log.append(e), call=lambda metrics: metrics["grad_norm:mean"],
                                    step=(work.lora, AdamParams(0.01))))
    ahead = _work(trainer, 9, 1)  # c sends its next forward_backward ahead
    queue.submit("c", Operation(2, done=lambda result: log.append(("c", "pass")), fail=lambda e: log.append(e),
                                work=Work(works["c"].lora, ahead.datums, "cross_entropy")))
    assert queue.round()
    assert all(not isinstance(entry, Exception) for entry in log), log
    shape = [entry if isinstance(entry, str) else entry[:2] for entry in log]
    assert shape == ["[", ("a", "pass"), ("b", "pass"), ("c", "pass"), "[", ("a", "step"), ("b", "step"), "]", "]"]
    assert [works[key].lora.steps for key in "abc"] == [1, 1, 0]
    assert all(result > 0 for entry in log if not isinstance(entry, str) and entry[1] == "step"
               for result in [entry[2]])
    log.clear()
    assert queue.round()  # c's step, then its next pass
    assert works["c"].lora.steps == 1 and ("c", "pass") in log


def test_clients_answered_together_are_awaited_so_their_loops_stay_in_one_pass(trainer, monkeypatch):
    """Four client threads, each a loop of forward_backward then optimizer step, each waiting for its answers: the
    queue waits for the adapters it answered, so every pass holds all four (without it the loops split into groups
    that take turns, a fraction of the tenants a pass)."""
    import threading

    import symbiosis.train.scheduler as scheduler
    from symbiosis.train.lora import AdamParams

    monkeypatch.setattr(scheduler, "GATHER_FRACTION", 1e9)  # the bound: max_gather_s alone
    monkeypatch.setattr(scheduler, "GATHER_QUIET_S", 60.0)
    passes = []
    real = trainer.launch
    monkeypatch.setattr(trainer, "launch", lambda works: passes.append(len(works)) or real(works))
    queue = TrainingQueue(trainer, max_gather_s=60)
    works = {key: _work(trainer, seed, 1) for seed, key in enumerate("abcd")}
    answered = {key: threading.Event() for key in works}
    errors = []

    def run(key, seq, **kind):
        answered[key].clear()
        queue.submit(key, Operation(seq, done=lambda result: answered[key].set(),
                                    fail=lambda e: (errors.append(e), answered[key].set()), **kind))
        assert answered[key].wait(60)

    def loop(key):
        work = works[key]
        for i in range(3):
            if i:  # the first forward_backward of every client is submitted before the queue starts
                run(key, 2 * i, work=work)
            run(key, 2 * i + 1, call=lambda metrics: metrics, step=(work.lora, AdamParams(1e-3)))

    for key, work in works.items():
        queue.open(key, 0)
        queue.submit(key, Operation(0, done=lambda result, key=key: answered[key].set(), fail=errors.append,
                                    work=work))
    queue.start()
    try:
        for key in works:
            assert answered[key].wait(60)
        threads = [threading.Thread(target=loop, args=(key,)) for key in works]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        # each round started when the last awaited adapter came: a wake-up missed would have waited the 60 s bound
        assert time.monotonic() - began < 30
    finally:
        queue.stop()  # at once: a stopping queue's gather does not wait for the loops that ended
    assert not errors
    assert passes == [4, 4, 4]
    assert all(work.lora.steps == 3 for work in works.values())


def test_an_adapter_that_does_not_come_back_delays_the_others_at_most_the_bound(trainer):
    queue, log = TrainingQueue(trainer, max_gather_s=0.05), []
    for key in "ab":
        queue.open(key, 0)
    queue.submit("a", _operation(0, log, work=_work(trainer, 1, 1)))
    queue.round()  # "a" answered: expected back, and never comes
    queue.submit("b", _operation(0, log, work=_work(trainer, 2, 1)))
    assert queue.round() and [seq for seq, _ in log] == [0, 0], "b ran once the bound had passed"


def test_a_loop_answered_its_step_joins_the_pass_of_the_same_round(trainer):
    """Loops out of phase (one adapter's forward_backward waiting while another's optimizer step is): the stepped
    adapter's next forward_backward, sent as its step is answered, joins the round's pass instead of waiting for
    the next round, where the first adapter would be stepping. Without it the two stay split for good."""
    from symbiosis.train.lora import AdamParams

    queue = TrainingQueue(trainer)
    first, second = _work(trainer, 1, 1), _work(trainer, 2, 1)
    log = []
    queue.open("a", 0)
    queue.open("b", 0)
    queue.submit("a", _operation(0, log, work=first))  # a: its forward_backward
    # b: its step, on whose answer its loop sends the next forward_backward at once
    queue.submit("b", Operation(0, done=lambda result: (log.append(("b step", result)), queue.submit(
        "b", _operation(1, log, work=second))), fail=lambda e: log.append(("b step", e)), call=lambda m: m,
        step=(second.lora, AdamParams(0.01))))
    assert queue.round()
    assert queue.passes == 1
    finished = [entry[0] for entry in log]
    assert finished == ["b step", 0, 1] and all(not isinstance(r, Exception) for _, r in log), log
    assert not queue.round()  # nothing left for another round


class _Timed:
    """A pass's results as a GPU gives them: computed already (on the CPU, at launch), ready at `ready_at`."""

    def __init__(self, flight, ready_at: float):
        self.flight, self.ready_at = flight, ready_at

    def done(self) -> bool:
        return time.monotonic() >= self.ready_at

    def results(self):
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return self.flight.results()


class _OnADevice:
    """The trainer, its passes timed as a device's queue runs them: one at a time, `pass_s` each, after the launch
    returns (so the queue may launch the next pass while one runs, `Trainer.overlaps`)."""
    overlaps = True

    def __init__(self, trainer, pass_s: float):
        self.trainer, self.pass_s, self.free_at = trainer, pass_s, 0.0
        self.passes = []  # each pass's adapters

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def launch(self, works):
        flight = self.trainer.launch(works)
        self.free_at = max(time.monotonic(), self.free_at) + self.pass_s
        self.passes.append(len(works))
        return _Timed(flight, self.free_at)


def _lock_step_loops(queue, works, iterations, round_trip_s, dtype=torch.float64, adam=None):
    """tinker-cookbook's loop for each adapter on a thread of its own: forward_backward and optim_step sent
    together, both answers awaited, then its next iteration `round_trip_s(key, iteration)` seconds later. Returns
    each adapter's losses. `adam`: the steps' hyperparameters (by default a rate and an eps under which rounding
    stays rounding: AdamW at Tinker's eps of 1e-12 and a rate of 0.05 makes it percents within 20 steps)."""
    import threading

    from symbiosis.train.lora import AdamParams

    adam = adam or AdamParams(1e-3, eps=1e-8)

    losses = {key: [] for key in works}
    errors = []
    sent = threading.Barrier(len(works) + 1)  # every loop's first requests queued before the queue starts

    def loop(key):
        for i in range(iterations):
            answered = threading.Semaphore(0)
            work = Work(works[key].lora, _datums(key, i, dtype), "cross_entropy")
            queue.submit(key, Operation(2 * i, fail=lambda e: (errors.append(e), answered.release()), work=work,
                                        done=lambda result: (losses[key].append(result.loss), answered.release())))
            queue.submit(key, Operation(2 * i + 1, done=lambda result: answered.release(),
                                        fail=lambda e: (errors.append(e), answered.release()),
                                        call=lambda metrics: metrics, step=(work.lora, adam)))
            if i == 0:
                sent.wait(60)
            assert answered.acquire(timeout=60) and answered.acquire(timeout=60)
            time.sleep(round_trip_s(key, i))

    for key in works:
        queue.open(key, 0)
    threads = [threading.Thread(target=loop, args=(key,)) for key in works]
    try:
        for thread in threads:
            thread.start()
        sent.wait(60)
        queue.start()
        for thread in threads:
            thread.join(120)
    finally:
        queue.stop()
    assert not errors, errors
    return losses


def _datums(key, iteration, dtype=torch.float64):
    generator = torch.Generator().manual_seed(1000 * ord(key) + iteration)
    return [Datum(torch.randint(0, 128, (6,), generator=generator).tolist(),
                  {"target_tokens": torch.randint(0, 128, (6,), generator=generator),
                   "weights": torch.ones(6, dtype=dtype)})]


def _alone(trainer, seed, key, iterations, dtype=torch.float64, adam=None):
    """The losses of the same loop's adapter trained alone, pass by pass."""
    from symbiosis.train.lora import AdamParams, launch_steps

    adam = adam or AdamParams(1e-3, eps=1e-8)
    lora = _work(trainer, seed, 1).lora
    losses = []
    for i in range(iterations):
        losses.append(trainer.run([Work(lora, _datums(key, i, dtype), "cross_entropy")])[0].loss)
        launch_steps([(lora, adam)])()
    return losses


def test_on_a_device_clients_slow_to_come_back_train_in_two_halves_that_overlap_until_they_are_quick(trainer):
    """Lock-step loops that come back over a tenth of a pass or more, on a device that runs a pass after its
    launch: the queue launches a pass once half of them are back, keeps it in flight while the other half gathers,
    launches theirs behind it, and only then answers the first (so its clients come back while the device runs the
    second). When they come back at once, one pass holds them all again. Each adapter's losses are those of its
    loop alone."""
    # a pass of 0.2 s, and round trips 12 ms apart (within GATHER_QUIET_S) up to 36 ms: a whole gather idle well
    # past SPLIT_AT of a pass, and the slow half's round trip past UNSPLIT_AT of two, on a loaded 2-core machine too
    # (where the launch's own arithmetic of a pass may take tens of milliseconds)
    on_device = _OnADevice(trainer, pass_s=0.2)
    queue = TrainingQueue(on_device)
    keys = "abcd"
    works = {key: _work(trainer, seed, 1) for seed, key in enumerate(keys)}
    iterations = 12  # (the split starts after two whole gathers: a few iterations in)
    # then they come back at once (as loops that send ahead do): one pass for all again
    losses = _lock_step_loops(queue, works, iterations + 6,
                              lambda key, i: 0.012 * keys.index(key) if i < iterations else 0.0)
    assert queue.overlapped >= 8, "passes launched while another was in flight"
    assert on_device.passes.count(2) >= 8, on_device.passes
    assert on_device.passes[-3:] == [4, 4, 4], str(on_device.passes)
    for seed, key in enumerate(keys):
        assert losses[key] == pytest.approx(_alone(trainer, seed, key, iterations + 6), rel=1e-10)


def test_on_a_device_clients_that_come_back_at_once_stay_in_one_pass(trainer):
    """The same loops coming back at once: every pass holds all of them, answered as soon as it is done."""
    on_device = _OnADevice(trainer, pass_s=0.2)
    queue = TrainingQueue(on_device)
    works = {key: _work(trainer, seed, 1) for seed, key in enumerate("abcd")}
    losses = _lock_step_loops(queue, works, 5, lambda key, i: 0.0)
    assert queue.overlapped == 0 and on_device.passes == [4] * 5, on_device.passes
    for seed, key in enumerate("abcd"):
        assert losses[key] == pytest.approx(_alone(trainer, seed, key, 5), rel=1e-10)


@pytest.mark.parametrize("device", [False, True])
def test_a_pass_that_fails_fails_its_requests_and_steps_and_the_queue_goes_on(trainer, monkeypatch, device):
    """A pass whose launch fails (out of memory, say): its forward_backward requests fail with the reason, the
    gradients their adapters gathered since their last step are dropped (a step sent with the pass takes none:
    its adapter is as before), and the next requests run as usual. On a device (`overlaps`) and on the CPU."""
    from symbiosis.train.lora import AdamParams

    home = _OnADevice(trainer, pass_s=0.01) if device else trainer
    queue, log = TrainingQueue(home, max_gather_s=0), []
    works = {key: _work(trainer, seed, 2) for seed, key in enumerate("ab")}
    before = {key: work.lora.flat.clone() for key, work in works.items()}
    real_launch = home.launch
    launches = []

    def launch(works_):
        launches.append(len(works_))
        if len(launches) == 1:
            real_launch(works_[:1])  # a part of the pass ran (gradients gathered), then it failed
            raise RuntimeError("CUDA out of memory")
        return real_launch(works_)

    monkeypatch.setattr(home, "launch", launch)
    for key, work in works.items():
        queue.open(key, 0)
        queue.submit(key, _operation(0, log, work=work))
        queue.submit(key, Operation(1, done=lambda result, key=key: log.append((key, result)),
                                    fail=lambda e, key=key: log.append((key, e)), call=lambda metrics: metrics,
                                    step=(work.lora, AdamParams(0.1))))
    while queue.round():
        pass
    failures = [result for seq, result in log if seq == 0]
    assert len(failures) == 2 and all("the training pass failed (RuntimeError: CUDA out of memory)" in str(e)
                                      for e in failures), log
    steps = {key: result for key, result in log if key in works}
    assert all(steps[key]["grad_norm:mean"] == 0.0 for key in works), steps  # nothing left to step on
    for key, work in works.items():
        assert not work.lora.has_gradients()
        torch.testing.assert_close(work.lora.flat, before[key], rtol=0, atol=0)
    for key, work in works.items():  # the queue goes on
        queue.submit(key, _operation(2, log, work=work))
    while queue.round():
        pass
    assert [type(result).__name__ for seq, result in log if seq == 2] == ["Result", "Result"]


class _Lagging:
    """A GPU trainer whose device lags its host by a sleep kernel before each pass: the host launches the next pass
    while the device still has the last one queued (a small model's passes are otherwise done as launched)."""

    def __init__(self, trainer, cycles: int):
        self.trainer, self.cycles = trainer, cycles

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def launch(self, works):
        torch.cuda._sleep(self.cycles)
        return self.trainer.launch(works)


@pytest.mark.gpu
def test_on_a_gpu_passes_in_flight_train_each_adapter_as_alone(tmp_path):
    """On a GPU whose queue runs behind the host: lock-step loops slow to come back split into halves, a pass
    launched while the last one is queued (the decoder's graphs' static buffers, the steps launched behind a pass,
    the results copied to pinned memory behind an event); each adapter's losses are those of its loop alone.
    float32, where passes of other sizes round otherwise, and a small learning rate: AdamW with Tinker's eps of
    1e-12 and a rate of 0.05 turns the rounding into percents within five steps (measured on the CPU in float32,
    without passes in flight), a rate of 1e-3 keeps it at 1e-7."""
    from symbiosis.train.lora import AdamParams

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    make_checkpoint("llama", tmp_path)
    trainer = Trainer(tmp_path, symbiosis.Executor.from_pretrained(tmp_path, device="cuda", dtype=torch.float32))
    queue = TrainingQueue(_Lagging(trainer, cycles=150_000_000))  # ~0.1 s a pass on an H100
    keys = "abcd"
    works = {key: _work(trainer, seed, 1) for seed, key in enumerate(keys)}
    iterations, adam = 12, AdamParams(1e-3, eps=1e-8)
    losses = _lock_step_loops(queue, works, iterations, lambda key, i: 0.005 * keys.index(key), torch.float32, adam)
    assert queue.overlapped >= iterations // 2
    for seed, key in enumerate(keys):
        assert losses[key] == pytest.approx(_alone(trainer, seed, key, iterations, torch.float32, adam), rel=1e-4)
