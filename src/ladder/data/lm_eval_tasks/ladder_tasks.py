"""Loaders for ladder's offline lm-evaluation-harness tasks: each task's documents are a JSON-lines file
beside this one (built by experiments/lm_eval_tasks.py), so nothing is downloaded."""

import json
import re
from pathlib import Path


def load(data_file: str, fewshot_file: str | None = None, **metadata):
    """The task's documents as its test split (and its few-shot examples as its train split)."""
    import datasets  # (lm-eval's own dependency)

    splits = {"test": data_file, "train": fewshot_file}
    return {split: datasets.Dataset.from_list(_rows(name)) for split, name in splits.items() if name}


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (Path(__file__).parent / name).read_text(encoding="utf-8").splitlines()]


def rolling_results(doc, results):
    """wikitext's metrics: the document's log-likelihood per word and per byte."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["page"]))
    size = len(doc["page"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, size),
            "bits_per_byte": (loglikelihood, size)}
