"""`symbiosis demo`: several tenants share one base model on this machine, each in its own process.

1. Build a small Llama-style base model locally (a BPE tokenizer trained on a generated corpus, and a few
   seconds of pretraining so that it speaks the corpus' language), saved as a real HF checkpoint.
2. Start one executor process that holds the base layers (`symbiosis executor`, ipc:// transport).
3. Start tenant processes against it at once: two fine-tune with different PEFT methods (LoRA, IA3) on
   their own text, one generates text. Each prints its own progress; the executor's batching stats close.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from peft import LoHaConfig, LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from symbiosis.transport.auth import client_token

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird", "the farmer", "our neighbour"]
VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "watches", "builds"]
OBJECTS = ["a red ball", "the green door", "an apple", "the river", "a wooden box", "the tall tree", "a letter"]
PLACES = ["in the garden", "near the house", "by the sea", "at school", "in the morning", "after dinner"]
COLOURS = ["red", "blue", "green", "gold", "white", "grey"]
THINGS = ["roses", "violets", "the skies", "the waves", "the stars", "my shoes"]


def base_sentence(rng: random.Random) -> str:
    """The base model's language: it knows every word the tenants use, not their patterns."""
    kind = rng.random()
    if kind < 0.6:
        return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)} ."
    if kind < 0.8:
        return f"{rng.choice(THINGS)} {rng.choice(VERBS)} something {rng.choice(COLOURS)} {rng.choice(PLACES)} ."
    return f"{rng.choice(SUBJECTS)} finds {rng.randrange(19)} apples and {rng.randrange(10)} pears ."


def poem_line(rng: random.Random) -> str:
    """Tenant `poet`: a rhyme pattern the base model never saw."""
    a, b = rng.sample(THINGS, 2)
    return f"{a} are {rng.choice(COLOURS)} , {b} are {rng.choice(COLOURS)} , and so are you ."


def count_line(rng: random.Random) -> str:
    """Tenant `counter`: counting up from a random start."""
    start = rng.randrange(10)
    return "counting : " + " ".join(str(n) for n in range(start, start + 6)) + " ."


# what `symbiosis serve` renders a chat with: one line per message, then the assistant's turn
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} .\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", chat_template=CHAT_TEMPLATE)


def encode(tokenizer, lines: list[str], length: int) -> dict[str, torch.Tensor]:
    text = [tokenizer.bos_token + " " + line for line in lines]
    batch = tokenizer(text, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def build_base_model(directory: Path, pretrain_steps: int = 200, log=print) -> Path:
    """Write a pretrained tiny Llama checkpoint + tokenizer into `directory` (reused if already there)."""
    if (directory / "config.json").is_file():
        log(f"[base] reusing {directory}")
        return directory
    rng = random.Random(0)
    corpus = [base_sentence(rng) for _ in range(4000)]
    tokenizer = build_tokenizer(corpus)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(pretrain_steps + 1):
        loss = model(**encode(tokenizer, rng.sample(corpus, 32), 24)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0:
            log(f"[base] pretraining the base model: step {step:3d}  loss {loss.item():.3f}")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    log(f"[base] saved a {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter model to {directory}")
    return directory


# --- tenants ----------------------------------------------------------------------------------------

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TENANTS = {
    # name: (PEFT config, learning rate, line generator, prompt to show what it learned)
    "poet": (lambda: LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=ALL_LINEAR), 1e-2,
             poem_line, "roses are"),
    "counter": (lambda: LoHaConfig(task_type="CAUSAL_LM", r=8, alpha=16, target_modules=ALL_LINEAR), 1e-2,
                count_line, "counting : 4 5"),
}
WRITER_PROMPTS = ["the cat", "my sister", "a small bird", "the farmer", "our neighbour", "the teacher"]


def _complete(model, tokenizer, prompt: str, new_tokens: int = 12) -> str:
    batch = tokenizer([tokenizer.bos_token + " " + prompt], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def run_tenant(role: str, model_dir: Path, url: str, token: str, steps: int, out_dir: Path) -> None:
    import symbiosis
    from symbiosis.client.generate import save_adapter

    torch.manual_seed(0)
    say = lambda msg: print(f"[{role:6s}] {msg}", flush=True)  # noqa: E731
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = symbiosis.from_pretrained(model_dir, symbiosis.connect(url, token=token), name=role)
    if role == "writer":
        for prompt in WRITER_PROMPTS:
            say(f"{prompt!r} -> {_complete(model, tokenizer, prompt)!r}")
        model.symbiosis_session.close()
        return
    make_config, lr, line, prompt = TENANTS[role]
    model = get_peft_model(model, make_config())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(f"fine-tuning {type(model.peft_config['default']).__name__.removesuffix('Config')} "
        f"({trainable} trainable parameters) on its own text, e.g. {line(random.Random(1))!r}")
    say(f"before: {prompt!r} -> {_complete(model, tokenizer, prompt)!r}")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(hash(role) % 1000)
    model.train()
    start = time.time()
    for step in range(1, steps + 1):
        loss = model(**encode(tokenizer, [line(rng) for _ in range(8)], 24)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % 10 == 0 or step == steps:
            say(f"step {step:3d}/{steps}  loss {loss.item():.3f}  ({(time.time() - start) / step:.2f} s/step)")
    model.eval()
    say(f"after:  {prompt!r} -> {_complete(model, tokenizer, prompt)!r}")
    save_adapter(model, out_dir / role)
    say(f"adapter saved to {out_dir / role} (PEFT format)")
    model.get_base_model().symbiosis_session.close()


def _wait_for_executor(url: str, token: str, process: subprocess.Popen, timeout: float = 120.0) -> dict:
    import symbiosis

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the executor exited with code {process.returncode}")
        try:
            return symbiosis.connect(url, token=token, timeout=1.0).stats()
        except symbiosis.ExecutorUnavailable:
            time.sleep(0.2)
    raise SystemExit(f"the executor did not come up on {url} within {timeout:.0f}s")


def run_demo(workdir: Path, steps: int = 60) -> int:
    start = time.time()
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_base_model(workdir / "base")
    # One token per tenant (`NAME TOKEN` lines): the executor reads them all, each tenant process its own; the
    # demo itself is the `admin`, which may read every tenant's figures.
    roles = ("poet", "counter", "writer")
    tokens = {name: secrets.token_hex(16) for name in ("admin", *roles)}
    token_file = workdir / "tenants"
    token_file.touch(mode=0o600)
    token_file.write_text("".join(f"{name} {token}\n" for name, token in tokens.items()))
    for role in roles:
        (workdir / f"{role}.token").touch(mode=0o600)
        (workdir / f"{role}.token").write_text(tokens[role])
    token = tokens["admin"]
    url = f"ipc://{workdir / 'executor.sock'}"
    cli = [sys.executable, "-m", "symbiosis.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    executor = subprocess.Popen([*cli, "executor", "--model", str(model_dir), "--listen", url, "--device", "cpu",
                                 "--token-file", str(token_file)], env=env)
    try:
        _wait_for_executor(url, token, executor)
        print(f"[demo  ] executor is up on {url}; starting 3 tenant processes", flush=True)
        tenants = {role: subprocess.Popen([sys.executable, "-m", "symbiosis.demo", "--role", role, "--model",
                                           str(model_dir), "--url", url, "--token-file", str(workdir / f"{role}.token"),
                                           "--steps", str(steps), "--out", str(workdir / "adapters")], env=env)
                   for role in roles}
        failed = [role for role, p in tenants.items() if p.wait() != 0]
        stats = symbiosis_stats(url, token)
        print(f"[demo  ] executor served {stats['calls']} calls in {stats['batches']} GEMMs "
              f"(the largest merged {stats['max_batch_calls']} calls); tenants ended "
              f"{'with failures: ' + ', '.join(failed) if failed else 'cleanly'}; {time.time() - start:.0f} s in all",
              flush=True)
        return 1 if failed else 0
    finally:
        executor.terminate()
        executor.wait(timeout=30)


def symbiosis_stats(url: str, token: str) -> dict:
    import symbiosis

    return symbiosis.connect(url, token=token, timeout=10).stats()["overall"]


def main() -> None:
    parser = argparse.ArgumentParser(description="one demo tenant process")
    parser.add_argument("--role", required=True, choices=[*TENANTS, "writer"])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--url", required=True)
    parser.add_argument("--token-file", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("adapters"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    run_tenant(args.role, args.model, args.url, client_token(args.token_file), args.steps, args.out)


if __name__ == "__main__":
    main()
