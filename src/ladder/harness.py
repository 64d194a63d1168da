"""EleutherAI's lm-evaluation-harness on ladder's model: `ladder eval --tasks`, at any TP degree and layout.

`ladder_lm(...)` makes an lm-eval model (a `TemplateLM` whose requests `LadderRequests` answers):
lm-eval turns each task into requests, and ladder answers the three kinds, following lm-eval's `hf` model wherever a choice changes a score, so that the two give
the same numbers on one folder (tests/test_harness.py):
- loglikelihood: the continuation's log-probability given its context (context and continuation tokenised
  together, the whole cut to the last `max_length` + 1 tokens), and whether greedy decoding gives it;
- loglikelihood_rolling: a document's log-likelihood over lm-eval's rolling windows of `max_length`;
- generate_until: greedy (or sampled) text on ladder's engine (`ladder.runtime.completions`), cut at the first
  stop string.
Under tensor parallelism every rank runs the harness on the same requests in the same order (it sorts
them itself), so their forwards pair up; rank 0 reports.

ladder's own tasks, made from offline text, live in `ladder/data/lm_eval_tasks` (tag `ladder_offline`);
any other lm-eval task runs where its dataset can be fetched.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ladder.checkpoint.tokenizer import TextTokenizer
from ladder.errors import LadderError
from ladder.model.transformer import Transformer
from ladder.runtime.completions import complete
from ladder.runtime.engine import Engine
from ladder.runtime.sampling import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256  # as lm-eval's hf model


def offline_tasks_dir() -> Path:
    return Path(str(resources.files("ladder") / "data" / "lm_eval_tasks"))


def task_manager(tasks: Sequence[str], include_paths: Sequence[str] = ()) -> Any:
    """lm-eval's `TaskManager` for `tasks`: ladder's offline tasks and the user's folders alone where they
    hold every task asked for, else with lm-eval's own (indexing its 14,000-odd task files takes seconds,
    on every rank)."""
    from lm_eval.tasks import TaskManager  # (with lm-eval, which the caller imported)

    paths = [str(offline_tasks_dir()), *map(str, include_paths)]
    own = TaskManager(include_path=paths, include_defaults=False)
    return own if all(task in own.all_tasks for task in tasks) else TaskManager(include_path=paths)


def ladder_lm(model: Transformer, tokenizer: TextTokenizer, batch_size: int = 8, max_length: int | None = None,
              quiet: bool = False) -> Any:
    """An lm-eval model (`lm_eval.api.model.LM`) over one rank's shard of a ladder model and its tokenizer."""
    return _lm_class()(model, tokenizer, batch_size, max_length, quiet)


@functools.cache
def _lm_class() -> type:
    """`LadderRequests` on lm-eval's `TemplateLM`, made when first asked for: lm-eval takes 0.3 s to import,
    which only `ladder eval --tasks` should pay."""
    try:
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise LadderError('--tasks needs lm-evaluation-harness: pip install "lm-eval[api]==0.4.13"') from None
    return type("LadderLM", (LadderRequests, TemplateLM), {})


class LadderRequests:
    """What lm-eval asks of a model, answered by a ladder `Transformer` (the first base of `_lm_class`;
    `TemplateLM` adds the tokenisation of context and continuation, and the cache hook)."""

    cache_hook: Any  # (set by lm-eval's LM)

    def __init__(self, model: Transformer, tokenizer: TextTokenizer, batch_size: int = 8,
                 max_length: int | None = None, quiet: bool = False) -> None:
        super().__init__()
        self.model, self.text_tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self._max_length = max_length or model.config.max_seq_len
        if self._max_length > model.config.max_seq_len:
            raise LadderError(f"--max-length {self._max_length} exceeds the model's context ({model.config.max_seq_len})")
        self.quiet = quiet  # every rank but rank 0: no progress bars
        self._engine: Engine | None = None

    # ---- what lm-eval asks of a model --------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.text_tokenizer.token_id(self.text_tokenizer.eos_token)
        if eos is None:
            raise LadderError("this model's tokenizer has no end-of-text token, which lm-eval needs")
        return eos

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: BOS, else EOS (as lm-eval's hf model)."""
        bos = self.text_tokenizer.token_id(self.text_tokenizer.bos_token)
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return "ladder"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.text_tokenizer.encode(string, add_bos=add_special_tokens)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.text_tokenizer.decode(tokens)

    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """Each continuation's log-probability and greediness, in batches of similar lengths (longest first),
        each a single causal forward with the rows right-padded (padding after a row cannot change it)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc="loglikelihood", unit="batch", disable=disable_tqdm or self.quiet,
                          dynamic_ncols=True):
            inputs, spans = [], []
            for i in batch:
                _, context, continuation = requests[i]
                if not continuation:
                    raise LadderError("lm-eval asked for the log-likelihood of an empty continuation")
                whole = (context + continuation)[-(self.max_length + 1):]
                inputs.append(whole[:-1])
                spans.append((len(whole) - 1 - len(continuation), continuation))  # first position that predicts it
            longest = max(len(x) for x in inputs)
            tokens = torch.tensor([x + [0] * (longest - len(x)) for x in inputs], device=self.device)
            logp = F.log_softmax(self.model(tokens).float(), dim=-1)  # (B, T, vocab)
            for row, (i, (start, continuation)) in enumerate(zip(batch, spans)):
                picked = logp[row, start:start + len(continuation)]  # (n, vocab)
                target = torch.tensor(continuation, device=self.device)
                answer = (picked.gather(-1, target[:, None]).sum().item(), bool((picked.argmax(-1) == target).all()))
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over lm-eval's rolling windows (as its hf model cuts them)."""
        from lm_eval import utils as lm_eval_utils  # (with lm-eval, which `_lm_class` imported)

        windows, owner = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_eval_utils.make_disjoint_window, lm_eval_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, scores):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Completions of each context, cut at the first stop string, batched by shared settings."""
        out: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(_generation_key(req.args[1], self.tok_decode([self.eot_token_id])), []).append(i)
        for (until, max_new, temperature), members in groups.items():
            contexts = [self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] for i in members]
            new = complete(self.engine, contexts, max_new, SamplingParams(temperature), [self.eot_token_id],
                           self.batch_size, progress=not (disable_tqdm or self.quiet))
            for i, ids in zip(members, new):
                text = self.tok_decode(ids)
                cut = min((text.find(s) for s in until if s and s in text), default=len(text))
                out[i] = text[:cut]
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    @property
    def engine(self) -> Engine:
        """The engine for generate_until, made at first use: it prepares the model for decoding (packed
        weights on CPU), which the scoring forwards do not need."""
        if self._engine is None:
            self._engine = Engine(self.model)
        return self._engine


def _generation_key(kwargs: dict[str, Any], eot_text: str) -> tuple[tuple[str, ...], int, float]:
    """(stop strings, max new tokens, temperature) of a generate_until request (lm-eval's defaults: stop at
    the end-of-text text, 256 tokens, greedy)."""
    kwargs = dict(kwargs or {})
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    if eot_text not in until:
        until.append(eot_text)
    temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
    return tuple(until), int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)), temperature
