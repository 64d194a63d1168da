"""Distillation: a converted model (the student) learns the outputs of the model it came from (the teacher).

Next-token labels say one thing per position; the teacher's distribution says how likely every token is,
and keeps the chat format, since the targets are the model's own. The loss of `ladder train` is

    kl_weight * T^2 * KL(teacher_T || student_T)  +  hidden_weight * H  +  ce_weight * CE(student, text)

- KL on the logits at temperature T (`temperature`), averaged over positions. T = 1 matches the
  distributions themselves, which is what perplexity and greedy agreement measure; a higher T weighs the
  teacher's unlikely tokens more, and T^2 keeps the gradient's scale (Hinton et al., 2015).
- H matches the residual stream after each converted layer: the mean over those layers and the positions
  of |s - t|^2 / |t|^2 (each stream is the embedding plus the output of every module so far, so the sum
  does not depend on when a layout adds them). Each converted layer is told what it must give, not only
  the last one.
- CE: the usual next-token loss on the training text.

The teacher is frozen and deterministic; its digest goes into every checkpoint, and `--resume` refuses
a teacher that changed.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.comm.base import LocalCommunicator
from ladder.errors import LadderError
from ladder.model.spec import LoadedModel, ModelSpec
from ladder.model.transformer import PartialStream, Transformer

ORIGINAL = "original"


def teacher_spec(teacher: str, model: str | None, device: str) -> ModelSpec:
    """The teacher a run names: `original` (the checkpoint being trained, in its own layout) or a checkpoint."""
    if teacher == ORIGINAL:
        if model is None:
            raise LadderError("teacher=original needs model= (the checkpoint converted and trained)")
        return ModelSpec(model=model, device=device, dtype="float32")
    return ModelSpec(model=teacher, device=device, dtype="float32")


def load_teacher(spec: ModelSpec, device: torch.device, student: Transformer, student_tokenizer: TextTokenizer | None,
                 dtype: torch.dtype = torch.float32) -> tuple[Transformer, str]:
    """The teacher, frozen, in `dtype` (bf16 where the run computes in bf16: autocast would cast its weights
    at every forward), after checking that it reads and writes the student's tokens; and its identity,
    the label and a digest of its float32 weights."""
    loaded: LoadedModel = spec.load(LocalCommunicator(), device)
    check_same_tokens(loaded, student, student_tokenizer, spec.label)
    identity = f"{spec.label} ({weights_digest(loaded.model)})"
    return loaded.model.requires_grad_(False).eval().to(dtype), identity


def check_same_tokens(teacher: LoadedModel, student: Transformer, student_tokenizer: TextTokenizer | None,
                      label: str) -> None:
    """A KL between two models is defined only over one vocabulary, token for token."""
    t_vocab, s_vocab = teacher.model.config.vocab_size, student.config.vocab_size
    if t_vocab != s_vocab:
        raise LadderError(f"the teacher {label} has a vocabulary of {t_vocab} tokens and the student {s_vocab}: "
                          "distillation needs the same tokenizer")
    if tokenizer_digest(teacher.tokenizer) != tokenizer_digest(student_tokenizer):
        raise LadderError(f"the teacher {label} has another tokenizer than the student (same size, other tokens): "
                          "distillation needs the same tokenizer")


def tokenizer_digest(tokenizer: TextTokenizer | None) -> str | None:
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(repr(vocab).encode()).hexdigest()


@torch.no_grad()
def weights_digest(model: Transformer) -> str:
    """A short digest of a model's weights, read in one pass: each tensor's sum and sum of squares."""
    stats = [torch.stack([p.double().sum(), p.double().square().sum()]) for _, p in sorted(model.state_dict().items())
             if p.is_floating_point()]
    return hashlib.sha256(torch.stack(stats).cpu().numpy().tobytes()).hexdigest()[:16]


class ResidualTaps:
    """The residual stream after each layer of a TP-1 model, recorded from the embedding's and every
    module's output by forward hooks (nothing in the model changes) while `recording()` is on."""

    def __init__(self, model: Transformer) -> None:
        self.outputs: list[torch.Tensor] = []
        self.on = False
        modules = [model.tok_embeddings] + [m for layer in model.layers for m in (layer.attention, layer.feed_forward)]
        for module in modules:
            module.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        if self.on:
            self.outputs.append(output)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.outputs, self.on = [], True
        try:
            yield
        finally:
            self.on = False

    def after_layers(self, first: int, start: PartialStream | None = None) -> torch.Tensor:
        """The stream after layers first..L-1, (L - first, B, T, dim), in float32: the embedding plus every
        module output up to that layer's MLP (the outputs come in execution order: embedding, then attention
        and MLP of each layer), or, where the forward began at layer `first` (`start`), that stream plus the
        outputs recorded. Summed as it goes: a cumsum over the stacked outputs took 15 % of a SmolLM2
        distillation step on CPU."""
        if start is None:
            stream, outputs = sum(out.float() for out in self.outputs[:1 + 2 * first]), self.outputs[1 + 2 * first:]
        else:
            stream, outputs = start.r.float() + start.pending.float(), self.outputs
        after = []
        for attention, mlp in zip(outputs[::2], outputs[1::2]):
            stream = stream + attention.float() + mlp.float()
            after.append(stream)
        return torch.stack(after)


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * mean over positions of KL(teacher || student), both at temperature T."""
    t = temperature
    scaled = (lambda logits: logits.float() / t) if t != 1 else (lambda logits: logits.float())  # (a pass saved)
    with torch.no_grad():
        teacher_logp = F.log_softmax(scaled(teacher_logits), dim=-1)
    # Summed as p (log p - log q), not as cross-entropy minus entropy: two numbers of about ln(vocab) whose
    # difference, a small KL, would keep only a few of float32's digits.
    kl = (teacher_logp.exp() * (teacher_logp - F.log_softmax(scaled(student_logits), dim=-1))).sum(-1)
    return kl.mean() * t * t


def residual_mismatch(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over layers and positions of |s - t|^2 / |t|^2, streams (layers, B, T, dim). Per position, so
    that the mean over a batch is the mean of its micro-batches' (data parallel ranks split them)."""
    return ((student - teacher).square().sum(-1) / teacher.square().sum(-1)).mean()


class Objective:
    """A run's loss on a micro-batch: cross-entropy alone, or distillation from a teacher (the module's
    docstring), as the weights say. The student's forward runs here, so that its residual taps record it.

    `share_prefix`: the student's layers before its first ladder layer are the teacher's, frozen (the
    original model as teacher, only the converted layers training). Their stream is then computed once,
    by the teacher, and both models go on from it: for ladder on the last 8 of SmolLM2's 30 layers, a
    step computes 22 layers fewer of 60 forwards, and the student's losses and gradients are the same (in
    float32; in bf16 the student's first layers compute as the teacher's bf16 copy does)."""

    def __init__(self, weights: dict[str, float], temperature: float, student: Transformer,
                 teacher: Transformer | None, share_prefix: bool = False) -> None:
        self.weights, self.temperature, self.teacher = weights, temperature, teacher
        self.first_matched = student.config.first_ladder_layer
        self.shared_layers = self.first_matched if share_prefix and teacher is not None else 0
        self.taps: tuple[ResidualTaps, ResidualTaps] | None = None
        if weights["hidden"]:
            if teacher is None:
                raise LadderError("hidden_weight needs a teacher")
            if student.config.layout not in ("standard", "ladder") or student.config.n_ladder_layers == 0:
                raise LadderError("hidden_weight matches the residual stream after each converted layer: it needs "
                                  f"a ladder conversion (ladder_layers), not the {student.config.layout_name} layout")
            if teacher.config.n_layers != student.config.n_layers or teacher.config.dim != student.config.dim:
                raise LadderError("hidden_weight needs a teacher with the student's layers and width")
            self.taps = ResidualTaps(student), ResidualTaps(teacher)

    @property
    def terms(self) -> list[str]:
        """The loss terms this run computes and reports (the weighted sum is the loss)."""
        return [name for name, weight in self.weights.items() if weight]

    def losses(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each term on inputs (B, T) and their next tokens (B, T); `model` may wrap the student (DDP)."""
        student_taps, teacher_taps = self.taps or (None, None)
        shared = None
        if self.shared_layers:
            with torch.no_grad():
                shared = self.teacher.stream_before(inputs, self.shared_layers)
        with student_taps.recording() if student_taps else contextlib.nullcontext():
            logits = model(inputs, resume_from=shared) if shared else model(inputs)  # (B, T, vocab)
        terms: dict[str, torch.Tensor] = {}
        if self.weights["ce"]:
            terms["ce"] = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        if self.teacher is not None:
            with torch.no_grad(), teacher_taps.recording() if teacher_taps else contextlib.nullcontext():
                teacher_logits = self.teacher(inputs, resume_from=shared)
            if self.weights["kl"]:
                terms["kl"] = kl_to_teacher(logits, teacher_logits, self.temperature)
            if student_taps and teacher_taps:
                terms["hidden"] = residual_mismatch(student_taps.after_layers(self.first_matched, shared),
                                                    teacher_taps.after_layers(self.first_matched, shared))
        return terms

    def total(self, terms: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(self.weights[name] * value for name, value in terms.items())  # type: ignore[return-value]
