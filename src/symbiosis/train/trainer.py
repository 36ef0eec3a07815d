"""Batched passes over many adapters' work: `Trainer.run` takes the forward / forward_backward requests of several
adapters and runs them as one pass (engine of the Tinker API's training; serve/tinker.py schedules it).

A pass: every datum of every request is a row of a padded batch [B, L] (a request's datums side by side, so each
adapter's rows are one run); the decoder runs once; each request's loss is the sum of its datums' (losses.py); one
backward of the total of the requests that asked for gradients. Gradients add up in each adapter's matrices until
its optimizer step.

The head runs a datum at a time, a chunk of its tokens at a time, and never keeps logits [n, vocab]. Where the
adapter does not train the head (a base layer, frozen), each chunk computes its logits z, the target
log-probabilities lp, the loss's gradient with respect to them, c = d loss / d lp (every loss here is a sum over
tokens: a chunk's c is its own), and at once the gradient that reaches the hidden states,
    d loss / d h = (c (onehot(target) - softmax(z)) * transform') W,
which is all that is kept: the head's GEMMs run once each way, as a plain step's would. Where the adapter trains the
head, each chunk runs under activation checkpointing (its forward again in backward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from symbiosis.client.loss import CHUNK_ELEMENTS, LOGIT_TRANSFORMS
from symbiosis.errors import BadCall, UnsupportedAdapter
from symbiosis.kernels import softmax_grad
from symbiosis.train import losses
from symbiosis.train.graphs import DecoderGraphs, capturable
from symbiosis.train.lora import HostedLora
from symbiosis.train.transfer import to_device, to_host
from symbiosis.train.model import build


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs, each [N] or [N, K]


@dataclass
class Work:
    """One forward (backward=False) or forward_backward request of one adapter."""
    lora: HostedLora
    datums: list[Datum]
    loss_fn: str
    config: dict = field(default_factory=dict)
    backward: bool = True

    @property
    def tokens(self) -> int:
        return sum(len(d.tokens) for d in self.datums)


@dataclass
class Result:
    """Per datum its target log-probabilities [N] (or [N, K]) and loss; the request's summed loss."""
    logprobs: list[torch.Tensor]
    losses: list[float]

    @property
    def loss(self) -> float:
        return sum(self.losses)


class Trainer:
    def __init__(self, model_path, executor):
        self.device, self.dtype = executor.device, executor.dtype
        self.fingerprint = executor.fingerprint
        self.model, self.state, self.targets = build(model_path, executor)
        self.activations = self.model.get_input_embeddings().weight.dtype  # the hidden states' dtype
        self.config = self.model.config.get_text_config()
        model_type = getattr(self.model.config, "model_type", None)
        if model_type not in LOGIT_TRANSFORMS:
            raise UnsupportedAdapter(f"hosted training knows how {sorted(LOGIT_TRANSFORMS)} models make their logits, "
                                     f"not {model_type!r}")
        self.transform = LOGIT_TRANSFORMS[model_type](self.model.config)
        self.head = self.model.get_output_embeddings()
        self.head_device = self.head.device  # the front's, or a GPU of a base spread over several (model._place)
        self.vocab = self.head.base.spec.out_features
        # a pass's datums in micro-batches when the decoder spans several GPUs: each GPU starts on the next one as
        # soon as it hands the last one on (the host queues them all ahead), instead of waiting for the whole pass
        # (GPipe's schedule: busy m / (m + stages - 1) of the time; backward too, autograd running each device's
        # work on a thread of its own). A micro-batch costs the host the same whatever its size (~1.5 ms a decoder
        # layer: Llama-2-13B's, measured on H100s), about the GPU time of 2,048 tokens there: smaller ones leave the
        # GPUs waiting for the host (datums of 512 tokens a micro-batch ran at a third of the pace).
        stages = len(self.state.devices)
        self.micro_batch_tokens = 2048 if stages > 1 else None  # tokens a micro-batch at least (None: whole pass)
        # ... on streams of their own: a copy between GPUs queued on a device's default (legacy) stream waits for
        # all work queued on both GPUs and holds back all work queued after it on both (CUDA's rule for the NULL
        # stream), which would put the GPUs in lockstep
        self.pass_streams = [torch.cuda.Stream(d) for d in self.state.devices if d.type == "cuda"] \
            if stages > 1 else []
        self.context = getattr(self.config, "max_position_embeddings", None)
        # the decoder's forward and backward replayed as CUDA graphs for shapes of pass that recur (graphs.py)
        self.graphs = DecoderGraphs(self.model.get_decoder(), self.state, self.device, self.activations) \
            if torch.device(self.device).type == "cuda" and stages == 1 and capturable(self.model) else None

    def check(self, work: Work) -> None:
        """`BadCall` naming what is wrong with a request, before it joins a pass."""
        if not work.datums:
            raise BadCall("no datums")
        for i, datum in enumerate(work.datums):
            if not datum.tokens:
                raise BadCall(f"datum {i}: an empty model input")
            if self.context is not None and len(datum.tokens) > self.context:
                raise BadCall(f"datum {i}: {len(datum.tokens)} tokens exceed the model's context of {self.context}")
            if min(datum.tokens) < 0 or max(datum.tokens) >= self.vocab:
                raise BadCall(f"datum {i}: token ids outside the vocabulary (0..{self.vocab - 1})")
            try:
                work.config = losses.check(work.loss_fn, len(datum.tokens), datum.inputs, work.config)
            except BadCall as e:
                raise BadCall(f"datum {i}: {e}") from None
            targets = datum.inputs["target_tokens"]
            if targets.is_floating_point() or bool(((targets < 0) | (targets >= self.vocab)).any()):
                raise BadCall(f"datum {i}: target_tokens outside the vocabulary (0..{self.vocab - 1})")

    def run(self, works: list[Work]) -> list[Result]:
        """One pass over the works' datums; backward for those that ask. Returns each work's result."""
        return self.launch(works).results()

    @property
    def overlaps(self) -> bool:
        """Whether a launched pass runs while the host goes on (a GPU's queue): the training queue may then launch
        the next pass before reading this one's results."""
        return torch.device(self.device).type == "cuda"

    def launch(self, works: list[Work]) -> "InFlight":
        """`run`'s pass queued on the device, its results read back by the returned `InFlight` (on a CPU, done
        already): the host's work until then overlaps the GPU's."""
        if self.overlaps:  # its GPU current (a replica's thread: train/replicas.py)
            with torch.cuda.device(self.device):
                return self._on_streams(works)
        return self._run(works)

    def _on_streams(self, works: list[Work]) -> "InFlight":
        if not self.pass_streams:
            return self._run(works)
        with contextlib.ExitStack() as streams:
            # after what the default streams hold (optimizer steps), and before what they get next (autograd's
            # backward runs on its forward's streams); the first device's last, so that it is the current device
            for stream in reversed(self.pass_streams):
                stream.wait_stream(torch.cuda.default_stream(stream.device))
                streams.enter_context(torch.cuda.stream(stream))
            try:
                return self._run(works)
            finally:
                for stream in self.pass_streams:
                    torch.cuda.default_stream(stream.device).wait_stream(stream)

    def _run(self, works: list[Work]) -> "InFlight":
        datums = [d for work in works for d in work.datums]
        length = max(len(d.tokens) for d in datums)
        input_ids = torch.zeros(len(datums), length, dtype=torch.long)
        mask = torch.zeros(len(datums), length, dtype=torch.long)
        for row, datum in enumerate(datums):
            input_ids[row, :len(datum.tokens)] = torch.tensor(datum.tokens)
            mask[row, :len(datum.tokens)] = 1
        backward = any(work.backward for work in works)
        # Every input of the pass in a few copies from pinned memory, none waited for (a blocking copy, or one from
        # pageable memory, may drain the GPU first: one a datum held the host and the GPU in lockstep), so the host
        # queues the pass ahead of the GPU.
        names = [sorted(datum.inputs) for datum in datums]
        input_ids, mask = to_device([input_ids, mask], self.device)
        moved = iter(to_device([d.inputs[k] for d, keys in zip(datums, names) for k in keys], self.head_device))
        inputs_of = [{k: next(moved) for k in keys} for keys in names]
        try:
            with torch.enable_grad() if backward else torch.no_grad():
                adapters = [work.lora for work in works for _ in work.datums]  # datum d's
                # datums of one length need no mask beyond the causal one (and transformers' check of a mask reads
                # it back: a wait for the GPU)
                same_length = all(len(d.tokens) == length for d in datums)
                with torch.profiler.record_function("trainer.forward"):
                    hidden = self.graphs.decode(input_ids, adapters) \
                        if self.graphs is not None and backward and same_length else None  # [B, L, H]
                    if hidden is None:
                        # the stacks of the adapters' matrices, in the pass's grad mode (gradients flow through them)
                        self.state.begin(adapters, self.activations)
                        hidden = self._decode(input_ids, None if same_length else mask)
                # every datum's log-probabilities and loss stay on the device until the pass is launched: read back
                # once at the end, not one synchronization per datum between their launches
                outputs: list = [None] * len(datums)  # per datum (lp, loss)
                total, row, frozen = None, 0, {}
                for work in works:
                    frozen_head = work.lora is None or self.head.layer_id not in work.lora.layers
                    for datum in work.datums:
                        n, inputs = len(datum.tokens), inputs_of[row]
                        if work.backward and frozen_head:  # with the other datums of its loss, below
                            key = (work.loss_fn, tuple(sorted(work.config.items())), tuple(sorted(inputs)),
                                   tuple(inputs["target_tokens"].shape[1:]))
                            frozen.setdefault(key, (work.loss_fn, work.config, []))[2].append((row, n))
                        else:
                            lp = self._target_logprobs(hidden[row, :n], inputs["target_tokens"], work.lora)
                            loss = losses.LOSSES[work.loss_fn](lp, inputs, work.config)
                            if work.backward:
                                total = loss if total is None else total + loss
                            outputs[row] = (lp.detach(), loss.detach())
                        row += 1
                for loss_fn, config, members in frozen.values():
                    rows = [r for r, _ in members]
                    lengths = [n for _, n in members]
                    if rows == list(range(rows[0], rows[-1] + 1)) and set(lengths) == {length}:
                        tokens = hidden[rows[0]:rows[-1] + 1].reshape(-1, hidden.shape[-1])  # no copy
                    else:
                        tokens = torch.cat([hidden[r, :n] for r, n in members])
                    inputs = {k: torch.cat([inputs_of[r][k] for r in rows]) for k in inputs_of[rows[0]]}
                    group_losses, lp = _FrozenHeadLoss.apply(tokens, inputs, loss_fn, config, self, lengths)
                    total = group_losses.sum() if total is None else total + group_losses.sum()
                    for r, piece, loss in zip(rows, lp.split(lengths), group_losses.detach().unbind()):
                        outputs[r] = (piece, loss)
                if total is not None:
                    with torch.profiler.record_function("trainer.backward"):
                        total.backward()
                        self.state.finish()
                    for work in works:
                        if work.backward and work.lora is not None:
                            work.lora.pending = True
        finally:
            self.state.end()
        # every datum's log-probabilities and loss copied to the host behind the pass: read once, when asked
        return InFlight(works, *to_host([t for pair in outputs for t in pair]))

    def _decode(self, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder's last hidden states [B, L, H] of the pass's datums (their stacks begun), on the head's
        device: a micro-batch of datums at a time (`micro_batch_tokens`)."""
        decoder, rows = self.model.get_decoder(), input_ids.shape[0]
        count = 1 if not self.micro_batch_tokens else max(1, min(rows, input_ids.numel() // self.micro_batch_tokens))
        size = -(-rows // count)
        parts = []
        for start in range(0, rows, size):
            batch = slice(start, start + size)
            if size < rows:
                self.state.select(batch)
            parts.append(decoder(input_ids=input_ids[batch], attention_mask=None if mask is None else mask[batch],
                                 use_cache=False)[0])
        parts = [self.state.hop(part, self.head_device) for part in parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def chunk_rows(self) -> int:
        """Tokens per chunk of the head: a chunk's logits at most CHUNK_ELEMENTS elements."""
        return max(1, CHUNK_ELEMENTS // self.vocab)

    def logits(self, hidden: torch.Tensor, lora: HostedLora | None) -> tuple[torch.Tensor, object]:
        """(logits [n, vocab], the transform's slope d logits / d raw) of hidden [n, H]: the head's output as it is
        (half precision on a GPU: what reads them computes in at least float32), or the model's logit transform
        of it in at least float32."""
        raw = self.head.project(hidden, [(0, hidden.shape[0], lora)])
        if self.transform is None:
            return raw, 1.0
        return self.transform(raw.to(torch.promote_types(raw.dtype, torch.float32)))

    def _target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, lora: HostedLora | None) -> torch.Tensor:
        """log p(targets) [n] (or [n, K]) from hidden [n, H]: the head (with the adapter's LoRA on it, if any),
        the model's logit transform, log-softmax in at least float32; a chunk at a time, each checkpointed when
        gradients flow."""
        targets = targets.long()

        def score(h, t):
            logits, _ = self.logits(h, lora)
            return _picked(logits, t)

        pieces = []
        for start in range(0, hidden.shape[0], self.chunk_rows()):
            h, t = hidden[start:start + self.chunk_rows()], targets[start:start + self.chunk_rows()]
            pieces.append(checkpoint(score, h, t, use_reentrant=False) if torch.is_grad_enabled() else score(h, t))
        return torch.cat(pieces)


class InFlight:
    """A pass queued on the device (`Trainer.launch`), its datums' log-probabilities and losses being copied to the
    host (`read`, in datum order, each datum's pair; ready once `event` is, or now where it is None)."""

    def __init__(self, works: list[Work], read: list[torch.Tensor], event: "torch.cuda.Event | None"):
        self.works, self._read, self._event = works, read, event

    def done(self) -> bool:
        """Whether the device has finished the pass (`results` will not wait)."""
        return self._event is None or self._event.query()

    def results(self) -> list[Result]:
        """Each work's result, once the device has made them."""
        if self._event is not None:
            self._event.synchronize()
        logprobs_read, losses_read = self._read[0::2], [float(loss) for loss in self._read[1::2]]
        results, row = [], 0
        for work in self.works:
            end = row + len(work.datums)
            results.append(Result(logprobs_read[row:end], losses_read[row:end]))
            row = end
        return results


def _picked(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(logits) at `targets` ([n] or [n, K]), in at least float32; `lse`: the logits' log-sum-exp [n, 1],
    if made already."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    lp = logits.gather(1, targets if targets.dim() == 2 else targets[:, None]) - lse
    return lp if targets.dim() == 2 else lp[:, 0]


class _FrozenHeadLoss(torch.autograd.Function):
    """(losses [D], lp [T] or [T, K]) of D datums of one loss whose tokens are the T rows of `hidden` (`lengths`
    each) through a frozen head, chunks of rows across datums; forward also makes d loss / d hidden chunk by chunk
    and keeps only that (see the module's docstring). One call for all those datums of a pass: a call a datum was
    ~1.7 ms of the host's time (H100, Llama-3.2-1B), 55 ms a pass at 32 tenants."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, inputs: dict, loss_fn: str, config: dict, trainer: "Trainer",
                lengths: list[int]):
        targets = inputs["target_tokens"].long()
        chunk = trainer.chunk_rows()
        grad_hidden = torch.empty_like(hidden)
        lps = []
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            z, slope = trainer.logits(hidden[rows], None)  # [C, vocab], this chunk's own
            target = targets[rows]
            index = target if target.dim() == 2 else target[:, None]  # [C, K]
            lse = softmax_grad.logsumexp_rows(z)  # [C], float32 at least
            lp = (z.gather(1, index).to(lse.dtype) - lse[:, None]).requires_grad_()  # [C, K]
            with torch.enable_grad():  # c = d loss / d lp: every loss is a sum over tokens, so the chunk's own
                picked = lp if target.dim() == 2 else lp[:, 0]  # as the targets' shape
                loss = losses.LOSSES[loss_fn](picked, {k: v[rows] for k, v in inputs.items()}, config)
                (c,) = torch.autograd.grad(loss, lp)
            # d loss / d z = sum_k c_k onehot(t_k) - (sum_k c_k) softmax(z), made in z's own memory
            grad = softmax_grad.softmax_grad_(z, lse, index, c)
            if not isinstance(slope, float):
                grad = grad * slope
            grad_hidden[rows] = trainer.head.base.backward(grad.to(hidden.dtype))
            lps.append(picked.detach())
        lp = torch.cat(lps)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        per_datum = torch.stack([losses.LOSSES[loss_fn](lp[a:a + n], {k: v[a:a + n] for k, v in inputs.items()}, config)
                                 for a, n in zip(starts, lengths)])
        ctx.save_for_backward(grad_hidden)
        ctx.lengths = lengths
        ctx.mark_non_differentiable(lp)
        return per_datum, lp

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor, grad_lp: torch.Tensor | None):
        (grad_hidden,) = ctx.saved_tensors
        lengths = ctx.lengths
        if len(set(lengths)) == 1:  # each token's row scaled by its datum's loss's gradient
            per_token = grad_losses.repeat_interleave(lengths[0])
        else:
            per_token = torch.cat([g.expand(n) for g, n in zip(grad_losses.unbind(), lengths)])
        return grad_hidden * per_token[:, None].to(grad_hidden.dtype), None, None, None, None, None
