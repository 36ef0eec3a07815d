"""The front and the bridge alone (serve/front.py, serve/bridge.py), around small ASGI apps: what the service's own
app never does (fail before answering, leave a response unfinished), a body over the front's limit, and
messages that are not the wire's, which the service logs and outlives."""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import threading
import time

import pytest
import uvicorn
import zmq

from conftest import httpx


async def app(scope, receive, send):
    """/fail raises before answering; /unfinished sends a start and one chunk, then returns; anything else echoes
    its method, path, query and body."""
    if scope["path"] == "/fail":
        raise RuntimeError("a bug")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/unfinished":
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        return
    message = await receive()
    echo = f"{scope['method']} {scope['path']} {scope['query_string'].decode()} ".encode() + message["body"]
    await send({"type": "http.response.body", "body": echo})


@pytest.fixture
def bridged():
    """(the front's URL, the bridge's URL): `app` behind the bridge and one front, both in threads here."""
    from symbiosis.serve.bridge import AsgiHost
    from symbiosis.serve.front import Front

    url = f"ipc://{tempfile.mkdtemp(prefix='bridge-')}/bridge"
    _, stop_host = AsgiHost(app, url).serve_in_thread()
    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(Front(url, max_body_bytes=1000), log_level="warning", lifespan="on"))
    front = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    front.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", url
    server.should_exit = True
    front.join(30)
    stop_host()


def test_a_request_goes_through_whole(bridged):
    front, _ = bridged
    answer = httpx.post(front + "/echo?x=1", content=b"hello")
    assert answer.status_code == 200 and answer.text == "POST /echo x=1 hello"


def test_an_app_that_fails_before_answering_is_a_500_and_one_that_stops_midway_is_ended(bridged):
    front, _ = bridged
    failed = httpx.get(front + "/fail")
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert httpx.get(front + "/unfinished", timeout=10).content == b"part"  # ended, not left hanging


def test_a_body_over_the_fronts_limit_is_refused_there(bridged):
    front, _ = bridged
    refused = httpx.post(front + "/echo", content=b"x" * 1001)
    assert refused.status_code == 413 and "1000 bytes" in refused.json()["error"]["message"]
    assert httpx.post(front + "/echo", content=b"x" * 1000).status_code == 200


def test_messages_that_are_not_the_wires_are_logged_and_the_service_goes_on(bridged, caplog):
    front, url = bridged
    context = zmq.Context()
    stranger = context.socket(zmq.DEALER)
    stranger.connect(url)
    with caplog.at_level(logging.ERROR, logger="symbiosis.serve"):
        for frames in ([b"request", b"not json", b""], [b"request", json.dumps({"id": 1}).encode(), b""],
                       [b"request", json.dumps({"id": 2, "method": "GET", "path": "/", "headers": [[1, 2]]}).encode(),
                        b""], [b"what"], [b"gone", json.dumps({"id": 99}).encode()]):
            stranger.send_multipart(frames)
        deadline = time.monotonic() + 10
        while len([r for r in caplog.records if "malformed" in r.getMessage()]) < 4:
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
    stranger.close(0)
    context.term()
    assert httpx.post(front + "/echo", content=b"still here").text.endswith("still here")
