"""A request's text, decoded a window at a time (engine/stops.py), against decoding the whole output at every token
(what the engine did before): the same text, the same pieces streamed, the same stop, for tokenizers of the three
families real checkpoints use (byte-level BPE as Llama-3 and GPT-2, SentencePiece-style Metaspace as Llama-2 and
Mistral, WordPiece with transformers' clean-up of spaces as BERT)."""

from __future__ import annotations

import random

import pytest
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from symbiosis.engine import stops
from symbiosis.engine.params import SamplingParams
from symbiosis.engine.scheduler import Request

TEXT = ["The cat sees a dog , isn't it ? Don't go . Café naïve résumé – 日本語のテキスト 🙂🚀 ¿qué? ...",
        "Größe über ÄÖÜ ß «quotes» 'single' \"double\" n't 's 're 've 'm . , ! ?",
        "tabs\tand\nnew lines\n\n  double  spaces   émoji 👍🏽 ζωή жизнь हिन्दी"] * 30


def _byte_level():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _metaspace():
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"] + alphabet))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _wordpiece():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(TEXT, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


TOKENIZERS = {"byte_level": _byte_level, "metaspace": _metaspace, "wordpiece": _wordpiece}


def _whole_output_each_token(request, token, tokenizer, eos_ids):
    """The rule before windows: the whole output decoded at every token."""
    params = request.params
    reason = "stop" if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids) else None
    request.text = tokenizer.decode(request.output[:-1] if reason else request.output, skip_special_tokens=True)
    hits = [request.text.find(s) for s in params.stop if s in request.text] if reason is None else []
    if hits:
        request.text, reason = request.text[:min(hits)], "stop"
    if reason is None and len(request.output) >= params.max_tokens:
        reason = "length"
    return reason


def _stream(tokens, params, tokenizer, rule):
    request = Request("r", [1], params, None, None)
    eos_ids = {tokenizer.eos_token_id}
    pieces = []
    for token in tokens:
        request.output.append(token)
        reason = rule(request, token, tokenizer, eos_ids)
        pieces.append(stops.new_text(request, final=reason is not None))
        if reason is not None:
            return pieces, reason, request.text
    return pieces, None, request.text


@pytest.mark.parametrize("family", sorted(TOKENIZERS))
def test_windowed_text_is_the_whole_outputs_decode_piece_by_piece(family):
    tokenizer = TOKENIZERS[family]()
    rng = random.Random(family)
    encoded = [tokenizer.encode(line, add_special_tokens=False) for line in TEXT[:3]]
    vocabulary = len(tokenizer)
    for case in range(200):
        if case % 3 == 0:  # ids at random: split characters, special tokens, anything
            tokens = [rng.randrange(vocabulary) for _ in range(rng.randrange(1, 120))]
        else:  # real text, cut anywhere
            line = rng.choice(encoded)
            start = rng.randrange(len(line))
            tokens = line[start:start + rng.randrange(1, 120)]
        stop = rng.choice([[], [" ."], ["?", "日本"], ["e", "xyz"], ["isn't"]])
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if case % 4 == 1 and len(text) > 8:  # a stop string from the text itself, across window edges too
            at = rng.randrange(len(text) - 6)
            stop = [text[at:at + rng.randrange(2, 7)]]
        params = SamplingParams(max_tokens=rng.randrange(1, 130), stop=stop, ignore_eos=case % 2 == 0)
        windowed = _stream(tokens, params, tokenizer, stops.stop_reason)
        whole = _stream(tokens, params, tokenizer, _whole_output_each_token)
        assert windowed == whole, (family, case, tokens, stop)


def test_a_long_output_decodes_a_window_not_the_whole_output_each_token():
    """A 2,000-token output: each token's decode sees at most the window and its context, not the output so far."""
    tokenizer = _byte_level()
    seen = []
    decode = tokenizer.decode

    def counting(ids, **options):
        seen.append(len(ids))
        return decode(ids, **options)

    tokenizer.decode = counting
    line = tokenizer.encode(" ".join(TEXT), add_special_tokens=False)[:2000]
    pieces, reason, text = _stream(line, SamplingParams(max_tokens=2000, ignore_eos=True), tokenizer,
                                   stops.stop_reason)
    assert reason == "length" and "".join(pieces) == text == decode(line, skip_special_tokens=True)
    assert max(seen[:-1]) <= stops._CONTEXT + 4 * stops._WINDOW  # the last: the whole output, once
    assert sum(seen[:-1]) < 20 * len(line)
    assert seen[-1] == 2000
