"""`symbiosis demo`: several tenants share one base model on this machine.

1. Build a small Llama-style base model locally (a BPE tokenizer trained on a generated corpus, and a few
   seconds of pretraining so that it speaks the corpus' language), saved as a real HF checkpoint.
2. Start one executor that holds the base layers.
3. Run tenants at once against it: two fine-tune with different PEFT methods (LoRA, IA3) on their own
   text, one generates text. Each prints its own progress.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import torch
from peft import IA3Config, LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird", "the farmer", "our neighbour"]
VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "watches", "builds"]
OBJECTS = ["a red ball", "the green door", "an apple", "the river", "a wooden box", "the tall tree", "a letter"]
PLACES = ["in the garden", "near the house", "by the sea", "at school", "in the morning", "after dinner"]
COLOURS = ["red", "blue", "green", "gold", "white", "grey"]
THINGS = ["roses", "violets", "the sky", "the sea", "the night", "my hat"]


def base_sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)} ."


def poem_line(rng: random.Random) -> str:
    """Tenant `poet`: a rhyme pattern the base model never saw."""
    a, b = rng.sample(THINGS, 2)
    return f"{a} are {rng.choice(COLOURS)} , {b} are {rng.choice(COLOURS)} , and so are you ."


def sum_line(rng: random.Random) -> str:
    """Tenant `adder`: small additions written out."""
    x, y = rng.randrange(10), rng.randrange(10)
    return f"{x} plus {y} makes {x + y} ."


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def encode(tokenizer, lines: list[str], length: int) -> dict[str, torch.Tensor]:
    text = [tokenizer.bos_token + " " + line for line in lines]
    batch = tokenizer(text, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def build_base_model(directory: Path, pretrain_seconds: float = 20.0, log=print) -> Path:
    """Write a pretrained tiny Llama checkpoint + tokenizer into `directory` (reused if already there)."""
    if (directory / "config.json").is_file():
        log(f"[base] reusing {directory}")
        return directory
    rng = random.Random(0)
    corpus = [base_sentence(rng) for _ in range(4000)]
    tokenizer = build_tokenizer(corpus + [poem_line(rng) for _ in range(200)] + [sum_line(rng) for _ in range(200)])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start, step = time.time(), 0
    while time.time() - start < pretrain_seconds:
        loss = model(**encode(tokenizer, rng.sample(corpus, 32), 24)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 25 == 0:
            log(f"[base] pretraining step {step:3d}  loss {loss.item():.3f}")
        step += 1
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    log(f"[base] saved a {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter model to {directory}")
    return directory
