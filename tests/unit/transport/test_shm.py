"""A client's description of its CUDA buffer is hostile: the executor maps only what the driver says the client
allocated, on the executor's device, and never touches a file the client names."""

import base64
import gc
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from symbiosis.errors import BadCall
from symbiosis.transport.ipc.shm import IPC_HANDLE_BYTES, SharedBuffer

HANDLE = base64.b64encode(bytes(IPC_HANDLE_BYTES)).decode()
GOOD = {"kind": "cuda", "nbytes": 4096, "handle": HANDLE}


@pytest.mark.parametrize("change, named", [
    ({"kind": "cpu"}, "describes only CUDA buffers"),
    ({"handle": base64.b64encode(b"x" * 10).decode()}, "64 bytes, not 10"),
    # torch's expandable-segment handle: a version, a kind ('e') and a process id and descriptors to take
    ({"handle": base64.b64encode(b"\x02e" + bytes(80)).decode()}, "64 bytes, not 82"),
    ({"handle": "not base64!"}, "cannot map"),
    ({"nbytes": 0}, "positive number of bytes"),
    ({"nbytes": True}, "positive number of bytes"),
    ({"nbytes": "4096"}, "positive number of bytes"),
])
def test_a_malformed_description_is_refused_before_anything_is_mapped(change, named):
    with pytest.raises(BadCall, match=named):
        SharedBuffer.open_cuda({**GOOD, **change}, torch.device("cuda", 0))


def test_a_description_without_a_handle_is_refused():
    with pytest.raises(BadCall, match="handle"):
        SharedBuffer.open_cuda({k: v for k, v in GOOD.items() if k != "handle"}, torch.device("cuda", 0))


CLIENT = textwrap.dedent("""
    import json, sys, torch
    from symbiosis.transport.ipc.shm import SharedBuffer
    buffer = SharedBuffer.create_cuda(1 << 20, torch.device("cuda", 0))
    buffer.tensor.copy_(torch.arange(1 << 20, device="cuda") % 251)
    torch.cuda.synchronize()
    print(json.dumps(buffer.description), flush=True)
    sys.stdin.read()  # the buffer lives until the test is done
""")


@pytest.fixture
def client_buffer():
    """A CUDA buffer of 1 MiB (bytes i % 251) allocated by another process, described as the client describes it."""
    process = subprocess.Popen([sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        yield json.loads(process.stdout.readline())
    finally:
        process.stdin.close()
        process.wait(timeout=60)


@pytest.mark.gpu
def test_a_true_description_maps_the_clients_bytes(client_buffer):
    buffer = SharedBuffer.open_cuda(client_buffer, torch.device("cuda", 0))
    assert buffer.nbytes == 1 << 20
    assert torch.equal(buffer.tensor.cpu(), torch.arange(1 << 20) % 251)
    buffer.close()


@pytest.mark.gpu
def test_a_size_past_the_clients_allocation_is_refused(client_buffer):
    with pytest.raises(BadCall, match="claims .* bytes of an allocation of"):
        SharedBuffer.open_cuda({**client_buffer, "nbytes": (1 << 20) + (4 << 20)}, torch.device("cuda", 0))


@pytest.mark.gpu
def test_the_clients_ref_counter_file_is_never_touched(client_buffer, tmp_path):
    """torch's own sharing decrements an int64 at the sender's `ref_offset` in the file it names when the receiver
    drops the mapping: an executor that followed a client's would write into another tenant's counter, or past the
    file."""
    from multiprocessing import shared_memory

    counters = shared_memory.SharedMemory(create=True, size=8 * 10000)
    try:
        view = torch.frombuffer(counters.buf, dtype=torch.int64)
        view.fill_(5)
        for offset in (0, 3, 10 ** 9):
            description = {**client_buffer, "ref_handle": base64.b64encode(f"/{counters.name}".encode()).decode(),
                           "ref_offset": offset}
            buffer = SharedBuffer.open_cuda(description, torch.device("cuda", 0))
            buffer.close()
            del buffer
            gc.collect()
            torch.cuda.synchronize()
        assert torch.all(view == 5)
        del view
    finally:
        counters.close()
        counters.unlink()
