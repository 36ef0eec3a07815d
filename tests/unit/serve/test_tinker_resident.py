"""The Tinker API's training models in memory (serve/tinker/service.py, `resident_models`): beyond the budget the
least recently used idle ones leave memory and come back from their live copy at their next request, and train
exactly as models that never left; a model with gradients not yet stepped, or a request in the queue, stays; steps
not yet on disk (persist_every > 1) are written when a model leaves; a live copy that cannot be read is answered as
no training model. Driven by the official `tinker` SDK on loopback, float64 on the CPU."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import tinker_server
from symbiosis.errors import BadCall
from symbiosis.train.trainer import Datum

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

TINKER_KEYS = {"alice": "tml-alice-0123456789abcdef"}
TEXT = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree."
ADAM = types.AdamParams(learning_rate=1e-2)


# two models in memory when idle; state written every third step (else when a model leaves memory)
budget_server = tinker_server(TINKER_KEYS, training={"resident_models": 2, "persist_every": 3})


@pytest.fixture
def service(budget_server):
    client = tinker.ServiceClient(base_url=budget_server.url, api_key=TINKER_KEYS["alice"])
    yield client
    client.close("success")


class Reads(list):
    on_loop = 0  # of them, how many ran on the event loop's thread (stopping every tenant's requests meanwhile)


@pytest.fixture
def loads(budget_server, monkeypatch):
    """The models read back from their live copy, in order."""
    tinker_api, read = budget_server.service.tinker, Reads()
    load = tinker_api._load

    def counted(model, directory, with_optimizer):
        if directory == tinker_api._live(model):
            read.append(model)
            try:
                asyncio.get_running_loop()
                read.on_loop += 1
            except RuntimeError:
                pass
        return load(model, directory, with_optimizer)
    monkeypatch.setattr(tinker_api, "_load", counted)
    return read


def in_memory(tinker_api):
    """The models in memory once the evictions asked for so far are done (they run on a thread of their own)."""
    assert tinker_api.settle()
    return tinker_api.loras


def _datum(training):
    ids = training.get_tokenizer()(TEXT)["input_ids"]
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def _trained(service, seeds, datum, resident, rounds=2):
    """Models of these seeds, each a forward_backward and an optimizer step in turn, `rounds` times: (models, every
    answer's loss and gradient norm in order), `resident` checked after each answer."""
    models = [service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
              for seed in seeds]
    resident()
    answers = []
    for _ in range(rounds):
        for training in models:
            answers.append(training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            resident()
            answers.append(training.optim_step(ADAM).result().metrics["grad_norm:mean"])
            resident()
    return models, answers


def _model_and_datum(service, seed: int) -> tuple[str, Datum]:
    """A new model, and a datum of TEXT as the service's own (for requests submitted to it directly)."""
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
    return training.model_id, _raw_datum(training)


def _answer(tinker_api, request_id: str, timeout: float = 30) -> dict:
    """The row of a request submitted to the service directly, once answered (or at the deadline)."""
    deadline = time.monotonic() + timeout
    while (row := tinker_api.store.request("alice", request_id))["status"] == "pending" and time.monotonic() < deadline:
        time.sleep(0.01)
    return row


def _done(tinker_api, request_id: str) -> dict:
    row = _answer(tinker_api, request_id)
    assert row["status"] == "done", row
    return row


def _raw_datum(training) -> Datum:
    ids = training.get_tokenizer()(TEXT)["input_ids"]
    return Datum(ids[:-1], {"target_tokens": torch.tensor(ids[1:]),
                            "weights": torch.ones(len(ids) - 1, dtype=torch.float64)})


def _state(tinker_api, training, name):
    """A model's matrices and AdamW moments, as save_state writes them."""
    directory = tinker_api.resolve("alice", training.save_state(name).result().path)[1]
    return {**load_file(directory / "adapter_model.safetensors"), **load_file(directory / "optimizer.safetensors")}


def test_models_beyond_the_budget_leave_memory_and_come_back_exactly(budget_server, service, loads, monkeypatch):
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 100)  # the reference: every model stays in memory
    reference = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=99).result()
    datum = _datum(reference)
    seeds = [11, 12, 13, 14]
    expected_models, expected = _trained(service, seeds, datum, lambda: None)
    expected_losses = [m.forward([datum], "cross_entropy").result().metrics["loss:sum"] for m in expected_models]
    expected_states = [_state(tinker_api, m, "end") for m in expected_models]
    assert not loads

    monkeypatch.setattr(tinker_api, "resident_models", 2)
    sizes = []

    def resident():
        sizes.append(len(in_memory(tinker_api)))
        assert len(in_memory(tinker_api)) <= 2, list(in_memory(tinker_api))
    models, answers = _trained(service, seeds, datum, resident)
    assert answers == expected  # every loss and gradient norm, exactly
    assert [m.forward([datum], "cross_entropy").result().metrics["loss:sum"] for m in models] == expected_losses
    for training, reference_state in zip(models, expected_states):  # matrices and AdamW moments, exactly
        state = _state(tinker_api, training, "end")
        assert state.keys() == reference_state.keys()
        assert all(torch.equal(state[name], reference_state[name]) for name in state)
    # each of the four read back at each of its turns of the second round (two in memory, round robin) and more
    assert set(loads) == {m.model_id for m in models} and len(loads) >= 8, loads
    assert loads.on_loop == 0  # forward_backward and optim_step read a model back on a worker thread
    assert max(sizes) == 2
    assert set(budget_server.service.tinker.owners) >= {m.model_id for m in models}  # none was dropped


def test_a_model_with_gradients_not_yet_stepped_leaves_with_them_and_its_step_uses_them(budget_server, service,
                                                                                          loads, monkeypatch):
    """Gradients gathered and not yet stepped do not hold a model in memory (a tenant could hold any number so): it
    leaves with them written beside its live copy, and its step, once it is read back, uses them exactly."""
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 100)
    first = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=21).result()
    datum = _datum(first)
    references = [first, service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=22).result()]
    expected = []
    for training in references:
        training.forward_backward([datum], "cross_entropy").result()
        expected.append((training.optim_step(ADAM).result().metrics["grad_norm:mean"],
                         training.forward([datum], "cross_entropy").result().metrics["loss:sum"]))

    monkeypatch.setattr(tinker_api, "resident_models", 2)
    waiting = [service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
               for seed in (21, 22)]
    for training in waiting:  # gradients gathered, no step yet
        training.forward_backward([datum], "cross_entropy").result()
    for seed in (31, 32, 33):  # more models than the budget, used while the two wait for their steps
        other = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
        other.forward_backward([datum], "cross_entropy").result()
        other.optim_step(ADAM).result()
        assert len(in_memory(tinker_api)) <= 2
    assert not {m.model_id for m in waiting} & set(in_memory(tinker_api))  # both left memory, with their gradients
    assert all(tinker_api._gradients(m.model_id).is_file() for m in waiting)
    got = []
    for training in waiting:
        got.append((training.optim_step(ADAM).result().metrics["grad_norm:mean"],
                    training.forward([datum], "cross_entropy").result().metrics["loss:sum"]))
    assert got == expected and all(norm > 0 for norm, _ in got)
    assert {m.model_id for m in waiting} <= set(loads)  # read back, gradients and all
    assert not any(tinker_api._gradients(m.model_id).exists() for m in waiting)  # deleted once read back
    assert len(in_memory(tinker_api)) <= 2


def test_gradients_that_cannot_be_read_back_fail_the_next_request_saying_so(budget_server, service, monkeypatch):
    """A damaged gradients file: the model's next request fails naming the loss, the ones after go on from its
    last step (as after a restart)."""
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 1)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=41).result()
    datum = _datum(training)
    training.forward_backward([datum], "cross_entropy").result()
    other = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=42).result()
    other.forward([datum], "cross_entropy").result()  # takes the one place: the first leaves with its gradients
    path = tinker_api._gradients(training.model_id)
    assert path.is_file()
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(Exception, match="lost the gradients"):
        training.optim_step(ADAM).result()
    assert not path.exists()
    training.forward_backward([datum], "cross_entropy").result()  # goes on
    assert training.optim_step(ADAM).result().metrics["grad_norm:mean"] > 0


def test_a_model_leaving_memory_writes_its_steps_not_yet_on_disk(budget_server, service, loads, monkeypatch):
    """persist_every 3: two steps are in memory only, until the model leaves memory; then on disk (a restart finds
    them: its check reads the live copy's step count)."""
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 1)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=41).result()
    datum = _datum(training)
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(ADAM).result()
    model = training.model_id
    live = tinker_api._live(model)

    def steps_on_disk():
        return json.loads((live / "trainer_state.json").read_text())["steps"]
    assert steps_on_disk() == 0 and in_memory(tinker_api)[model].steps == 2  # not written at those steps
    before = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    other = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=42).result()
    other.forward([datum], "cross_entropy").result()
    assert model not in in_memory(tinker_api)
    assert steps_on_disk() == 2 and tinker_api._live_steps(model) == 2
    assert tinker_api.store.model("alice", model)["completed_steps"] == 2  # a restart would report nothing lost
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] == before
    assert loads == [model] and in_memory(tinker_api)[model].steps == 2


def test_a_request_for_a_model_being_written_out_waits_for_the_write(budget_server, service, loads, monkeypatch):
    """A model leaving memory with steps not on disk is written first; a request for it meanwhile waits for that
    write and reads it back (not the older copy that the write replaces)."""
    import threading

    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 1)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=91).result()
    datum = _datum(training)
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(ADAM).result()  # step 1 of persist_every 3: in memory only
    before = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    live, write = tinker_api._live(training.model_id), tinker_api._write
    writing, go = threading.Event(), threading.Event()

    def slow_write(lora, directory, with_optimizer):
        if directory == live:
            writing.set()
            go.wait(60)
        return write(lora, directory, with_optimizer)
    monkeypatch.setattr(tinker_api, "_write", slow_write)
    got = []
    other = threading.Thread(target=lambda: service.create_lora_training_client(  # it makes `training` leave
        base_model="tiny-llama", rank=4, seed=92).result())
    other.start()
    again = threading.Thread(target=lambda: got.append(
        training.forward([datum], "cross_entropy").result().metrics["loss:sum"]))
    try:
        assert writing.wait(60)
        again.start()
        again.join(0.5)
        assert not loads and not got  # it waits
    finally:
        go.set()
    for thread in (other, again):
        thread.join(60)
    assert got == [before] and loads == [training.model_id]


def test_a_request_waiting_for_an_earlier_one_holds_nothing_and_trains_the_model_when_it_runs(budget_server,
                                                                                               service, monkeypatch):
    """A request whose seq_id comes after the model's next holds nothing while it waits (one tenant could hold any
    number of models so): the model leaves memory meanwhile, and the request binds its state when the queue comes
    to it, so it and the ones after it train the model's own state."""
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 1)
    model, datum = _model_and_datum(service, 61)
    seq = tinker_api.queue.next_seq(model)
    answer = functools.partial(_done, tinker_api)
    # its forward_backward waits in the queue for the forward before it
    waiting = tinker_api.submit_pass("alice", model, seq + 1, [datum], "cross_entropy", {}, backward=True)
    for seed in (62, 63):  # other models, over the budget, each with a request waiting too (else they would go
        # first: models with requests queued are evicted last)
        other = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
        other.forward([_datum(other)], "cross_entropy").result()
        tinker_api.submit_pass("alice", other.model_id, tinker_api.queue.next_seq(other.model_id) + 1, [datum],
                               "cross_entropy", {}, backward=False)
        assert model not in in_memory(tinker_api)
    answer(tinker_api.submit_pass("alice", model, seq, [datum], "cross_entropy", {}, backward=False))
    answer(waiting)
    stepped = answer(tinker_api.submit_optim_step("alice", model, seq + 2, {"learning_rate": 1e-2}))
    assert json.loads(stepped["result"])["metrics"]["grad_norm:mean"] > 0  # the gradients of the pass it bound
    assert in_memory(tinker_api)[model].steps == 1


def test_loops_at_once_over_the_budget_train_as_with_every_model_in_memory(budget_server, service, loads,
                                                                           monkeypatch):
    """Six loops on threads of their own, each sending its forward_backward and optimizer step and then waiting
    for both (tinker-cookbook's), two models in memory when idle: models leave and come back while others are in
    passes, the set goes over the budget while they are all busy, and every loss is the one every model in memory
    gets (to float64's rounding: the passes' groupings differ)."""
    import threading

    tinker_api = budget_server.service.tinker
    datum = _datum(service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=80).result())

    def run(budget):
        monkeypatch.setattr(tinker_api, "resident_models", budget)
        losses, errors = {}, []

        def loop(seed):
            try:
                client = tinker.ServiceClient(base_url=budget_server.url, api_key=TINKER_KEYS["alice"])
                training = client.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
                mine = []
                for _ in range(3):
                    passed = training.forward_backward([datum], "cross_entropy")
                    stepped = training.optim_step(ADAM)
                    mine.append(passed.result().metrics["loss:sum"])
                    stepped.result()
                mine.append(training.forward([datum], "cross_entropy").result().metrics["loss:sum"])
                losses[seed] = mine
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(e)
        threads = [threading.Thread(target=loop, args=(seed,)) for seed in range(81, 87)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        return losses

    expected = run(100)
    assert not loads
    got = run(2)
    assert loads  # models left memory and came back (~20 times here)
    assert got.keys() == expected.keys()
    for seed, losses in got.items():
        assert losses == pytest.approx(expected[seed], rel=1e-9), seed
    assert len(in_memory(tinker_api)) <= 2 and not tinker_api._held and not tinker_api._moving


def test_a_live_copy_that_cannot_be_read_is_no_training_model(budget_server, service, caplog, monkeypatch):
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 1)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=51).result()
    datum = _datum(training)
    service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=52).result()  # the first one leaves
    assert training.model_id not in in_memory(tinker_api)
    (tinker_api._live(training.model_id) / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with caplog.at_level(logging.ERROR, logger="symbiosis.serve.tinker"):
        for _ in range(2):  # logged once; then not read again
            with pytest.raises(tinker.BadRequestError, match="no training model"):
                training.forward([datum], "cross_entropy").result()
    logged = [r.getMessage() for r in caplog.records if "could not be restored" in r.getMessage()]
    assert len(logged) == 1 and training.model_id in logged[0], logged
    assert training.model_id not in tinker_api.owners


def test_serve_takes_the_budget_from_its_flag(served_files, tmp_path):
    from symbiosis.cli import main

    with pytest.raises(SystemExit, match="resident_models must be at least 1"):
        main(["serve", "--model", str(served_files["model"]), "--state-dir", str(tmp_path / "state"), "--api-keys",
              str(served_files["keys"]), "--resident-models", "0"])


def test_a_killed_service_has_the_steps_written_when_models_left_memory(served_files, tmp_path):
    """`symbiosis serve --resident-models 1 --persist-every 3` killed: a model that left memory after two steps
    comes back at them; the one in memory, at its last written step, says so once (its start read only the live
    copies' step counts), then goes on."""
    import signal

    from conftest import launch, terminate

    keys = tmp_path / "keys"
    keys.write_text(f"alice {TINKER_KEYS['alice']}\n")
    options = ("--served-model-name", "tiny-llama", "--persist-every", "3", "--resident-models", "1")
    process, url = launch(served_files["model"], tmp_path / "state", keys, *options)
    try:
        service = tinker.ServiceClient(base_url=url, api_key=TINKER_KEYS["alice"])
        left = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=71).result()
        datum = _datum(left)
        for _ in range(2):
            left.forward_backward([datum], "cross_entropy").result()
            left.optim_step(ADAM).result()
        loss = left.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        stayed = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=72).result()  # `left` goes
        stayed.forward_backward([datum], "cross_entropy").result()
        stayed.optim_step(ADAM).result()  # in memory only
        process.send_signal(signal.SIGKILL)
        process.wait(30)

        process, _ = launch(served_files["model"], tmp_path / "state", keys, *options, port=int(url.rsplit(":", 1)[1]))
        assert left.forward([datum], "cross_entropy").result().metrics["loss:sum"] == loss
        lost = r"lost optimizer steps 1\.\.1 \(the model is back at step 0"
        with pytest.raises(tinker.RequestFailedError, match=lost):
            stayed.forward([datum], "cross_entropy").result()
        assert stayed.forward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
        service.close("success")
    finally:
        terminate(process)


def test_a_replayed_create_model_leaves_the_trained_model_alone(budget_server, service, monkeypatch):
    """A create_model resent after its answer was pruned (so accepted as new) fails as existing, and writes
    nothing: the model keeps its trained state, in memory and once read back."""
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 1)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=7).result()
    datum = _datum(training)
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(ADAM).result()
    before = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    session, _, seq = training.model_id.rpartition(":train:")
    tinker_api.store.prune(0)  # (what keep_answers_s does in time): the create_model request's row goes
    row = _answer(tinker_api, tinker_api.create_model("alice", session, int(seq), "tiny-llama", {"rank": 4}))
    assert row["status"] == "failed" and "exists already" in row["error"]
    service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=9).result()  # it leaves memory
    assert training.model_id not in in_memory(tinker_api)
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] == before


def test_lost_gradients_fail_the_models_next_request_not_a_later_one(budget_server, service, monkeypatch):
    """The requests after a model's gradients were lost (unreadable on its way back) arrive out of order: the
    step sent after the forward_backward comes first. The loss is the forward_backward's to report (the queue's
    next), and the queue goes on past both."""
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 1)
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=3).result()
    model, datum = training.model_id, _raw_datum(training)
    seq = tinker_api.queue.next_seq(model)
    assert _answer(tinker_api, tinker_api.submit_pass("alice", model, seq, [datum], "cross_entropy", {},
                                                      backward=True))["status"] == "done"
    service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=4).result()  # it leaves, gradients too
    assert model not in in_memory(tinker_api) and tinker_api._gradients(model).is_file()
    tinker_api._gradients(model).write_bytes(b"\0" * 64)
    step = tinker_api.submit_optim_step("alice", model, seq + 2, {"learning_rate": 1e-2})
    first = tinker_api.submit_pass("alice", model, seq + 1, [datum], "cross_entropy", {}, backward=True)
    assert "lost the gradients" in _answer(tinker_api, first)["error"]
    assert _answer(tinker_api, step)["status"] != "pending"
    after = tinker_api.submit_pass("alice", model, seq + 3, [datum], "cross_entropy", {}, backward=False)
    assert _answer(tinker_api, after)["status"] == "done"


def test_evictions_write_outside_the_training_queues_answer_transaction(budget_server, service, monkeypatch):
    """A model leaving memory with its gradients is written on the eviction thread, not inside the transaction
    the training queue answers a round in (which holds the database for every tenant)."""
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 1)
    writes, write = [], tinker_api._write_gradients

    def spied(model, lora):
        writes.append((threading.current_thread().name, tinker_api.store.state._open_batch() is not None))
        write(model, lora)
    monkeypatch.setattr(tinker_api, "_write_gradients", spied)
    models = [service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
              for seed in (51, 52)]
    datum = _datum(models[0])
    for future in [training.forward_backward([datum], "cross_entropy") for training in models]:
        future.result()
    in_memory(tinker_api)
    assert writes and all(thread == "symbiosis-tinker-evict" and not inside for thread, inside in writes), writes


def test_requests_for_seq_ids_that_never_come_hold_no_model(budget_server, service, monkeypatch):
    """Requests far ahead of their models' next seq_id (which may never come) keep no model in memory."""
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 1)
    models = [service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=70 + i).result()
              for i in range(4)]
    datum = _raw_datum(models[0])
    for training in models:
        tinker_api.submit_pass("alice", training.model_id, 2**62, [datum], "cross_entropy", {}, backward=False)
    assert len(in_memory(tinker_api)) <= 1 and not tinker_api._held
    with pytest.raises(BadCall, match="not in 0..2"):  # (SQLite's integers end at 2^63 - 1: it was a 500)
        tinker_api.submit_pass("alice", models[0].model_id, 2**64 - 1, [datum], "cross_entropy", {}, backward=False)
    assert not tinker_api._held


def test_a_model_with_a_request_queued_leaves_memory_after_the_idle_ones(budget_server, service, loads, monkeypatch):
    """A loop's optimizer step sent behind its forward_backward binds the model when its turn comes: evicted in
    between, the model would be read back then, on the training thread. Idle models without requests go first,
    however recently used."""
    tinker_api = budget_server.service.tinker
    monkeypatch.setattr(tinker_api, "resident_models", 2)
    model, datum = _model_and_datum(service, 71)
    # a request behind one not sent yet: queued, holding nothing
    queued = tinker_api.submit_pass("alice", model, tinker_api.queue.next_seq(model) + 1, [datum], "cross_entropy",
                                    {}, backward=False)
    others = []
    for seed in (72, 73):  # each more recently used than the model, and idle once answered
        other = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=seed).result()
        other.forward([_datum(other)], "cross_entropy").result()
        others.append(other.model_id)
    assert set(in_memory(tinker_api)) == {model, others[1]}
    _done(tinker_api, tinker_api.submit_pass("alice", model, tinker_api.queue.next_seq(model), [datum],
                                             "cross_entropy", {}, backward=False))
    _done(tinker_api, queued)
    assert model not in loads  # never read back
