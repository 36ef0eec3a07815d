"""PLOT's short fragments as their mean in-context representations (an experiment on the held-out fortunes task):
the root table's uni-grams and bi-grams (and with `ctx123` the tri-grams too) replaced by the mean of the lower
layers' output at those positions over the root corpus's occurrences, computed on whole texts; then an adapter
trained over PLOT and its test accuracy, as benchmarks/plot.py does it (seed 0: 71.3% with the table as built)."""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

sys.path.insert(0, "benchmarks")
import plot as P  # noqa: E402
from symbiosis.plot import Plot, PlotModel, PlotTable, UpperModel, build_table, LowerLayers  # noqa: E402
from symbiosis.plot.table import Level  # noqa: E402
from symbiosis.plot.train import Schedule, train_adapter  # noqa: E402

variant = sys.argv[1]
lengths = {"isolated": (), "ctx1": (1,), "ctx12": (1, 2), "ctx123": (1, 2, 3)}[variant]
torch.set_num_threads(2)
workdir = Path("/tmp/symbiosis-bench-plot")
workdir.mkdir(parents=True, exist_ok=True)
texts = P.FORTUNES
from transformers import AutoConfig, AutoTokenizer  # noqa: E402

path = P.model_dir(workdir, None)
config = AutoConfig.from_pretrained(path)
config.num_labels = len(P.CLASSES)
config.save_pretrained(path)
tokenizer = AutoTokenizer.from_pretrained(path)
train, test = P.split(texts, 260, 0.25, 0)
train_ids = list(zip(P.tokenize(tokenizer, [t for t, _ in train]), [y for _, y in train]))
test_ids = list(zip(P.tokenize(tokenizer, [t for t, _ in test]), [y for _, y in test]))
held_out = {t for t, _ in test}
corpus = [t for name in sorted(p.name for p in texts.iterdir() if "." not in p.name and p.is_file())
          for t in P.fortunes(texts, name) if t not in held_out]
lower = LowerLayers(path, P.LOWER, "cpu")
root_dir = workdir / "root-260-0-held-out"
started = time.perf_counter()
root = PlotTable.open(root_dir) if (root_dir / "plot.json").exists() else \
    build_table(lower, P.tokenize(tokenizer, corpus), root_dir, dtype="float16")
print("root", root.entries(), f"{time.perf_counter() - started:.0f} s", flush=True)

if lengths:
    started = time.perf_counter()
    sequences = sorted(P.tokenize(tokenizer, corpus), key=len)
    sums = {n: torch.zeros(root.levels[n].keys.size, n, root.hidden) for n in lengths}
    counts = {n: torch.zeros(root.levels[n].keys.size) for n in lengths}
    with torch.no_grad():
        for first in range(0, len(sequences), 64):
            batch = sequences[first:first + 64]
            lower.model(**P.padded(batch, "cpu"))
            out = lower._output.float()
            for row, tokens in enumerate(batch):
                tokens = np.asarray(tokens, dtype=np.int64)
                reps = out[row, :tokens.size]
                for n in lengths:
                    if tokens.size < n:
                        continue
                    rows, found = root.find(sliding_window_view(tokens, n))
                    assert found.all()
                    index = torch.from_numpy(rows)
                    windows = reps.unfold(0, n, 1).permute(0, 2, 1)  # [T-n+1, n, hidden]
                    sums[n].index_add_(0, index, windows)
                    counts[n].index_add_(0, index, torch.ones(index.numel()))
    levels = dict(root.levels)
    for n in lengths:
        seen = counts[n] > 0
        values = np.array(root.levels[n].values, dtype=np.float32)
        values[seen.numpy()] = (sums[n][seen] / counts[n][seen, None, None]).numpy()
        levels[n] = Level(root.levels[n].keys, values.astype(np.float16))
        print(f"level {n}: {int(seen.sum())} of {seen.numel()} from context", flush=True)
    root = PlotTable(root.directory, root.meta, levels)
    print(f"context pass {time.perf_counter() - started:.0f} s", flush=True)

plot = Plot(root)
schedule = Schedule(steps=300, learning_rate=2e-3, batch_size=32, seed=0, checkpoint_every=10**6)
torch.manual_seed(schedule.seed)
started = time.perf_counter()
adapter = train_adapter(UpperModel(path, P.LOWER, "cpu", probe=False), plot, train_ids,
                        workdir / f"plot-adapter-{variant}", schedule, P.lora_config(None))
import peft  # noqa: E402

upper = UpperModel(path, P.LOWER, "cpu", probe=False)
upper.model = peft.PeftModel.from_pretrained(upper.model, adapter).eval()
accuracy = P.accuracy(PlotModel(upper, plot).logits, test_ids)
print(json.dumps({"variant": variant, "plot_trained_over_plot": accuracy, "test": len(test_ids),
                  "train_s": time.perf_counter() - started}), flush=True)
