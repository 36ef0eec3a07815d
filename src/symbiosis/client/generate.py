"""Text generation on a split model: adapters loaded with checks, prompts validated, tokens streamed.

Generation itself is transformers' `generate()`: the KV cache, sampling and stopping all live in the
client; only the base layers' matmuls go to the executor, marked as inference (grad mode is off), so the
executor serves them ahead of queued training work.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from peft import PeftModel
from transformers import PreTrainedModel, TextStreamer

from symbiosis.client.adapter_files import check_adapter_directory, read_json
from symbiosis.errors import AdapterError, BadCall

FINGERPRINT_FILE = "symbiosis.json"  # beside adapter_config.json; plain PEFT ignores it


def save_adapter(peft_model: PeftModel, directory: str | os.PathLike) -> None:
    """PEFT's `save_pretrained`, plus the base model's fingerprint so loading can check the pairing."""
    peft_model.save_pretrained(directory)
    fingerprint = peft_model.get_base_model().symbiosis_fingerprint
    (Path(directory) / FINGERPRINT_FILE).write_text(json.dumps({"base_fingerprint": fingerprint}))


def check_base_fingerprint(directory: Path, fingerprint: str) -> None:
    """`AdapterError` if `directory` records (`save_adapter`) a base model other than `fingerprint`'s; an adapter
    without the record (plain PEFT) passes."""
    marker = directory / FINGERPRINT_FILE
    if marker.is_file():
        record = read_json(marker, "a symbiosis adapter record")
        if not isinstance(record, dict):
            raise AdapterError(f"{marker}: not a symbiosis adapter record (not a JSON object)")
        recorded = record.get("base_fingerprint")
        if recorded != fingerprint:
            raise AdapterError(f"{directory}: this adapter was trained on another base model (fingerprint "
                               f"{str(recorded)[:16]}…, this model {fingerprint[:16]}…)")


def load_adapter(model: PreTrainedModel, directory: str | os.PathLike, **kwargs) -> PeftModel:
    """`PeftModel.from_pretrained` with errors that name the problem: a missing directory or file, an adapter
    saved for another base model (fingerprint recorded by `save_adapter`), or tensors of the wrong shape."""
    directory = check_adapter_directory(directory)
    check_base_fingerprint(directory, model.symbiosis_fingerprint)
    try:
        return PeftModel.from_pretrained(model, directory, **kwargs)
    except (RuntimeError, ValueError, KeyError) as e:
        raise AdapterError(f"{directory}: adapter does not fit this base model: {e}") from e


def check_generation_request(model: PreTrainedModel, prompt_tokens: int, max_new_tokens: int) -> None:
    if max_new_tokens <= 0:
        raise BadCall(f"max_new_tokens must be positive, got {max_new_tokens}")
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise BadCall(f"prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens exceeds the model's "
                      f"maximum context of {limit} tokens")


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: list[str] | None = None, stream: bool = False) -> str:
    """Complete `prompt`; greedy when temperature is 0, else sampled (seeded if `seed` is given)."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    check_generation_request(model, inputs["input_ids"].shape[1], max_new_tokens)
    if seed is not None:
        torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0 else \
        dict(do_sample=False)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, stop_strings=stop or None, tokenizer=tokenizer,
                            streamer=TextStreamer(tokenizer, skip_prompt=True) if stream else None,
                            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
