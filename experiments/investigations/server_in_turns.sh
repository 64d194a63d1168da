#!/usr/bin/env bash
# The server from two checkouts, in turns: `ladder bench serve` on SmolLM2-135M-Instruct (float32) at batch 1
# (8 requests one at a time) and loaded (32 at once, 8 in flight), alternating the two, ROUNDS rounds; then a
# table of the medians. To check that a change to the server is not slower than the commit before it:
#   git worktree add /tmp/before <commit>
#   bash experiments/investigations/server_in_turns.sh /tmp/before . results/serve/in-turns.jsonl 2
# SERVE_FLAGS: more of the server's flags (e.g. "--compile-layers --max-batch 8 --max-model-len 512");
# LOADS: other loads, "name|bench serve's load options" entries separated by ";".
set -euo pipefail
before=$1 after=$2 out=$3 rounds=${4:-2}
python=$(pwd)/.venv/bin/python
serve="--model smollm2-135m-instruct --dtype float32 ${SERVE_FLAGS:-}"
loads=${LOADS:-"batch 1|--num-requests 8 --max-concurrency 1 --request-rates inf;loaded|--num-requests 32 --max-concurrency 8 --request-rates inf"}
for round in $(seq "$rounds"); do
  for tree in "$before" "$after"; do
    commit=$(git -C "$tree" rev-parse --short HEAD)
    IFS=';' read -ra entries <<< "$loads"
    for load in "${entries[@]}"; do
      IFS='|' read -r name options <<< "$load"
      # shellcheck disable=SC2086 # the load's options are words
      PYTHONPATH="$tree/src" "$python" -m ladder bench serve --serve "$serve" $options --seed "$round" \
        --label "$commit, $name" --out "$out"
    done
  done
done
"$python" - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
lines = ["| server, load | rounds | output tok/s | ITL mean ms | ITL p50 | ITL p99 | TTFT p50 ms |", "|---|---|---|---|---|---|---|"]
for label in dict.fromkeys(r["label"] for r in records):
    rs = [r for r in records if r["label"] == label]
    med = lambda f: statistics.median(f(r) for r in rs)
    lines.append(f"| {label} | {len(rs)} | {med(lambda r: r['output_throughput']):.1f} | {med(lambda r: r['itl_ms']['mean']):.1f} | "
                 f"{med(lambda r: r['itl_ms']['p50']):.1f} | {med(lambda r: r['itl_ms']['p99']):.1f} | {med(lambda r: r['ttft_ms']['p50']):.0f} |")
out.with_suffix(".md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
