"""The service's API from the command line (`symbiosis jobs`, `symbiosis hmi`): standard library only, the key
from --api-key or $SYMBIOSIS_API_KEY, the service's error message on failure."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from pathlib import Path


def add_connection(parser) -> None:
    parser.add_argument("--base-url", default=os.environ.get("SYMBIOSIS_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("SYMBIOSIS_API_KEY") or os.environ.get("OPENAI_API_KEY"))


def call(args, path: str, method: str = "GET", body: dict | bytes | None = None, command: str = "symbiosis") -> dict:
    """The JSON answer of `method` `path` (under --base-url); SystemExit with the service's message on an error."""
    if not args.api_key:
        raise SystemExit(f"{command}: give --api-key (or set SYMBIOSIS_API_KEY)")
    headers = {"Authorization": f"Bearer {args.api_key}"}
    data = None
    if isinstance(body, bytes):  # multipart, from upload()
        boundary = body.split(b"\r\n", 1)[0][2:].decode()
        data, headers["Content-Type"] = body, f"multipart/form-data; boundary={boundary}"
    elif body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(args.base_url.rstrip("/") + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise SystemExit(f"{command}: {e.code}: {message}") from None
    except urllib.error.URLError as e:
        raise SystemExit(f"{command}: cannot reach {args.base_url}: {e.reason}") from None


def upload(args, path: str | Path, purpose: str, command: str = "symbiosis") -> str:
    """Upload a local file to /files; its id."""
    path = Path(path)
    try:
        content = path.read_bytes()
    except OSError as e:
        raise SystemExit(f"{command}: {path}: {e.strerror}") from None
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'.encode(),
             f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name.replace(chr(34), "_")}"\r\n'
             f"Content-Type: application/jsonl\r\n\r\n".encode() + content + b"\r\n",
             f"--{boundary}--\r\n".encode()]
    return call(args, "/files", "POST", b"".join(parts), command)["id"]
