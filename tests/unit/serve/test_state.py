"""The service's SQLite state: a batch makes one thread's transactions one, tells its after-commit calls once it is
committed, loses all of it on an error, and holds other threads' writes until it ends."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from symbiosis.serve.state import StateStore


def _names(store: StateStore) -> list[str]:
    """The adapters' names as another connection sees them (committed rows only)."""
    with sqlite3.connect(store.path) as other:
        return sorted(name for (name,) in other.execute("SELECT name FROM adapters"))


def test_a_batch_commits_its_transactions_together_then_runs_its_after_commit_calls(tmp_path):
    store = StateStore(tmp_path)
    told = []
    with store.batch():
        assert store.add_adapter("t", "a", "a") and store.add_adapter("t", "b", "b")
        assert not store.add_adapter("t", "a", "again")  # a failed statement inside leaves the batch going
        store.after_commit(lambda: told.append(_names(store)))
        with store.batch():  # nested: part of the outer one
            store.add_adapter("t", "c", "c")
        assert store.adapter("t", "c") is not None  # its own thread reads what it wrote
        assert _names(store) == [] and told == []
    assert told == [["a", "b", "c"]]
    store.after_commit(lambda: told.append("now"))  # no batch open: at once
    assert told[-1] == "now"


def test_an_error_in_a_batch_loses_all_its_writes_and_calls(tmp_path):
    store = StateStore(tmp_path)
    told = []
    with pytest.raises(RuntimeError):
        with store.batch():
            store.add_adapter("t", "a", "a")
            store.after_commit(lambda: told.append(True))
            raise RuntimeError("a callback failed")
    assert _names(store) == [] and told == []
    store.add_adapter("t", "b", "b")  # the store goes on
    assert _names(store) == ["b"]


def test_other_threads_wait_for_a_batch(tmp_path):
    store = StateStore(tmp_path)
    order, inside = [], threading.Event()

    def other():
        inside.wait()
        store.add_adapter("u", "x", "x")
        order.append("other")

    thread = threading.Thread(target=other)
    thread.start()
    with store.batch():
        store.add_adapter("t", "a", "a")
        inside.set()
        thread.join(0.2)
        assert thread.is_alive()  # held at the database
        order.append("batch")
    thread.join(5)
    assert order == ["batch", "other"] and _names(store) == ["a", "x"]
