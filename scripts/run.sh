#!/usr/bin/env bash
# The main job on a fresh machine: set up, then measure what ladder buys on this machine.
#  1. ladder bench: standard / parallel / ladder / upper-bound, batch 1 and 4,
#     a. on the real interconnect: TP 2 as two gloo processes on this machine;
#     b. on an emulated PCIe link without P2P at TP 4: one rank's exact shard computes for real, each
#        all-reduce is a wait of the modelled duration, dilated so that communication takes the share
#        of standard's step it takes on the GPUs the link was calibrated on: a quarter at TP 4 (the
#        paper's 70B, P2P off: upper bound / standard = 1.29 at batch 1, 1.35 at batch 4, i.e. 23 % and
#        26 %). --comm-share measures this machine's step first, so the ratio holds however fast the
#        CPU is that day (a fixed --link-scale of 10 / 25 gave 23-24 % one day and 32 % the next);
#  2. plots drawn from the results file;
#  3. the cost model's prediction for Llama-3-70B on 8x H100, with NVLink and with P2P off, and its check
#     against the paper.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Each run writes a folder of its own under runs/ (git-ignored); results/cpu/ keeps the canonical run.
out=${LADDER_RESULTS:-runs/main/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
# This shared CPU drifts by +-10 % over seconds to minutes, so the layouts of a configuration are
# measured together, taking turns step by step (--interleave steps), and again in fresh workers
# (--rounds); the summary pools every run of a layout.
.venv/bin/ladder bench --interconnect real --tp 2 --runs 4 --rounds 2 --interleave steps --out "$out/bench.jsonl" "$@"
.venv/bin/ladder bench --interconnect pcie-no-p2p --comm-share 0.25 --tp 4 --batch-sizes 1,4 --runs 5 --rounds 3 \
    --interleave steps --out "$out/bench.jsonl" "$@"
.venv/bin/ladder bench plot "$out/bench.jsonl"
.venv/bin/ladder predict --preset llama-3-70b --gpu h100 --interconnect nvlink-h100,pcie-no-p2p --tp 8
.venv/bin/ladder predict --validate
