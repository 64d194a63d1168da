"""A GGUF file converted once: its llama weights, dequantized, and its tokenizer, as a Hugging Face folder
in ladder's cache folder, which later starts read instead of the GGUF.

Reading a GGUF costs every start what a user does not need: gguf's reader parses every metadata string
(SmolLM2's 49,152 tokens and 48,900 merges one by one: 5.4 s of a 9.9 s load on this CPU), the tokenizer
is built from them, and each tensor is dequantized. A Hugging Face folder opens in a fraction of that
(safetensors maps the weights; tokenizer.json loads in Rust).

Where: `LADDER_CACHE_DIR` (default `~/.cache/ladder`), `gguf/<key>/`; `LADDER_CACHE_DIR=off` turns it
off. An entry holds float32 weights, 4 bytes a parameter (SmolLM2-135M: 540 MB), and is written once per
GGUF file, atomically (`ladder.checkpoint.hf.save_hf`). The key is the file's resolved path, size and
modification time and this converter's version; the entry records them and is used only when they all
match, so an entry never gives one file another's weights. A failure to write (a full disk) leaves the
GGUF as it is read, with one line saying why; a damaged entry is removed and written again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

from ladder.checkpoint.base import Checkpoint
from ladder.checkpoint.gguf import open_gguf
from ladder.checkpoint.hf import open_hf, save_hf
from ladder.console import say
from ladder.errors import LadderError
from ladder.options import CACHE_DIR, cache_root

CONVERTER_VERSION = 1  # raise when what an entry holds changes: older entries are then not read
IDENTITY_FILE = "ladder-gguf.json"


def file_identity(path: Path) -> dict[str, object]:
    stat = path.stat()
    return {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "converter": CONVERTER_VERSION}


def entry_for(path: Path, root: Path) -> Path:
    identity = json.dumps(file_identity(path), sort_keys=True)
    return root / "gguf" / hashlib.sha256(identity.encode()).hexdigest()[:24]


def open_gguf_cached(path: Path) -> Checkpoint:
    """The GGUF's checkpoint, from its cache entry when there is one (its format still "gguf"), else read
    from the file and written into the cache for the next start."""
    root = cache_root()
    if root is None:
        return open_gguf(path)
    entry = entry_for(path, root)
    cached = _read_entry(entry, path)
    if cached is not None:
        return cached
    checkpoint = open_gguf(path)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one writer a machine; its other ranks read the GGUF
        _write_entry(entry, checkpoint)
    return checkpoint


def _read_entry(entry: Path, path: Path) -> Checkpoint | None:
    try:
        recorded = json.loads((entry / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if recorded.get("identity") != file_identity(path):
        return None
    try:
        folder = open_hf(entry)
    except Exception as exc:  # noqa: BLE001 (damaged since it was written, however it fails: write it again)
        say(f"ladder: the cached conversion of {path.name} is damaged ({str(exc).splitlines()[0]}); converting again")
        shutil.rmtree(entry, ignore_errors=True)
        return None
    config = dataclasses.replace(folder.config, source=recorded["source"])
    return Checkpoint(path, "gguf", config, folder.source, folder.tokenizer)


def _write_entry(entry: Path, checkpoint: Checkpoint) -> None:
    """The checkpoint's weights and tokenizer into `entry`, then its identity file (an entry without one
    is never read). Checked by reading it back: an entry whose config differs is removed."""
    source, config = checkpoint.source, checkpoint.config
    size = 4 * sum(math.prod(source.shape(name)) for name in source.names())
    say(f"ladder: converting {checkpoint.path.name} once into {entry} ({size / 2**20:.0f} MiB; {CACHE_DIR}=off "
        "turns this off); later starts read it from there")
    try:
        save_hf(entry, config, {name: source.get(name) for name in sorted(source.names())}, checkpoint.tokenizer,
                force=True)
        if dataclasses.replace(open_hf(entry).config, source=config.source) != config:
            raise LadderError("its config reads back differently")
        (entry / IDENTITY_FILE).write_text(json.dumps({"identity": file_identity(checkpoint.path),
                                                       "source": config.source}) + "\n")
    except Exception as exc:  # noqa: BLE001 (the cache must never fail a load)
        shutil.rmtree(entry, ignore_errors=True)
        say(f"ladder: not cached ({str(exc).splitlines()[0]}); {checkpoint.path.name} is read as a GGUF each start")

