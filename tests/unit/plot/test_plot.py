"""PLOT against the models it stands in for (float64): the cut model is exact; lookups equal the lower layers where
the sequence is a fragment of the table; aggregation and back-off follow HMI eq. 2-3; domain tables keep the top
alpha%; a build resumes after a crash; damaged tables and bad corpora fail with clear errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from matrix import make_checkpoint
from symbiosis.plot import (CorpusTooSmall, DevicePlot, Generation, LowerLayers, Plot, PlotModel, PlotTable, PlotTableError,
                            UnsupportedModel, UpperModel, build_table, generate_many)
from symbiosis.plot.build import Stopped

LAYERS = {"llama": {"num_hidden_layers": 4}, "gpt2": {"n_layer": 4}, "gemma2": {"num_hidden_layers": 4},
          "bert": {"num_hidden_layers": 4}}
CORPUS = [[5, 6, 7], [5, 6, 7, 8, 9, 10], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [5, 6, 7, 8]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = tmp_path_factory.mktemp(f"plot-{arch}")
            make_checkpoint(arch, made[arch], dtype=torch.float64, **LAYERS[arch])
        return made[arch]

    return get


def _whole(arch, path):
    auto = AutoModelForSequenceClassification if arch == "bert" else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def root(checkpoint, tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            lower = LowerLayers(checkpoint(arch), 2, dtype=torch.float64)
            made[arch] = build_table(lower, CORPUS, tmp_path_factory.mktemp(f"root-{arch}") / "root", dtype="float64",
                                     values="alone")  # HMI's table: what the exact checks below hold to
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2", "bert"])
def test_the_upper_layers_on_the_lower_layers_output_are_the_whole_model(checkpoint, arch):
    path = checkpoint(arch)
    ids = torch.tensor([[3, 9, 27, 81, 2, 6, 18, 54, 40, 1]])
    lower, upper = LowerLayers(path, 2, dtype=torch.float64), UpperModel(path, 2, dtype=torch.float64)
    expected = _whole(arch, path)(input_ids=ids).logits
    assert torch.allclose(upper.logits(lower.represent(ids.numpy())), expected, rtol=1e-10, atol=1e-10)
    assert len(list(upper.model.base_model.modules())) < len(list(_whole(arch, path).base_model.modules()))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_sequences_that_are_fragments_of_the_table_give_the_whole_models_logits(checkpoint, root, arch):
    path = checkpoint(arch)
    model = PlotModel(UpperModel(path, 2, dtype=torch.float64), Plot(root(arch)))
    sequences = [[5, 6, 7], [11, 12]] if arch != "bert" else [[5, 6, 7], [6, 7, 8]]
    whole = _whole(arch, path)
    for sequence in sequences:
        expected = whole(input_ids=torch.tensor([sequence])).logits
        assert torch.allclose(model.logits([sequence]), expected, rtol=1e-10, atol=1e-10), sequence


def test_encoder_tokens_are_the_normalized_sum_of_their_trigrams_with_back_off(checkpoint, root):
    lower, plot = LowerLayers(checkpoint("bert"), 2, dtype=torch.float64), Plot(root("bert"))
    sequence = [20, 21, 22, 23, 24]
    trigrams = lower.represent(np.lib.stride_tricks.sliding_window_view(np.array(sequence), 3))  # [3, 3, d]
    expected = torch.stack([trigrams[0, 0], (trigrams[0, 1] + trigrams[1, 0]) / 2,
                            (trigrams[0, 2] + trigrams[1, 1] + trigrams[2, 0]) / 3,
                            (trigrams[1, 2] + trigrams[2, 1]) / 2, trigrams[2, 2]])
    assert torch.allclose(torch.from_numpy(plot.represent([sequence])[0]), expected, rtol=1e-12)
    # [11, 12, 30]: no tri-gram; [11, 12] is a bi-gram of the corpus, 30 only a uni-gram
    got = torch.from_numpy(plot.represent([[11, 12, 30]])[0])
    bigram, unigram = lower.represent(np.array([[11, 12]]))[0], lower.represent(np.array([[30]]))[0, 0]
    assert torch.allclose(got, torch.stack([bigram[0], bigram[1], unigram]), rtol=1e-12)


def test_decoder_tokens_take_the_longest_fragment_ending_at_them(checkpoint, root):
    lower, plot = LowerLayers(checkpoint("llama"), 2, dtype=torch.float64), Plot(root("llama"))
    sequence = [5, 6, 7, 8, 30, 9]  # [7, 8, 30] and [8, 30] are not in the corpus; [30, 9] neither
    got = torch.from_numpy(plot.represent([sequence])[0])
    fragments = [[5], [5, 6], [5, 6, 7], [6, 7, 8], [30], [9]]
    expected = torch.stack([lower.represent(np.array([f]))[0, -1] for f in fragments])
    assert torch.allclose(got, expected, rtol=1e-12)


def test_generation_looks_up_one_fragment_per_token_and_agrees_with_whole_sequence_lookups(checkpoint, root):
    model = PlotModel(UpperModel(checkpoint("llama"), 2, dtype=torch.float64), Plot(root("llama")))
    prompt = [20, 21, 22, 23]
    tokens = model.generate(prompt, 6)
    sequence = list(prompt)
    for token in tokens:  # greedy by recomputing everything from the whole sequence's lookups
        assert int(model.logits([sequence])[0, -1].argmax()) == token
        sequence.append(token)
    batches = [[[5, 6, 7], [20, 21, 22, 23, 24]], [[11, 12]], [[9, 8, 7, 6]]]
    for got, batch in zip(model.pipelined(batches), batches, strict=True):
        assert torch.equal(got, model.logits(batch))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_batch_of_prompts_with_their_own_tables_and_adapters_makes_each_ones_tokens(checkpoint, root, arch,
                                                                                       tmp_path):
    """`generate_many`: prompts of different lengths, tables (a domain's and the root's) and LoRA adapters (PEFT's
    mixed batch) in one batch, left-padded; each row's tokens are those its prompt makes alone."""
    import peft

    path = checkpoint(arch)
    domain_lower = LowerLayers(path, 2, dtype=torch.float64)
    with torch.no_grad():  # a domain's further pre-trained lower layers
        next(p for n, p in domain_lower.model.named_parameters() if "mlp" in n and p.dim() == 2).mul_(1.5)
    domain = build_table(domain_lower, CORPUS, tmp_path / "domain", alpha=50, root=root(arch), dtype="float64")
    plots = {"root": Plot(root(arch)), "domain": Plot(root(arch), domain)}
    upper = UpperModel(path, 2, dtype=torch.float64)
    targets = ["q_proj", "v_proj"] if arch == "llama" else ["c_attn"]
    for seed, name in enumerate(["a", "b"]):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
        if name == "a":
            upper.model = peft.get_peft_model(upper.model, config, adapter_name=name)
        else:
            upper.model.add_adapter(name, config)
        with torch.no_grad():
            for n, p in upper.model.named_parameters():
                if f"lora_B.{name}" in n:
                    p.normal_(0, 0.5)
    upper.model.eval()
    generations = [Generation(plots["root"], [5, 6, 7], 4, "a"), Generation(plots["domain"], [20, 21, 22, 23, 24], 6, "b"),
                   Generation(plots["root"], [11], 3, "b"), Generation(plots["domain"], [9, 8, 7, 6], 5, "a")]
    reported = []
    together = generate_many(upper, generations, done=lambda row, tokens: reported.append((row, list(tokens))))
    assert [row for row, _ in reported] == [2, 0, 3, 1]  # each as soon as its own tokens are done
    assert sorted(reported) == list(enumerate(together))
    for got, generation in zip(together, generations, strict=True):
        upper.model.set_adapter(generation.adapter)
        alone = generate_many(upper, [Generation(generation.plot, generation.prompt, generation.max_new_tokens)])[0]
        assert got == alone and len(got) == generation.max_new_tokens
    with pytest.raises(ValueError, match="every prompt of a batch names its adapter or none"):
        generate_many(upper, [generations[0], Generation(plots["root"], [5], 2)])


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_lookups_on_a_device_equal_the_host_lookups(checkpoint, root, arch, tmp_path):
    """`DevicePlot` (here on the CPU: the torch path a GPU runs) looks a padded batch up at once and gives what
    `Plot.represent` gives each sequence: domain before root, back-off to shorter fragments, padding untouched."""
    path = checkpoint(arch)
    domain_lower = LowerLayers(path, 2, dtype=torch.float64)
    with torch.no_grad():
        next(p for n, p in domain_lower.model.named_parameters() if "dense" in n or "mlp" in n).mul_(1.5)
    domain = build_table(domain_lower, CORPUS, tmp_path / "domain", alpha=50, root=root(arch), dtype="float64")
    sequences = [[5, 6, 7, 8, 30, 9], [11, 12, 30], [20], [5, 6, 7], [40, 41, 5, 6, 7, 8, 9, 10, 3]]
    for plot in (Plot(root(arch)), Plot(root(arch), domain)):
        on_device = DevicePlot(plot, "cpu")
        hidden, mask = on_device.padded(sequences)
        assert hidden.shape == (5, 9, plot.hidden) and mask.sum(1).tolist() == [len(s) for s in sequences]
        for row, (expected, sequence) in enumerate(zip(plot.represent(sequences), sequences)):
            assert torch.allclose(hidden[row, :len(sequence)], torch.from_numpy(expected), rtol=1e-12, atol=1e-12)
            assert not hidden[row, len(sequence):].any()
    upper = UpperModel(path, 2, dtype=torch.float64)
    host, device = PlotModel(upper, Plot(root(arch), domain)), PlotModel(upper, DevicePlot(Plot(root(arch), domain), "cpu"))
    assert torch.allclose(host.logits(sequences), device.logits(sequences), rtol=1e-10)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_on_the_gpu_the_lookups_equal_the_host_lookups(checkpoint, root, arch):
    plot = Plot(root(arch))
    sequences = [[5, 6, 7, 8, 30, 9], [11, 12, 30], [20], [40, 41, 5, 6, 7, 8, 9, 10, 3]]
    hidden, _ = DevicePlot(plot, "cuda").padded(sequences)
    assert hidden.is_cuda
    for row, (expected, sequence) in enumerate(zip(plot.represent(sequences), sequences)):
        assert torch.allclose(hidden[row, :len(sequence)].cpu(), torch.from_numpy(expected), rtol=1e-12, atol=1e-12)


def test_domain_tables_keep_the_top_alpha_percent_and_fall_back_to_the_root(checkpoint, root, tmp_path):
    path = checkpoint("llama")
    domain_lower = LowerLayers(path, 2, dtype=torch.float64)
    with torch.no_grad():  # the domain's further pre-trained lower layers
        domain_lower.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    corpus = [[40, 41, 42, 43]] * 5 + [[50, 51, 52]] * 2 + [[60, 61, 62]]
    sizes = {}
    for alpha in (100, 50, 30, 0):
        table = build_table(domain_lower, corpus, tmp_path / f"alpha{alpha}", alpha=alpha, root=root("llama"),
                            dtype="float64")
        sizes[alpha] = table.entries()
        assert table.entries()[3] == math.ceil(4 * alpha / 100)  # 4 distinct tri-grams
    assert sizes[0] == {1: 0, 2: 0, 3: 0} and sizes[100][3] == 4
    domain = PlotTable.open(tmp_path / "alpha50")  # [40,41,42] (5x) and [41,42,43] (5x) kept
    plot = Plot(root("llama"), domain)
    mine = torch.from_numpy(plot.represent([[40, 41, 42]])[0][-1])
    assert torch.allclose(mine, domain_lower.represent(np.array([[40, 41, 42]]))[0, -1], rtol=1e-12)
    root_lower = LowerLayers(path, 2, dtype=torch.float64)
    root_only = torch.from_numpy(plot.represent([[5, 6, 7]])[0][-1])  # not the domain's: the root's
    assert torch.allclose(root_only, root_lower.represent(np.array([[5, 6, 7]]))[0, -1], rtol=1e-12)
    assert not torch.allclose(mine, root_lower.represent(np.array([[40, 41, 42]]))[0, -1])


@pytest.mark.parametrize("values", ["alone", "context"])
def test_a_build_resumes_where_it_stopped(checkpoint, tmp_path, monkeypatch, values):
    """Killed while fragments run alone: it goes on from the last chunk. In context, then killed while the context
    pass adds a batch (the pass starts again) and stopped between two batches (it goes on from there). Either way
    the table is the uninterrupted build's, bit for bit."""
    import symbiosis.plot.build as build

    lower = LowerLayers(checkpoint("gpt2"), 2, dtype=torch.float64)
    calls = []
    represent = lower.represent
    lower.represent = lambda fragments: calls.append(len(fragments)) or represent(fragments)

    def crash_after_two(done, total):
        if len(calls) == 2:
            raise KeyboardInterrupt("the process died")

    with pytest.raises(KeyboardInterrupt):
        build_table(lower, CORPUS, tmp_path / "t", chunk=5, progress=crash_after_two, dtype="float64", values=values)
    assert not (tmp_path / "t").exists() and (tmp_path / "t.work" / "progress.json").exists()
    rows = sum(calls)
    if values == "context":
        monkeypatch.setattr(build, "CONTEXT_BATCH", 2)  # three batches of the corpus's five sequences
        batches, in_context = [], lower.in_context

        def dies_at_the_second(windows):  # killed while adding the context pass's second batch: it starts again
            batches.append(len(windows))
            if len(batches) == 2:
                raise KeyboardInterrupt("the process died")
            return in_context(windows)

        lower.in_context = dies_at_the_second
        with pytest.raises(KeyboardInterrupt):
            build_table(lower, CORPUS, tmp_path / "t", chunk=5, dtype="float64", values=values)
        batches.clear()
        lower.in_context = lambda windows: batches.append(len(windows)) or in_context(windows)
        with pytest.raises(Stopped):  # then its turn ends after two batches (the service's time slices)
            build_table(lower, CORPUS, tmp_path / "t", chunk=5, dtype="float64", values=values,
                        stop=lambda: len(batches) == 2)
        assert batches == [2, 2]  # from the first batch again
        batches.clear()
    resumed = build_table(lower, CORPUS, tmp_path / "t", chunk=5, dtype="float64", values=values)
    if values == "context":
        assert batches == [1]  # the third batch alone: a stop between batches goes on from there
    whole = build_table(LowerLayers(checkpoint("gpt2"), 2, dtype=torch.float64), CORPUS, tmp_path / "u", chunk=5,
                        dtype="float64", values=values)  # the same chunks: the same sums, bit for bit
    alone = sum(whole.entries().values()) if values == "alone" else \
        whole.vocab - len({token for sequence in CORPUS for token in sequence})  # uni-grams the corpus lacks
    assert 0 < rows < alone and sum(calls) == alone  # killed midway; then only what was left, once
    for length in (1, 2, 3):
        assert np.array_equal(resumed.levels[length].keys, whole.levels[length].keys)
        assert np.array_equal(resumed.levels[length].values, whole.levels[length].values)
    assert not (tmp_path / "t.work").exists()


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_in_context_a_fragment_is_its_mean_representation_over_the_corpus(checkpoint, tmp_path, arch):
    """The default table: each fragment of the corpus the mean of the lower layers' output at its positions over its
    occurrences (each sequence run whole); a token the corpus lacks, its uni-gram run alone."""
    lower = LowerLayers(checkpoint(arch), 2, dtype=torch.float64)
    table = build_table(lower, CORPUS, tmp_path / "context", dtype="float64")
    assert table.meta["values"] == "context"
    outputs = [lower.in_context([np.array(sequence)])[0] for sequence in CORPUS]  # each alone: no padding

    def mean(fragment):
        found = [out[i:i + len(fragment)] for sequence, out in zip(CORPUS, outputs)
                 for i in range(len(sequence) - len(fragment) + 1) if sequence[i:i + len(fragment)] == fragment]
        return torch.stack(found).mean(0)

    for fragment in ([5], [7], [6, 7], [5, 6, 7], [7, 8, 9], [11, 12], [26, 27]):
        rows, found = table.find(np.array([fragment]))
        assert found.all(), fragment
        assert torch.allclose(torch.from_numpy(table.rows(len(fragment), rows)[0]), mean(fragment), rtol=1e-10,
                              atol=1e-12), fragment
    rows, found = table.find(np.array([[30]]))
    assert torch.allclose(torch.from_numpy(table.rows(1, rows)[0]), lower.represent(np.array([[30]]))[0], rtol=1e-12)
    if arch == "bert":  # bidirectional: [5, 6, 7] alone is not [5, 6, 7] followed by more
        assert not torch.allclose(mean([5, 6, 7]), lower.represent(np.array([[5, 6, 7]]))[0])
    # a text past the model's 128 positions runs in windows of them
    long = build_table(lower, CORPUS + [list(range(40, 100)) * 5], tmp_path / "long", dtype="float64")
    assert long.find(np.array([[99, 40, 41]]))[1].all() and np.isfinite(long.levels[3].values).all()


def test_a_build_stopped_while_its_table_was_written_finishes_when_started_again(checkpoint, tmp_path, monkeypatch):
    import symbiosis.plot.build as build
    from symbiosis.plot.table import write_table

    lower = LowerLayers(checkpoint("gpt2"), 2, dtype=torch.float64)
    whole = build_table(lower, CORPUS, tmp_path / "whole", dtype="float64")

    def dies_after(moves: int):
        def write(directory, meta, levels):  # moves `moves` values files into the staging table, then dies
            levels = dict(sorted(levels.items())[:moves])
            write_table(directory.with_name("scratch"), meta, levels)
            raise KeyboardInterrupt("the process died")
        return write

    for moves, name in ((1, "part"), (3, "moved")):
        monkeypatch.setattr(build, "write_table", dies_after(moves))
        with pytest.raises(KeyboardInterrupt):
            build_table(lower, CORPUS, tmp_path / name, dtype="float64")
        monkeypatch.setattr(build, "write_table", write_table)
        resumed = build_table(lower, CORPUS, tmp_path / name, dtype="float64")  # was FileNotFoundError
        for length in (1, 2, 3):
            assert np.array_equal(resumed.levels[length].values, whole.levels[length].values)
    # killed after the table was whole, before its work files went: the table is taken as it is
    work = tmp_path / "whole.work"
    work.mkdir()
    (work / "plan.json").write_text(json.dumps({"id": whole.meta["id"]}))
    again = build_table(lower, CORPUS, tmp_path / "whole", dtype="float64")
    assert again.meta["id"] == whole.meta["id"] and not work.exists()


def test_a_table_past_its_byte_bound_is_refused_before_anything_is_written(checkpoint, tmp_path):
    from symbiosis.plot.build import TableTooLarge

    lower = LowerLayers(checkpoint("gpt2"), 2, dtype=torch.float64)
    whole = build_table(lower, CORPUS, tmp_path / "whole", dtype="float64")
    assert build_table(lower, CORPUS, tmp_path / "fits", dtype="float64", max_bytes=whole.nbytes).nbytes == whole.nbytes
    with pytest.raises(TableTooLarge, match=f"would take {whole.nbytes} bytes"):
        build_table(lower, CORPUS, tmp_path / "big", dtype="float64", max_bytes=whole.nbytes - 1)
    assert not (tmp_path / "big").exists() and not (tmp_path / "big.work").exists()


def test_damaged_tables_and_bad_input_are_refused_with_the_reason(checkpoint, root, tmp_path):
    import shutil

    source = root("llama").directory

    def copy(name):
        shutil.copytree(source, tmp_path / name)
        return tmp_path / name

    flipped = copy("flipped")
    data = bytearray((flipped / "values-3.npy").read_bytes())
    data[-1] ^= 0xFF
    (flipped / "values-3.npy").write_bytes(bytes(data))
    with pytest.raises(PlotTableError, match="values-3.npy: its SHA-256"):
        PlotTable.open(flipped)
    truncated = copy("truncated")
    (truncated / "keys-2.npy").write_bytes((truncated / "keys-2.npy").read_bytes()[:-8])
    with pytest.raises(PlotTableError, match="keys-2.npy"):
        PlotTable.open(truncated)
    pickled = copy("pickled")
    np.save(pickled / "keys-1.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(PlotTableError, match="keys-1.npy: not a readable"):
        PlotTable.open(pickled)
    garbled = copy("garbled")
    (garbled / "plot.json").write_text("{")
    with pytest.raises(PlotTableError, match="plot.json: not readable JSON"):
        PlotTable.open(garbled)
    meta = json.loads((source / "plot.json").read_text())
    # a fractional vocabulary packed keys that matched another fragment's (a wrong row, no error); a string or
    # float n raised TypeError
    bad_fields = (("n", 40), ("kind", "pickle"), ("levels", {}), ("vocab", meta["vocab"] + 0.5), ("n", str(meta["n"])),
                  ("n", float(meta["n"])), ("hidden", True), ("kind", ["encoder"]), ("dtype", ["float64"]))
    for number, (field, value) in enumerate(bad_fields):
        bad = copy(f"bad-{field}-{number}")
        (bad / "plot.json").write_text(json.dumps({**meta, field: value}))
        with pytest.raises(PlotTableError, match="plot.json"):
            PlotTable.open(bad)
    with pytest.raises(PlotTableError, match="not a PLOT table"):
        PlotTable.open(tmp_path)
    other_root = build_table(LowerLayers(checkpoint("llama"), 2, dtype=torch.float64), [[1, 2, 3, 4]],
                             tmp_path / "other-root", dtype="float64")
    domain = build_table(LowerLayers(checkpoint("llama"), 2, dtype=torch.float64), [[1, 2, 3]], tmp_path / "d",
                         root=other_root, dtype="float64")
    with pytest.raises(PlotTableError, match="another root"):
        Plot(root("llama"), domain)
    with pytest.raises(PlotTableError, match="uni-gram for every token"):
        Plot(domain)
    with pytest.raises(CorpusTooSmall, match="holds 7 tokens; a table is built from at least 100"):
        build_table(LowerLayers(checkpoint("llama"), 2), [[1, 2, 3], [4, 5, 6, 7]], tmp_path / "small", min_tokens=100)
    with pytest.raises(PlotTableError, match="token ids in 0..127"):
        Plot(root("llama")).represent([[1, 500]])
    with pytest.raises(ValueError, match="tables are for the decoder"):
        PlotModel(UpperModel(checkpoint("bert"), 2, dtype=torch.float64), Plot(root("llama")))


def test_an_architecture_that_adds_its_own_positions_is_refused(tmp_path):
    make_checkpoint("opt", tmp_path, num_hidden_layers=4)
    with pytest.raises(UnsupportedModel, match="do not give the whole model's logits"):
        UpperModel(tmp_path, 2)


def test_further_pretraining_trains_only_the_lower_layers_and_resumes_exactly(checkpoint, tmp_path):
    from symbiosis.plot.train import Schedule, Stopped, further_pretrain

    path, corpus = checkpoint("llama"), [list(range(10, 60))] * 3
    schedule = Schedule(steps=4, learning_rate=1e-2, batch_size=2, window=16, checkpoint_every=2)
    whole = further_pretrain(path, 2, corpus, tmp_path / "a", schedule, dtype=torch.float64)
    original = LowerLayers(path, 2, dtype=torch.float64).model.state_dict()
    assert set(whole) == {n for n in original if n.startswith(("layers.0.", "layers.1."))}
    assert all(not torch.equal(whole[n], original[n]) for n in whole if n.endswith("proj.weight"))
    with pytest.raises(Stopped):
        further_pretrain(path, 2, corpus, tmp_path / "b", schedule, dtype=torch.float64,
                         stop=lambda: (tmp_path / "b" / "state" / "state.json").exists())  # after the first save
    resumed = further_pretrain(path, 2, corpus, tmp_path / "b", schedule, dtype=torch.float64)
    assert all(torch.equal(resumed[n], whole[n]) for n in whole)
    # stopped between checkpoints (as the service stops a step whose turn is over): the steps since the last
    # checkpoint are saved first, and it goes on from there to the same weights
    asked = iter(range(10))
    with pytest.raises(Stopped, match="stopped at step 3"):
        further_pretrain(path, 2, corpus, tmp_path / "d", schedule, dtype=torch.float64, stop=lambda: next(asked) == 3)
    assert json.loads((tmp_path / "d" / "state" / "state.json").read_text())["step"] == 3
    resumed = further_pretrain(path, 2, corpus, tmp_path / "d", schedule, dtype=torch.float64)
    assert all(torch.equal(resumed[n], whole[n]) for n in whole)
    other = [list(range(70, 120))] * 3  # another corpus in the same directory: no resuming the old checkpoint
    assert all(torch.equal(a, b) for a, b in zip(
        further_pretrain(path, 2, other, tmp_path / "b", schedule, dtype=torch.float64).values(),
        further_pretrain(path, 2, other, tmp_path / "fresh", schedule, dtype=torch.float64).values()))
    domain = LowerLayers(path, 2, dtype=torch.float64, state_dict=whole)
    assert not torch.equal(domain.represent(np.array([[10, 11, 12]])), LowerLayers(path, 2, dtype=torch.float64)
                           .represent(np.array([[10, 11, 12]])))
    bert = further_pretrain(checkpoint("bert"), 2, corpus, tmp_path / "c", Schedule(steps=2, window=16),
                            mask_token_id=3, dtype=torch.float64)
    assert all(n.startswith("encoder.layer.") for n in bert)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_a_tenant_adapter_trains_on_the_upper_layers_over_plot(checkpoint, root, arch, tmp_path):
    import peft

    from symbiosis.plot.train import Schedule, train_adapter

    path, plot = checkpoint(arch), Plot(root(arch))
    examples = [([5, 6, 7, 8], 1), ([20, 21, 22], 2)] if arch == "bert" else [([5, 6, 7, 8, 9, 10], None)]
    task = "SEQ_CLS" if arch == "bert" else "CAUSAL_LM"
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type=task)

    def loss_of(model):
        upper = UpperModel(path, 2, dtype=torch.float64, probe=False)
        upper.model = model(upper.model)
        logits = PlotModel(upper, plot).logits([tokens for tokens, _ in examples])
        if arch == "bert":
            return torch.nn.functional.cross_entropy(logits, torch.tensor([label for _, label in examples]))
        return torch.nn.functional.cross_entropy(logits[0, :-1], torch.tensor(examples[0][0][1:]))

    adapter = train_adapter(UpperModel(path, 2, dtype=torch.float64, probe=False), plot, examples, tmp_path,
                            Schedule(steps=30, learning_rate=2e-2, batch_size=2), config)
    before = loss_of(lambda m: m)
    after = loss_of(lambda m: peft.PeftModel.from_pretrained(m, adapter))
    assert after < 0.85 * before, (before, after)  # a tiny random head caps how far it can go
    names = json.loads((adapter / "adapter_config.json").read_text())
    assert names["peft_type"] == "LORA"
