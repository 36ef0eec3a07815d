"""Generation on split models: greedy and seeded sampling equal plain transformers+PEFT, stop strings, the
streaming `symbiosis generate` command, and clear errors for bad requests."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import symbiosis
from symbiosis.cli import main
from symbiosis.client.generate import generate_text, load_adapter, save_adapter
from symbiosis.demo import build_base_model
from symbiosis.errors import AdapterError, BadCall
from symbiosis.transport.server import ExecutorServer
from matrix import peft_config


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny Llama with a real (locally trained) tokenizer; a few pretraining steps make it talk."""
    path = build_base_model(tmp_path_factory.mktemp("lm") / "base", pretrain_steps=30, log=lambda _: None)
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64)
    return path, executor, AutoTokenizer.from_pretrained(path)


def _pair(lm, adapter_seed=5):
    path, executor, _ = lm
    config = lambda: peft_config("lora", "llama")  # noqa: E731
    torch.manual_seed(adapter_seed)
    split = get_peft_model(symbiosis.from_pretrained(path, executor), config())
    torch.manual_seed(adapter_seed)
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64), config())
    return split.eval(), plain.eval()


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.8, seed=3),
                                      dict(temperature=1.3, top_k=5, seed=11)])
def test_generation_equals_plain(lm, sampling):
    split, plain = _pair(lm)
    tokenizer = lm[2]
    ours = generate_text(split, tokenizer, "<s> the cat", max_new_tokens=12, **sampling)
    theirs = generate_text(plain, tokenizer, "<s> the cat", max_new_tokens=12, **sampling)
    assert ours == theirs and ours.strip()


def test_stop_strings(lm):
    split, plain = _pair(lm)
    tokenizer = lm[2]
    full = generate_text(split, tokenizer, "<s> the cat", max_new_tokens=20)
    stop = full.split()[2]  # a word that occurs a little way into the greedy continuation
    stopped = generate_text(split, tokenizer, "<s> the cat", max_new_tokens=20, stop=[stop])
    assert stopped.rstrip().endswith(stop) and len(stopped) < len(full)
    assert stopped == generate_text(plain, tokenizer, "<s> the cat", max_new_tokens=20, stop=[stop])


def test_bad_generation_requests(lm, tmp_path):
    split, _ = _pair(lm)
    tokenizer = lm[2]
    with pytest.raises(BadCall, match="max_new_tokens must be positive"):
        generate_text(split, tokenizer, "<s> the cat", max_new_tokens=0)
    with pytest.raises(BadCall, match="exceeds the model's maximum context of 128 tokens"):
        generate_text(split, tokenizer, "<s> " + "the cat " * 80, max_new_tokens=4)
    path, executor, _ = lm
    with pytest.raises(AdapterError, match="not a local adapter directory"):
        load_adapter(symbiosis.from_pretrained(path, executor), tmp_path / "nowhere")
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter(symbiosis.from_pretrained(path, executor), tmp_path)


def test_adapter_for_another_base_model_is_refused(lm, checkpoints, tmp_path):
    path, executor, _ = lm
    split, _ = _pair(lm)
    save_adapter(split, tmp_path / "mine")
    assert isinstance(load_adapter(symbiosis.from_pretrained(path, executor), tmp_path / "mine"), PeftModel)
    # Same architecture family, different model: the recorded fingerprint does not match ...
    other_path, _ = checkpoints("llama")
    other = symbiosis.from_pretrained(other_path, symbiosis.Executor.from_pretrained(other_path, dtype=torch.float64))
    with pytest.raises(AdapterError, match="trained on another base model"):
        load_adapter(other, tmp_path / "mine")
    # ... and without the marker (a plain PEFT adapter), the shape mismatch is reported as such.
    (tmp_path / "mine" / "symbiosis.json").unlink()
    with pytest.raises(AdapterError, match="does not fit this base model"):
        load_adapter(other, tmp_path / "mine")


def test_generate_command_streams(lm, tmp_path, capsys):
    path, executor, tokenizer = lm
    split, _ = _pair(lm)
    save_adapter(split, tmp_path / "adapter")
    expected = generate_text(split, tokenizer, "<s> a dog", max_new_tokens=8)
    server = ExecutorServer(executor, "tcp://127.0.0.1:*", "t").start()
    (tmp_path / "token").write_text("t")
    try:
        capsys.readouterr()
        code = main(["generate", "--executor", server.url, "--token-file", str(tmp_path / "token"),
                     "--model", str(path), "--adapter", str(tmp_path / "adapter"), "--prompt", "<s> a dog",
                     "--max-new-tokens", "8"])
        assert code == 0
        assert capsys.readouterr().out.strip() == expected.strip()
        code = main(["generate", "--executor", server.url, "--token-file", str(tmp_path / "token"),
                     "--model", str(path), "--prompt", "<s> a dog", "--max-new-tokens", "-1"])
        assert code == 2 and "max_new_tokens must be positive" in capsys.readouterr().err
    finally:
        server.stop()


def test_generate_command_runs_the_engine(lm, tmp_path, capsys):
    """Without --executor, `symbiosis generate` loads the base itself and runs its prompts on the hosted engine:
    the same text as the split model, a stop string cut off, several prompts batched."""
    path, _, tokenizer = lm
    split, _ = _pair(lm)
    save_adapter(split, tmp_path / "adapter")
    expected = generate_text(split, tokenizer, "<s> a dog", max_new_tokens=8)
    capsys.readouterr()
    common = ["generate", "--model", str(path), "--dtype", "float64", "--max-new-tokens", "8"]
    assert main(common + ["--adapter", str(tmp_path / "adapter"), "--prompt", "<s> a dog"]) == 0
    assert capsys.readouterr().out.strip() == expected.strip()
    stop = expected.split()[2]
    assert main(common + ["--adapter", str(tmp_path / "adapter"), "--prompt", "<s> a dog", "--stop", stop]) == 0
    assert capsys.readouterr().out.strip() == expected[:expected.index(stop)].strip()
    assert main(common + ["--adapter", str(tmp_path / "adapter"), "--prompt", "<s> a dog", "--prompt", "<s> the cat"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["<s> a dog", "<s> the cat"] and lines[0]["text"] == expected
    assert main(common + ["--adapter", str(tmp_path / "nowhere"), "--prompt", "<s> a dog"]) == 2
    assert "not a local adapter directory" in capsys.readouterr().err


def test_prefill_then_decode_elsewhere_matches_plain_greedy(lm):
    """The long-context scheme's mechanics: prefill in one place/dtype, move the client and its KV cache,
    decode there; tokens equal plain greedy decoding."""
    from symbiosis.client.offload import prefill_then_decode

    path, executor, tokenizer = lm
    split, plain = _pair(lm)
    ids = tokenizer(["<s> the teacher"], return_tensors="pt")["input_ids"]
    expected = plain.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
    model = split.get_base_model()
    model.to(torch.float32)  # "prefill device": float32 client (the executor serves float64, cast at the boundary)
    tokens = prefill_then_decode(split, ids, 10, decode_device="cpu", decode_dtype=torch.float64)
    assert torch.equal(tokens, expected)


def test_moved_cache_appends_in_place_and_grows(lm):
    """After move_client the cache is preallocated: a decoded token is written into spare room (no copy of the
    cache), the buffer grows when full, and the logits equal plain transformers' throughout."""
    from transformers import DynamicCache

    from symbiosis.client.offload import move_client

    path, executor, tokenizer = lm
    split, plain = _pair(lm)
    ids = tokenizer(["<s> the teacher"], return_tensors="pt")["input_ids"]
    caches = [DynamicCache(config=plain.config), DynamicCache(config=plain.config)]
    with torch.no_grad():
        split(input_ids=ids, past_key_values=caches[0], use_cache=True)
        token = plain(input_ids=ids, past_key_values=caches[1], use_cache=True).logits[:, -1:].argmax(-1)
        move_client(split.get_base_model(), caches[0], "cpu", headroom=2)
        layer = caches[0].layers[0]
        first_buffer = layer.keys.data_ptr()
        for step in range(5):
            ours = split(input_ids=token, past_key_values=caches[0], use_cache=True).logits
            theirs = plain(input_ids=token, past_key_values=caches[1], use_cache=True).logits
            torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
            if step < 2:
                assert layer.keys.data_ptr() == first_buffer  # appended into the headroom
            token = theirs[:, -1:].argmax(-1)
        assert layer.keys.data_ptr() != first_buffer  # grew once the headroom was used up
        assert caches[0].get_seq_length() == caches[1].get_seq_length() == ids.shape[1] + 5
