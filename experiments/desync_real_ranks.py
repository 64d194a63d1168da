"""A desync model trained with simulated ranks is a real model for its TP degree: its held-out
perplexity from the simulated ranks equals the one `ladder eval --tp 2` measures on two gloo ranks.

    .venv/bin/python experiments/desync_real_ranks.py [--run runs/from_scratch/desync-seed0]

Needs a finished run of experiments/from_scratch.py. Prints both perplexities.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ladder.checkpoint.hf import open_hf
from ladder.comm.base import LocalCommunicator
from ladder.corpora import shakespeare_text
from ladder.evaluate import perplexity
from ladder.model.weights import build_model, load_weights
from ladder.train.checkpoints import checkpoint_dirs
from ladder.train.simulate import SimulatedRanks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="runs/from_scratch/desync-seed0")
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()

    folder = checkpoint_dirs(Path(args.run))[-1]
    checkpoint = open_hf(folder)
    text = Path(tempfile.mkdtemp()) / "heldout.txt"
    text.write_text(shakespeare_text("heldout"))
    ids = checkpoint.tokenizer.encode(text.read_text())[: args.tokens]
    whole = build_model(checkpoint.config, LocalCommunicator(), torch.device("cpu"))
    load_weights(whole, checkpoint.source)
    simulated = perplexity(SimulatedRanks(whole, checkpoint.config.desync_tp).eval(), ids, args.window, progress=False)
    real = subprocess.run([sys.executable, "-m", "ladder", "eval", "--model", str(folder), "--text", str(text),
                           "--tp", str(checkpoint.config.desync_tp), "--max-tokens", str(args.tokens),
                           "--window", str(args.window), "--json"], capture_output=True, text=True, check=True)
    print(f"{folder}: simulated ranks {simulated['perplexity']:.3f}, "
          f"real ranks {json.loads(real.stdout)['perplexity']:.3f} ({simulated['method']})")


if __name__ == "__main__":
    main()
