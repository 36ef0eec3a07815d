"""Fine-tuning data: JSONL files in OpenAI's formats, checked line by line, turned into training examples.

Each line is one example, either a chat
    {"messages": [{"role": "system" | "user" | "assistant", "content": "...", "weight": 0 | 1 (assistant, optional)},
                  ...]}                                   at least one assistant message; the assistants' turns train
or a prompt and its completion
    {"prompt": "...", "completion": "..."}               the completion trains

An example becomes tokens (the chat template renders a chat; a completion ends with the end-of-sequence token) and
per-token weights (1 where the token is trained on). `check_lines` reports the first bad line by number (bad JSON,
a missing role, empty content, ...); `tokenize` adds what needs the model (too long for its context).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable

from symbiosis.errors import BadCall

MAX_FILE_BYTES = 64 << 20  # one uploaded file
MAX_LINES = 100_000
MAX_TRAINED_TURNS = 256  # assistant turns trained in one chat: each is the chat rendered twice, up to it
ROLES = {"system", "developer", "user", "assistant"}


@dataclass
class Example:
    tokens: list[int]
    weights: list[float]  # per token: 1 if it is trained on (predicted from what comes before)


class DataError(BadCall):
    """A training file that cannot be used, naming its line."""

    def __init__(self, line: int | None, message: str):
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.line = line


def _text(content, where: str) -> str:
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ValueError(f"{where}: content parts must be text")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str) or not content.strip():
        raise ValueError(f"{where}: empty or missing content")
    return content


def _json(line: str):
    try:
        return json.loads(line)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    except RecursionError:  # (arrays nested past the parser's depth)
        raise ValueError("not JSON this service reads: nested too deep") from None


def parse_line(line: str) -> dict:
    """One example, checked: {"messages": [...]} (roles, texts, weights) or {"prompt", "completion"}."""
    record = _json(line)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        checked = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise ValueError(f"message {i}: role must be one of {sorted(ROLES)}")
            weight = message.get("weight", 1)
            if weight not in (0, 1) or (weight == 0 and message["role"] != "assistant"):
                raise ValueError(f"message {i}: weight must be 0 or 1, on assistant messages")
            checked.append({"role": "system" if message["role"] == "developer" else message["role"],
                            "content": _text(message.get("content"), f"message {i}"), "weight": weight})
        trained = sum(m["role"] == "assistant" and m["weight"] == 1 for m in checked)
        if not trained:
            raise ValueError("no assistant message to train on")
        if trained > MAX_TRAINED_TURNS:
            raise ValueError(f"{trained} assistant messages to train on, more than {MAX_TRAINED_TURNS} in one "
                             "example: split the chat")
        return {"messages": checked}
    if "prompt" in record or "completion" in record:
        if not isinstance(record.get("prompt"), str) or not isinstance(record.get("completion"), str):
            raise ValueError("prompt and completion must both be strings")
        if not record["completion"].strip():
            raise ValueError("empty completion")
        return {"prompt": record["prompt"], "completion": record["completion"]}
    raise ValueError('each line must hold "messages", or "prompt" and "completion"')


def parse_text_line(line: str) -> dict:
    """One line of a domain corpus or an HMI task's data: {"text": ...}, with an integer "label" (0..1023) for a
    classifier."""
    record = _json(line)
    if not isinstance(record, dict) or not isinstance(record.get("text"), str) or not record["text"].strip():
        raise ValueError('each line must be an object with a non-empty "text"')
    label = record.get("label")
    if label is not None and (not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < 1024):
        raise ValueError('"label" must be an integer in 0..1023')
    return {"text": record["text"], "label": label}


def check_lines(data: bytes, parse: Callable[[str], dict] = parse_line) -> list[dict]:
    """The examples of a JSONL file (each line read by `parse`), or DataError naming the first bad line."""
    if len(data) > MAX_FILE_BYTES:
        raise DataError(None, f"the file is over {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(None, f"the file is not UTF-8 ({e})") from None
    examples = []
    # lines end at "\n" alone: str.splitlines would also split at U+2028, U+0085 and the like, which JSON strings
    # may hold raw
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        if len(examples) >= MAX_LINES:
            raise DataError(number, f"more than {MAX_LINES} examples")
        try:
            examples.append(parse(line))
        except ValueError as e:
            raise DataError(number, str(e)) from None
    if not examples:
        raise DataError(None, "the file holds no examples")
    return examples


def tokenize(records: list[dict], tokenizer, context: int | None, vocab: int | None = None) -> list[Example]:
    """Examples as tokens and weights; DataError naming the line of one too long for `context` tokens, of one with
    a token id the model's `vocab` lacks (a tokenizer that does not match the model), or of a chat the template does
    not render turn by turn."""
    examples = []
    for number, record in enumerate(records, 1):
        if "messages" in record:
            example = _chat(record["messages"], tokenizer, number, context)
        else:
            prompt = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"] if record["prompt"] else []
            completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
            if tokenizer.eos_token_id is not None:
                completion = completion + [tokenizer.eos_token_id]
            example = Example(prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion))
        if len(example.tokens) < 2:
            raise DataError(number, "fewer than two tokens")
        _check_context(number, example.tokens, context)
        if vocab is not None and max(example.tokens) >= vocab:
            raise DataError(number, f"token id {max(example.tokens)} is outside the model's vocabulary of {vocab} "
                                    "(the tokenizer does not match the model)")
        examples.append(example)
    return examples


def _chat(messages: list[dict], tokenizer, number: int, context: int | None = None) -> Example:
    """The chat's tokens; an assistant turn's own tokens (the rendering of the chat up to it, less the rendering up
    to the turn before with the generation prompt) are trained on unless its weight is 0. A chat longer than
    `context` fails before its turns are rendered one by one (that is two renderings a trained turn)."""
    def render(turns, generation_prompt):
        plain = [{"role": m["role"], "content": m["content"]} for m in turns]
        try:
            return tokenizer.apply_chat_template(plain, tokenize=True, add_generation_prompt=generation_prompt,
                                                 return_dict=False)
        except Exception as e:  # noqa: BLE001 -- no template, or one that refuses these turns
            raise DataError(number, f"the chat template cannot render this chat ({e})") from None

    tokens = render(messages, False)
    _check_context(number, tokens, context)
    weights = [0.0] * len(tokens)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message["weight"]:
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if through[:len(before)] != before or tokens[:len(through)] != through:
            raise DataError(number, "the chat template does not render this chat one turn after another")
        weights[len(before):len(through)] = [1.0] * (len(through) - len(before))
    return Example(list(tokens), weights)


def _check_context(number: int, tokens: list[int], context: int | None) -> None:
    if context is not None and len(tokens) > context:
        raise DataError(number, f"{len(tokens)} tokens, more than the model's context of {context}")


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The examples' order in one epoch: a permutation drawn from (seed, epoch) alone, so a resumed job sees the
    data in the order it would have."""
    order = list(range(count))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order
