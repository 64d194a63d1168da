#!/usr/bin/env bash
# The main job on a fresh machine: set up, then measure what ladder buys on this machine.
#  1. ladder bench: standard / parallel / ladder / upper-bound, batch 1 and 4,
#     a. on the real interconnect: TP 2 as two gloo processes on this machine;
#     b. on an emulated PCIe link without P2P at TP 4: one rank's exact shard computes for real, each
#        all-reduce is a wait of the modelled duration, dilated so that communication takes roughly
#        the share of a step it takes on the GPUs the link was calibrated on (about a quarter at TP 4,
#        batch 1 and 4): 10x at batch 1, 25x at batch 4, since this CPU's compute grows with the batch
#        and a GPU's barely does;
#  2. plots drawn from the results file;
#  3. the cost model's prediction for Llama-3-70B on 8x H100 and its check against the paper.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=${LADDER_RESULTS:-results/cpu}
mkdir -p "$out"
[ -f "$out/bench.jsonl" ] && mv "$out/bench.jsonl" "$out/bench.previous.jsonl"
# This shared CPU drifts by +-10 % over seconds to minutes, so the layouts of a configuration are
# measured together, taking turns step by step (--interleave steps), and again in fresh workers
# (--rounds); the summary pools every run of a layout.
.venv/bin/ladder bench --interconnect real --tp 2 --runs 4 --rounds 2 --interleave steps --out "$out/bench.jsonl" "$@"
.venv/bin/ladder bench --interconnect pcie-no-p2p --link-scale 10 --tp 4 --batch-sizes 1 --runs 5 --rounds 3 \
    --interleave steps --out "$out/bench.jsonl" "$@"
.venv/bin/ladder bench --interconnect pcie-no-p2p --link-scale 25 --tp 4 --batch-sizes 4 --runs 5 --rounds 3 \
    --interleave steps --out "$out/bench.jsonl" "$@"
.venv/bin/ladder bench plot "$out/bench.jsonl"
.venv/bin/ladder predict --preset llama-3-70b --gpu h100 --interconnect nvlink-h100 --tp 8
.venv/bin/ladder predict --validate
