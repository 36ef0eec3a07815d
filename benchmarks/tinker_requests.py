"""The service's CPU time per Tinker API request: what each SDK call costs the process that also runs the training
pass (they share one interpreter, so this is time the pass's host thread waits for).

A loopback `symbiosis serve` on a model (tiny by default: the request path alone), one tenant's training model made
through the API, then a client process (the standard library's HTTP client, one kept-alive connection) calling
`retrieve_future` on the answered `create_model` request `--requests` times. Prints the client's wall milliseconds
per request and the service process's CPU milliseconds per request (it does nothing else meanwhile).

    python benchmarks/tinker_requests.py --requests 3000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import CONFIGS, checkpoint, device, dtype, emit, with_tokenizer

KEY = "tml-tenant-0000-0123456789"
CLIENT = r'''
import http.client, json, sys, time
port, n, key = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
connection = http.client.HTTPConnection("127.0.0.1", port)

def post(path, body):
    connection.request("POST", "/api/v1/" + path, json.dumps(body), {"X-API-Key": key,
                                                                     "Content-Type": "application/json"})
    response = connection.getresponse()
    return json.loads(response.read())

session = post("create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.38.0",
                                  "type": "create_session"})["session_id"]
request_id = post("create_model", {"session_id": session, "model_seq_id": 0, "base_model": "base",
                                   "lora_config": {"rank": 4}, "type": "create_model"})["request_id"]
while post("retrieve_future", {"request_id": request_id}).get("type") == "try_again":
    pass
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
for _ in range(n):
    post("retrieve_future", {"request_id": request_id})
print(json.dumps({"wall_ms_per_request": (time.perf_counter() - start) * 1e3 / n}), flush=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    import uvicorn

    from symbiosis.serve.app import create_app
    from symbiosis.serve.service import Service

    model_dir = with_tokenizer(checkpoint(args.model))
    state = Path(tempfile.mkdtemp())
    keys = state / "keys"
    keys.write_text(f"tenant {KEY}\n")
    service = Service(model_dir, state / "state", keys, device=device(), dtype=dtype(), served_name="base",
                      engine_options={"kv_blocks": 64}, training={"persist_every": 10**9}).start()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(args.requests), KEY],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if client.stdout.readline().strip() != "ready":
        raise SystemExit("the client failed before its window (its traceback is above)")
    cpu = time.process_time()
    client.stdin.write("go\n")
    client.stdin.flush()
    measured = json.loads(client.stdout.readline())
    cpu = time.process_time() - cpu
    client.wait()
    emit(bench="tinker_requests", model=args.model, route="retrieve_future", requests=args.requests, **measured,
         service_cpu_ms_per_request=cpu * 1e3 / args.requests)
    server.should_exit = True
    service.close()
    os._exit(0)  # (the service's threads are daemons; no teardown race with the server's loop)


if __name__ == "__main__":
    main()
