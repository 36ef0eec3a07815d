"""PLOT's one-kernel lookups (kernels/plot_lookup.py) against the host's lookups (plot/lookup.py), for a decoder and
an encoder, with and without a domain table: on a GPU, or on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1` with Triton installed)."""

from __future__ import annotations

import os

import pytest
import torch

from matrix import make_checkpoint
from symbiosis.kernels import plot_lookup
from symbiosis.plot import DevicePlot, LowerLayers, Plot, build_table

# [11, 12, 0]: a fragment that a lookup running past the end of [11, 12] into its padding (token 0) would find
CORPUS = [[5, 6, 7], [5, 6, 7, 8, 9, 10], [11, 12, 0], [20, 21, 22, 23, 24, 25, 26, 27], [5, 6, 7, 8]]
SEQUENCES = [[5, 6, 7, 8, 30, 9], [11, 12, 30], [20], [11, 12], [5, 6, 7], [40, 41, 5, 6, 7, 8, 9, 10, 3]]
LAYERS = {"llama": {"num_hidden_layers": 4}, "bert": {"num_hidden_layers": 4}}

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and plot_lookup.triton is not None


@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter"))])
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_the_kernel_looks_up_what_the_host_looks_up(arch, device, tmp_path):
    make_checkpoint(arch, tmp_path / "model", dtype=torch.float32, **LAYERS[arch])
    lower = LowerLayers(tmp_path / "model", 2, dtype=torch.float32)
    root = build_table(lower, CORPUS, tmp_path / "root", dtype="float16")
    with torch.no_grad():  # the domain's own lower layers: other values for the fragments it keeps
        next(p for n, p in lower.model.named_parameters() if "dense" in n or "mlp" in n).mul_(1.5)
    domain = build_table(lower, CORPUS, tmp_path / "domain", alpha=50, root=root, dtype="float16")
    for plot in (Plot(root), Plot(root, domain)):
        looked_up = DevicePlot(plot, device)
        if looked_up.packed is None:
            looked_up.pack()  # (the interpreter's CPU run: a GPU packs the tables itself)
        hidden, mask = looked_up.padded(SEQUENCES)
        assert hidden.dtype == torch.float32 and mask.sum(1).tolist() == [len(s) for s in SEQUENCES]
        for row, (expected, sequence) in enumerate(zip(plot.represent(SEQUENCES), SEQUENCES)):
            # (the host's encoder divides its float32 sums by int64 counts in float64)
            torch.testing.assert_close(hidden[row, :len(sequence)].cpu().double(), torch.from_numpy(expected).double(),
                                       rtol=1e-6, atol=1e-6)
            assert not hidden[row, len(sequence):].any()
