#!/usr/bin/env bash
# The GPU checks of `ladder bench` (for a machine with one NVIDIA GPU and torch with CUDA installed):
#  1. the compiled path (decode under torch.compile mode="reduce-overhead", i.e. CUDA graphs) for every
#     layout at TP 1, then the same with each layer compiled and the step one CUDA graph
#     (STEP_SMALL_LAYERS, default --compile-layers --cuda-graph): how close step 4's decode step comes
#     to the whole step compiled;
#  2. one rank's exact shard of Llama-3-70B at TP 8 on the emulated nvlink-h100 and pcie-no-p2p links
#     (the all-reduces are sleep kernels on a side stream), the paper's protocol: batch 1/4/16/64,
#     prompt 1024, 512 new tokens, bf16, each decode step one CUDA graph (--cuda-graph: the eager step
#     captured, no compiler; torch.compile of four 80-layer layouts took over 4 minutes a configuration
#     on an H100, more than a time-limited lease can give eight configurations; STEP_70B=--compile for it);
#  3. a profiler trace of a short run of each 70B configuration, and the share of link time during
#     which compute kernels ran, read back from it (ladder: high; standard: near zero);
#  4. the 70B shard compiled, at COMPILED_BATCHES (default 1,64): each layer compiled once for all 80
#     (--compile-layers: seconds, where compiling the whole step took minutes), the step one CUDA graph
#     (STEP_COMPILED_70B; a CPU dry run gives it --compile-layers alone), its own results file;
#  5. a table comparing the measured speedups with the paper's (results/gpu/comparison.md, and
#     comparison-compiled.md for step 4);
#  6. hybrids: the same shard with ladder on its last HYBRID_LAYERS (default 20,40,60 of 80) layers at
#     HYBRID_BATCHES (default 1), against whole standard and upper bound, its pictures in hybrid/ (the
#     paper has no hybrid timings; `ladder predict --ladder-layers` prints the cost model's beside them);
#  7. quantized weights (torchao: carry its wheel, the GPU image has none): PRESET_SMALL at TP 1, batch 1,
#     bf16 / int8 / int4, compiled (tokens/s and bytes/s against HBM); then the 70B shard's standard,
#     ladder and upper bound at QUANTIZE_BATCHES (default 1) in int8 and int4 on both links, beside step 2's bf16.
# Environment: PYTHON (default python3), RESULTS (default results/gpu), BATCHES, RUNS, WARMUP,
# LAYOUTS_70B to trim the sweep, STEP_70B, PRESET_70B, PRESET_SMALL, TP, PROMPT_LEN, GEN_LEN to swap the
# models, shapes and decode step (a dry run on CPU: DEVICE=cpu COMPILE= STEP_70B= STEP_COMPILED_70B=--compile-layers
# STEP_SMALL_LAYERS=--compile-layers PRESET_SMALL=tiny PRESET_70B=tiny TP=2 BATCHES=1 RUNS=1 PROMPT_LEN=8 GEN_LEN=4
# HYBRID_LAYERS=1,2,3).
# Every sweep runs with --resume, batch size by batch size (batch 1 of both links first): on a machine
# lent in time-limited calls, run it again and it goes on where the previous call was stopped, e.g.
#   RESULTS=.gpu-results bash scripts/gpu_checks.sh; cp -r .gpu-results "$OUT"/   (.gpu-results is ignored by git)
# The layouts of a configuration share one process and its weights and take turns (--interleave).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${RESULTS:-results/gpu}
batches=${BATCHES-1,4,16,64}  # (BATCHES= or COMPILED_BATCHES= empty: that step is skipped)
runs=${RUNS:-3}
warmup=${WARMUP:-1}
device=${DEVICE:-cuda}
compile=${COMPILE---compile}
small=${PRESET_SMALL:-llama-3-8b}
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
prompt=${PROMPT_LEN:-1024}
gen=${GEN_LEN:-512}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
ladder() { "$PY" -m ladder.cli "$@"; }
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee "$out/environment.txt"

for step in "$compile" ${step_small_layers:+"$step_small_layers"}; do  # (an empty COMPILE= runs eager)
    ladder bench --preset "$small" --layouts standard,parallel,ladder,desync,upper-bound --tp 1 --batch-sizes 1 \
        --prompt-len "$prompt" --gen-len "$gen" --warmup "$warmup" --runs "$runs" --device "$device" $step \
        --interleave --resume --no-progress --out "$out/compiled-tp1.jsonl"
done
failed=0  # a batch size that measures nothing (exit 1) is recorded as failed; the others still run
for batch in ${batches//,/ }; do
    ladder bench --preset "$big" --layouts "$layouts_70b" --tp "$tp" --batch-sizes "$batch" \
        --interconnect nvlink-h100,pcie-no-p2p --prompt-len "$prompt" --gen-len "$gen" --warmup "$warmup" \
        --runs "$runs" --device "$device" $step_70b --profile "$out/traces" --profile-tokens 4 --interleave \
        --resume --no-progress --out "$out/${big}-tp${tp}-shard.jsonl" || failed=1
done
for batch in ${compiled_batches//,/ }; do
    ladder bench --preset "$big" --layouts "$layouts_70b" --tp "$tp" --batch-sizes "$batch" \
        --interconnect nvlink-h100,pcie-no-p2p --prompt-len "$prompt" --gen-len "$gen" --warmup "$warmup" \
        --runs "$runs" --device "$device" $step_compiled_70b --interleave --resume --no-progress \
        --out "$out/${big}-tp${tp}-shard-compiled.jsonl" || failed=1
done
if [[ -f "$out/${big}-tp${tp}-shard.jsonl" ]]; then
    ladder bench plot "$out/${big}-tp${tp}-shard.jsonl"
    "$PY" experiments/gpu/paper_comparison.py "$out/${big}-tp${tp}-shard.jsonl" --compiled "$out/compiled-tp1.jsonl" \
        | tee "$out/comparison.md"
fi
if [[ -f "$out/${big}-tp${tp}-shard-compiled.jsonl" ]]; then
    "$PY" experiments/gpu/paper_comparison.py "$out/${big}-tp${tp}-shard-compiled.jsonl" | tee "$out/comparison-compiled.md"
fi
for batch in ${hybrid_batches//,/ }; do
    ladder bench --preset "$big" --layouts standard,ladder,upper-bound --ladder-layers "$hybrid_layers" --tp "$tp" \
        --batch-sizes "$batch" --interconnect nvlink-h100,pcie-no-p2p --prompt-len "$prompt" --gen-len "$gen" \
        --warmup "$warmup" --runs "$runs" --device "$device" $step_70b --interleave --resume --no-progress \
        --out "$out/hybrid/${big}-tp${tp}-shard-hybrid.jsonl" || failed=1
done
if [[ -f "$out/hybrid/${big}-tp${tp}-shard-hybrid.jsonl" ]]; then
    ladder bench plot "$out/hybrid/${big}-tp${tp}-shard-hybrid.jsonl"
    if [[ "$big" == llama-3-70b ]]; then  # the cost model knows the GPU presets' shapes, not a dry run's
        ladder predict --preset "$big" --interconnect nvlink-h100,pcie-no-p2p --tp "$tp" --batch-sizes "$hybrid_batches" \
            --layouts standard,ladder,upper-bound --ladder-layers "$hybrid_layers" --prompt-len "$prompt" \
            --gen-len "$gen" | tee "$out/hybrid/predicted.txt"
    fi
fi
if "$PY" -c "import torchao" 2>/dev/null; then
    for mode in none int8 int4; do
        quantized=(); [[ "$mode" == none ]] || quantized=(--quantize "$mode")
        ladder bench --preset "$small" --layouts standard --tp 1 --batch-sizes 1 --prompt-len "$prompt" --gen-len "$gen" \
            --warmup "$warmup" --runs "$runs" --device "$device" $compile "${quantized[@]}" --resume --no-progress \
            --out "$out/quantized/${small}-tp1.jsonl" || failed=1
    done
    for batch in ${quantize_batches//,/ }; do
        for mode in int8 int4; do
            ladder bench --preset "$big" --layouts standard,ladder,upper-bound --tp "$tp" --batch-sizes "$batch" \
                --interconnect nvlink-h100,pcie-no-p2p --prompt-len "$prompt" --gen-len "$gen" --warmup "$warmup" \
                --runs "$runs" --device "$device" $step_70b --quantize "$mode" --interleave --resume --no-progress \
                --out "$out/quantized/${big}-tp${tp}-shard.jsonl" || failed=1
        done
    done
else
    echo "step 7 skipped: no torchao here (carry its wheel: docs/quantization.md)"
fi
exit $failed
