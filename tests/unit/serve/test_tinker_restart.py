"""`symbiosis serve` killed (SIGKILL) while it trains, then started again on its state dir: the tinker SDK client
that retries gets answers. Its last completed optimizer step is there; a request that was accepted and had not
finished fails with a server error saying so (it never runs twice); gradients gathered and not yet applied are
reported lost, once; the model goes on."""

from __future__ import annotations

import os
import signal
import sqlite3
import time

import pytest

from conftest import launch, terminate

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

KEY = "tml-carol-0123456789abcdef"


def _wait_accepted(state, kind: str) -> None:
    """Until the service has accepted a request of this kind that is still running (its row in the database)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with sqlite3.connect(state / "symbiosis.db") as db:
            if db.execute("SELECT 1 FROM tinker_requests WHERE kind = ? AND status = 'pending'", (kind,)).fetchone():
                return
        time.sleep(0.01)
    raise AssertionError(f"no {kind} request was accepted")


def _kill(process) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(30)


def test_a_killed_service_comes_back_with_every_completed_step_and_says_what_it_lost(served_files, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"carol {KEY}\n")
    state = tmp_path / "state"
    # passes of one datum: the big request below takes hundreds of them, so it is still running when the kill comes
    options = ("--served-model-name", "tiny", "--max-pass-tokens", "8", "--persist-every", "1")
    process, url = launch(served_files["model"], state, keys, *options)
    try:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        tokens = training.get_tokenizer()("the cat sat on the mat and the dog sat on the log")["input_ids"]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        adam = types.AdamParams(learning_rate=1e-2)
        for _ in range(2):
            training.forward_backward([datum], "cross_entropy")
            training.optim_step(adam).result()
        after_two = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        in_flight = training.forward_backward([datum] * 512, "cross_entropy")  # accepted, then killed while it runs
        _wait_accepted(state, "forward_backward")
        _kill(process)

        process, url2 = launch(served_files["model"], state, keys, *options, port=int(url.rsplit(":", 1)[1]))
        with pytest.raises(tinker.RequestFailedError, match="restarted before this request was answered") as failed:
            in_flight.result()
        assert failed.value.category == types.RequestErrorCategory.Server
        assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(after_two,
                                                                                                     rel=1e-12)
        # gradients gathered and not applied when the service dies are lost: said once, at the next request
        training.forward_backward([datum], "cross_entropy").result()
        _kill(process)
        process, _ = launch(served_files["model"], state, keys, *options, port=int(url.rsplit(":", 1)[1]))
        with pytest.raises(tinker.RequestFailedError, match="lost the gradients of 1 forward_backward"):
            training.optim_step(adam).result()
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(adam).result()
        assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] < after_two
        service.close("success")
    finally:
        terminate(process)
