"""Self-distillation data: the teacher's own answers to a set of prompts, written by ladder's engine
(`ladder.runtime.completions`). No dataset is needed, the text is in the teacher's chat format, and its
distribution is the teacher's, which a converted model must match.

`data=answers:builtin` (or `answers:PROMPTS.txt`) in `ladder train`. The answers are written once into
the run's folder (`teacher-answers.jsonl`, renamed into place when whole) and read back by later starts
of the same run, so `--resume` trains on the same text. Each rank writes its contiguous share of the
prompts; a prompt's answer is seeded by its index, so the text does not depend on the number of ranks.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.comm.base import LocalCommunicator
from ladder.comm.distributed import from_every_rank
from ladder.console import say
from ladder.errors import LadderError
from ladder.files import write_text
from ladder.model.spec import ModelSpec
from ladder.runtime.completions import complete
from ladder.runtime.engine import Engine
from ladder.runtime.sampling import SamplingParams
from ladder.train.prompts import read_prompts

ANSWERS_PREFIX = "answers:"
ANSWERS_FILE = "teacher-answers.jsonl"
BATCH = 32  # prompts decoded together


def is_answers(spec: str) -> bool:
    return spec.startswith(ANSWERS_PREFIX)


def answer_texts(source: str, writer: ModelSpec, writer_digest: str, tokenizer: TextTokenizer, out_dir: Path,
                 max_new_tokens: int, temperature: float, seed: int, device: torch.device, rank: int, world: int,
                 progress: bool = True) -> list[str]:
    """Each prompt of `source` in the chat template, followed by the answer of the model `writer` names
    (with its end-of-turn token): from the run's folder if it holds these answers, else written now."""
    prompts = read_prompts(source.removeprefix(ANSWERS_PREFIX))
    if not tokenizer.chat_template:
        raise LadderError(f"data {source} asks for chat answers, and this model's tokenizer has no chat template")
    key = {"prompts": hashlib.sha256("\n".join(prompts).encode()).hexdigest(), "writer": writer_digest,
           "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    path = out_dir / ANSWERS_FILE
    saved = _read_saved(path, key)
    if saved is not None:
        return saved
    rendered = [tokenizer.render_chat([{"role": "user", "content": p}]) for p in prompts]
    ids = [tokenizer.encode(text, add_bos=False) for text in rendered]
    begin, end = len(ids) * rank // world, len(ids) * (rank + 1) // world
    if rank == 0:
        say(f"ladder: writing the teacher's answers to {len(prompts)} prompts ({source}), up to {max_new_tokens} "
            f"tokens each, into {path}")
    engine = Engine(writer.load(LocalCommunicator(), device).model)  # (its weights freed with the engine)
    answers = complete(engine, ids[begin:end], max_new_tokens, SamplingParams(temperature, seed=seed),
                       tokenizer.stop_ids, BATCH, first_index=begin, progress=progress and rank == 0)
    del engine
    mine = [text + tokenizer.decode(answer, skip_special=False) for text, answer in zip(rendered[begin:end], answers)]
    texts = [text for share in from_every_rank(mine) for text in share]  # type: ignore[union-attr]
    if rank == 0:
        _write(path, key, texts)
    return texts


def _read_saved(path: Path, key: dict) -> list[str] | None:
    if not path.is_file():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or json.loads(lines[0]) != {"key": key}:
        raise LadderError(f"{path} holds answers written with other prompts, teacher or settings: remove it, or "
                          "choose another out_dir")
    return [json.loads(line)["text"] for line in lines[1:]]


def _write(path: Path, key: dict, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "".join(json.dumps(r) + "\n" for r in [{"key": key}, *({"text": t} for t in texts)]))
