#!/usr/bin/env bash
# The main job on a fresh machine: set up, then measure what ladder buys on this machine.
#  1. ladder bench: standard / parallel / ladder / upper-bound at TP 2, batch 1 and 4, on the real
#     interconnect (two gloo processes) and on an emulated PCIe link without P2P (one rank's exact
#     shard; the link dilated 10x so that communication takes the share of a step it takes on
#     the GPUs the link was calibrated on);
#  2. plots drawn from the results file;
#  3. the cost model's prediction for Llama-3-70B on 8x H100 and its check against the paper.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=${LADDER_RESULTS:-results/cpu}
mkdir -p "$out"
[ -f "$out/bench.jsonl" ] && mv "$out/bench.jsonl" "$out/bench.previous.jsonl"
.venv/bin/ladder bench --interconnect real,pcie-no-p2p --link-scale 10 --out "$out/bench.jsonl" "$@"
.venv/bin/ladder bench plot "$out/bench.jsonl"
.venv/bin/ladder predict --preset llama-3-70b --gpu h100 --interconnect nvlink-h100 --tp 8
.venv/bin/ladder predict --validate
