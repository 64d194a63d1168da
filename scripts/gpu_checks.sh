#!/usr/bin/env bash
# The GPU checks of `ladder bench` (for a machine with one NVIDIA GPU and torch with CUDA installed):
#  0. env: the GPU, torch, and the device-to-device copy bandwidth (the roofline the steps are read against);
#  1. small: the compiled path (decode under torch.compile mode="reduce-overhead", i.e. CUDA graphs) for every
#     layout at TP 1, then the same with each layer compiled and the step one CUDA graph
#     (STEP_SMALL_LAYERS, default --compile-layers --cuda-graph): how close step 4's decode step comes
#     to the whole step compiled;
#  2. shard: one rank's exact shard of Llama-3-70B at TP 8 on the emulated nvlink-h100 and pcie-no-p2p links
#     (the all-reduces are sleep kernels on a side stream), the paper's protocol: batch 1/4/16/64,
#     prompt 1024, 512 new tokens, bf16, each decode step one CUDA graph (--cuda-graph: the eager step
#     captured, no compiler; torch.compile of four 80-layer layouts took over 4 minutes a configuration
#     on an H100, more than a time-limited lease can give eight configurations; STEP_70B=--compile for it);
#  3. (with step 2) a profiler trace of a short run of each 70B configuration, and the share of link time during
#     which compute kernels ran, read back from it (ladder: high; standard: near zero);
#  4. shard-compiled: the 70B shard compiled, at COMPILED_BATCHES (default 1,64): each layer compiled once for all 80
#     (--compile-layers: seconds, where compiling the whole step took minutes), the step one CUDA graph
#     (STEP_COMPILED_70B; a CPU dry run gives it --compile-layers alone), its own results file;
#  5. compare: a table comparing the measured speedups with the paper's (results/gpu/comparison.md, and
#     comparison-compiled.md for step 4);
#  6. hybrid: hybrids: the same shard with ladder on its last HYBRID_LAYERS (default 20,40,60 of 80) layers at
#     HYBRID_BATCHES (default 1), against whole standard and upper bound, its pictures in hybrid/ (the
#     paper has no hybrid timings; `ladder predict --ladder-layers` prints the cost model's beside them);
#  7. quantized: quantized weights (torchao: carry its wheel, the GPU image has none): PRESET_SMALL at TP 1, batch 1,
#     bf16 / int8 / int4, compiled (tokens/s and bytes/s against HBM); then the 70B shard's standard,
#     ladder and upper bound at QUANTIZE_BATCHES (default 1) in int8 and int4 on both links, beside step 2's bf16.
#  8. tests: the CUDA-only tests (CUDA-graph decode and server steps equal eager, quantized CUDA kernels);
#  9. peer: Hugging Face transformers' generate with its static cache, compiled, on PRESET_SMALL's shape at
#     SMALL_BATCHES (experiments/gpu/transformers_peer.py), beside step 1's ladder at the same batches;
# 10. server: the server's batch-8 decode step against the engine's (experiments/gpu/server_step.py);
# 11. variants: PRESET_SMALL's TP-1 decode step (COMPILE, default --compile-layers --cuda-graph here) at
#     SMALL_BATCHES once per VARIANTS entry, each alone in a process with one setting of its own, a results file
#     and a trace folder each (variants/NAME.jsonl, traces/variants/NAME), then a table against the first
#     (variants.md: experiments/gpu/decode_variants.py) and each trace's kernels. Entries: sdpa (the default),
#     flex and products (LADDER_DECODE_ATTENTION); through LADDER_INDUCTOR_OPTIONS coordinate-descent (gpt-fast's
#     tuning of each Triton kernel's blocks), autotune-gemm (Triton GEMM templates against cuBLAS, whose batch-1
#     GEMVs end in split-K reductions) and gemv-reductions (batch-1 GEMMs as reductions inductor can fuse);
#     baseline (an earlier package, BASELINE_SRC=its src folder: e.g. 060e950's, which waited for the GPU
#     after every step: `git archive 060e950 src | tar -x -C .gpu-baseline`, carry .gpu-baseline; its records
#     say the checkout's commit).
# STEPS picks and orders them (default: all, in the order 0 env, tests, small, shard, shard-compiled, compare,
# hybrid, quantized, peer, server, then variants); DEADLINE_S (seconds) stops the script's steps in time for
# the caller to copy the results back (a ladder bench stopped by it keeps what it measured; --resume goes on).
# Environment: PYTHON (default python3), RESULTS (default results/gpu), BATCHES, RUNS, WARMUP,
# LAYOUTS_70B to trim the sweep, STEP_70B, PRESET_70B, PRESET_SMALL, TP, PROMPT_LEN, GEN_LEN to swap the
# models, shapes and decode step (a dry run on CPU: DEVICE=cpu COMPILE= STEP_70B= STEP_COMPILED_70B=--compile-layers
# STEP_SMALL_LAYERS=--compile-layers PRESET_SMALL=tiny PRESET_70B=tiny TP=2 BATCHES=1 RUNS=1 PROMPT_LEN=8 GEN_LEN=4
# HYBRID_LAYERS=1,2,3).
# Every sweep runs with --resume, batch size by batch size (batch 1 of both links first): on a machine
# lent in time-limited calls, run it again and it goes on where the previous call was stopped, e.g.
#   RESULTS=.gpu-results bash scripts/gpu_checks.sh; cp -r .gpu-results "$OUT"/   (.gpu-results is ignored by git)
# The layouts of a configuration share one process and its weights and take turns (--interleave).
# What is still unmeasured after the H200 leases and the H100 lease of 2026-11-26 (results/gpu/h200/report.md,
# results/gpu/h100/report.md), in the order a 15-minute lease gets most from (a call of about 8 minutes,
# then one of about 5 on the warm machine). First the decode step's variants against the one measured before
# (carry .gpu-baseline, made as step 11 says, and .whl with torchao for the quantized CUDA tests):
#   STEPS=env,tests,variants VARIANTS=baseline,sdpa,coordinate-descent,flex,autotune-gemm,products RESULTS=.gpu-results \
#     DEADLINE_S=480 COMPILE="--compile-layers --cuda-graph" SMALL_BATCHES=1 RUNS=2 BASELINE_SRC=.gpu-baseline/src \
#     bash scripts/gpu_checks.sh
# then, with the best variant's setting exported, the 70B shard's step on it (the issue's 8.5 ms):
#   STEPS=shard-compiled COMPILED_BATCHES=1 LAYOUTS_70B=standard,ladder,upper-bound DEADLINE_S=300 RUNS=2 ...
# and in later leases what the earlier ones left:
#   STEPS=quantized,hybrid QUANTIZE_BATCHES=1 HYBRID_BATCHES=1,16 STEP_70B="--compile-layers --cuda-graph"
#   (torchao's int8 compile of the 8B took over 100 s), and STEPS=shard-compiled COMPILED_BATCHES=64,16
#   LAYOUTS_70B=standard,parallel,ladder,upper-bound on an H100 (batch 1 and 4 measured there), or
#   COMPILED_BATCHES=1,64 LAYOUTS_70B=parallel on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${RESULTS:-results/gpu}
steps=${STEPS:-env,tests,small,shard,shard-compiled,compare,hybrid,quantized,peer,server,variants}
deadline=$(( SECONDS + ${DEADLINE_S:-1000000} ))
batches=${BATCHES-1,4,16,64}  # (BATCHES= or COMPILED_BATCHES= empty: that step is skipped)
runs=${RUNS:-3}
warmup=${WARMUP:-1}
device=${DEVICE:-cuda}
compile=${COMPILE---compile}
small=${PRESET_SMALL:-llama-3-8b}
small_layouts=${SMALL_LAYOUTS:-standard,parallel,ladder,desync,upper-bound}
small_batches=${SMALL_BATCHES:-1}
peer_batches=${PEER_BATCHES:-1,16}
big=${PRESET_70B:-llama-3-70b}
tp=${TP:-8}
layouts_70b=${LAYOUTS_70B:-standard,parallel,ladder,upper-bound}
step_70b=${STEP_70B---cuda-graph}
compiled_batches=${COMPILED_BATCHES-1,64}
step_small_layers=${STEP_SMALL_LAYERS---compile-layers --cuda-graph}
step_compiled_70b=${STEP_COMPILED_70B---compile-layers --cuda-graph}
hybrid_layers=${HYBRID_LAYERS:-20,40,60}
hybrid_batches=${HYBRID_BATCHES-1}
quantize_batches=${QUANTIZE_BATCHES-1}
variants=${VARIANTS:-sdpa,coordinate-descent,flex,autotune-gemm,products,gemv-reductions}
declare -A variant_setting=([sdpa]="LADDER_DECODE_ATTENTION=sdpa" [flex]="LADDER_DECODE_ATTENTION=flex"
    [products]="LADDER_DECODE_ATTENTION=products" [baseline]="PYTHONPATH=${BASELINE_SRC:-}"
    [coordinate-descent]='LADDER_INDUCTOR_OPTIONS={"coordinate_descent_tuning": true}'
    [autotune-gemm]='LADDER_INDUCTOR_OPTIONS={"max_autotune_gemm": true, "coordinate_descent_tuning": true}'
    [gemv-reductions]='LADDER_INDUCTOR_OPTIONS={"decompose_mem_bound_mm": true, "coordinate_descent_tuning": true}')
prompt=${PROMPT_LEN:-1024}
gen=${GEN_LEN:-512}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
failed=0  # a step that measures nothing (exit 1) is recorded as failed; the others still run
# Runs a command within what is left of DEADLINE_S (SIGTERM at the deadline: ladder bench keeps its records).
within() {
    local left=$(( deadline - SECONDS ))
    if (( left < 10 )); then echo "skipped (deadline): $*"; failed=1; return 0; fi
    timeout --signal=TERM --kill-after=20 "$left" "$@" || failed=1
}
ladder() { within "$PY" -m ladder "$@"; }
common=(--prompt-len "$prompt" --gen-len "$gen" --warmup "$warmup" --runs "$runs" --device "$device" --interleave
        --resume --no-progress)

step_env() {
    "$PY" - <<'PY' | tee "$out/environment.txt" || failed=1
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
if torch.cuda.is_available():  # the roofline: a device-to-device copy, bytes read plus written
    x, y = torch.empty(2**30, dtype=torch.int32, device="cuda"), torch.empty(2**30, dtype=torch.int32, device="cuda")
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    print(f"device-to-device copy: {2 * x.nbytes * 10 / (start.elapsed_time(end) / 1e3) / 1e12:.2f} TB/s")
PY
}
step_tests() {
    within "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_engine.py tests/test_serve_scheduler.py \
        tests/test_quantize.py -k cuda 2>&1 | tee "$out/cuda-tests.log" || failed=1
}
step_small() {  # (an empty COMPILE= runs eager)
    for step in "$compile" ${step_small_layers:+"$step_small_layers"}; do
        local tag=${step//--/}; tag=${tag:-eager}  # each decode step's traces in a folder of their own: the names do not say the step
        ladder bench --preset "$small" --layouts "$small_layouts" --tp 1 --batch-sizes "$small_batches" \
            "${common[@]}" $step --profile "$out/traces/tp1-${tag// /+}" --profile-tokens 4 \
            --out "$out/compiled-tp1.jsonl"
    done
}
# The 70B shard on both links, batch size by batch size: shard_sweep BATCHES "STEP FLAGS" TRACE_DIR RESULTS_FILE
shard_sweep() {
    for batch in ${1//,/ }; do
        ladder bench --preset "$big" --layouts "$layouts_70b" --tp "$tp" --batch-sizes "$batch" \
            --interconnect nvlink-h100,pcie-no-p2p "${common[@]}" $2 --profile "$3" --profile-tokens 4 --out "$4"
    done
}
step_shard() { shard_sweep "$batches" "$step_70b" "$out/traces" "$out/${big}-tp${tp}-shard.jsonl"; }
step_shard_compiled() {
    shard_sweep "$compiled_batches" "$step_compiled_70b" "$out/traces/compiled" "$out/${big}-tp${tp}-shard-compiled.jsonl"
}
step_compare() {
    local small_records=()
    [[ -f "$out/compiled-tp1.jsonl" ]] && small_records=(--compiled "$out/compiled-tp1.jsonl")
    if [[ -f "$out/${big}-tp${tp}-shard.jsonl" ]]; then
        ladder bench plot "$out/${big}-tp${tp}-shard.jsonl"
        "$PY" experiments/gpu/paper_comparison.py "$out/${big}-tp${tp}-shard.jsonl" "${small_records[@]}" \
            | tee "$out/comparison.md" || failed=1
    fi
    if [[ -f "$out/${big}-tp${tp}-shard-compiled.jsonl" ]]; then
        "$PY" experiments/gpu/paper_comparison.py "$out/${big}-tp${tp}-shard-compiled.jsonl" "${small_records[@]}" \
            | tee "$out/comparison-compiled.md" || failed=1
    fi
}
step_hybrid() {
    for batch in ${hybrid_batches//,/ }; do
        ladder bench --preset "$big" --layouts standard,ladder,upper-bound --ladder-layers "$hybrid_layers" --tp "$tp" \
            --batch-sizes "$batch" --interconnect nvlink-h100,pcie-no-p2p "${common[@]}" $step_70b \
            --out "$out/hybrid/${big}-tp${tp}-shard-hybrid.jsonl"
    done
    if [[ -f "$out/hybrid/${big}-tp${tp}-shard-hybrid.jsonl" ]]; then
        ladder bench plot "$out/hybrid/${big}-tp${tp}-shard-hybrid.jsonl"
        if [[ "$big" == llama-3-70b ]]; then  # the cost model knows the GPU presets' shapes, not a dry run's
            ladder predict --preset "$big" --interconnect nvlink-h100,pcie-no-p2p --tp "$tp" \
                --batch-sizes "$hybrid_batches" --layouts standard,ladder,upper-bound --ladder-layers "$hybrid_layers" \
                --prompt-len "$prompt" --gen-len "$gen" | tee "$out/hybrid/predicted.txt"
        fi
    fi
}
step_quantized() {
    if ! "$PY" -c "import torchao" 2>/dev/null; then
        echo "quantized skipped: no torchao here (carry its wheel: docs/quantization.md)"; return 0
    fi
    for mode in none int8 int4; do
        local quantized=(); [[ "$mode" == none ]] || quantized=(--quantize "$mode")
        ladder bench --preset "$small" --layouts standard --tp 1 --batch-sizes 1 "${common[@]}" $compile \
            "${quantized[@]}" --out "$out/quantized/${small}-tp1.jsonl"
    done
    for batch in ${quantize_batches//,/ }; do
        for mode in int8 int4; do
            ladder bench --preset "$big" --layouts standard,ladder,upper-bound --tp "$tp" --batch-sizes "$batch" \
                --interconnect nvlink-h100,pcie-no-p2p "${common[@]}" $step_70b --quantize "$mode" \
                --out "$out/quantized/${big}-tp${tp}-shard.jsonl"
        done
    done
}
step_peer() {
    within "$PY" experiments/gpu/transformers_peer.py --preset "$small" --batch-sizes "$peer_batches" \
        --prompt-len "$prompt" --gen-len "$gen" --warmup "$warmup" --runs "$runs" --device "$device" \
        --out "$out/transformers-peer.jsonl"
}
step_server() {
    within "$PY" experiments/gpu/server_step.py --preset "$small" --batch 8 --position "$prompt" --device "$device" \
        ${SERVER_STEP:+--step "$SERVER_STEP"} --out "$out/server-step.jsonl"
}
step_variants() {
    local files=()
    for name in ${variants//,/ }; do
        if [[ -z "${variant_setting[$name]+set}" ]]; then echo "unknown variant $name"; failed=1; continue; fi
        if [[ "$name" == baseline && -z "${BASELINE_SRC:-}" ]]; then echo "baseline skipped: no BASELINE_SRC"; continue; fi
        within env "${variant_setting[$name]}" "$PY" -m ladder bench --preset "$small" --layouts standard --tp 1 \
            --batch-sizes "$small_batches" "${common[@]}" $compile --profile "$out/traces/variants/$name" \
            --profile-tokens 4 --out "$out/variants/$name.jsonl"
        [[ -f "$out/variants/$name.jsonl" ]] && files+=("$out/variants/$name.jsonl")
    done
    (( ${#files[@]} )) || return 0
    local copy; copy=$(grep -oE 'copy: [0-9.]+' "$out/environment.txt" 2>/dev/null | grep -oE '[0-9.]+$' || true)
    { "$PY" experiments/gpu/decode_variants.py "${files[@]}" ${copy:+--copy-tbps "$copy"}
      if [[ "$device" == cuda ]]; then
          echo; "$PY" experiments/investigations/decode_step_kernels.py "$out"/traces/variants/*/*.json*
      fi; } | tee "$out/variants.md" || failed=1
}

for name in ${steps//,/ }; do
    echo "== step $name ($(( SECONDS / 60 )) min $(( SECONDS % 60 )) s in)"
    "step_${name//-/_}"
done
exit $failed
