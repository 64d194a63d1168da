"""The peer a GPU user would pick: Hugging Face transformers' `generate` with its static KV cache, whose
decode step transformers compiles itself (torch.compile, mode "reduce-overhead": CUDA graphs), on random
weights of a ladder preset's shape. One JSON line per batch size, in `ladder bench`'s terms: tokens/s is
batch x new tokens over the whole `generate` call (prefill included), sampled as `ladder bench` samples
(top-k 200, temperature 0.8), every row forced to its full length.

Usage: python experiments/gpu/transformers_peer.py --preset llama-3-8b --batch-sizes 1,16 \
           --prompt-len 1024 --gen-len 512 --out results/gpu/h200/transformers-peer.jsonl
(scripts/gpu_checks.sh runs it beside `ladder bench` in the same call; --device cpu --preset tiny is a dry run.)"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from ladder.bench.records import append_jsonl, environment
from ladder.model.config import ModelConfig, get_preset
from ladder.runtime.step_clock import synchronize


def llama_config(config: ModelConfig) -> LlamaConfig:
    return LlamaConfig(hidden_size=config.dim, num_hidden_layers=config.n_layers,
                       num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
                       intermediate_size=config.ffn_hidden, vocab_size=config.vocab_size,
                       rope_theta=config.rope_theta, rms_norm_eps=config.norm_eps,
                       max_position_embeddings=config.max_seq_len, tie_word_embeddings=config.tie_embeddings)


def generation_config(gen_len: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=True, top_k=200,
                            temperature=0.8, cache_implementation="static", eos_token_id=None, pad_token_id=0)


def timed_generate(model: LlamaForCausalLM, prompt: torch.Tensor, gen: GenerationConfig) -> float:
    synchronize(prompt.device)
    start = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gen)
    synchronize(prompt.device)
    assert out.shape[1] == prompt.shape[1] + gen.max_new_tokens, out.shape
    return time.perf_counter() - start


def measure(model: LlamaForCausalLM, batch: int, args: argparse.Namespace) -> dict:
    device = model.device
    prompt = torch.randint(1, model.config.vocab_size, (batch, args.prompt_len), device=device)
    gen = generation_config(args.gen_len)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(args.warmup):  # the first call compiles and captures the decode step
        timed_generate(model, prompt, gen)
    warmup_s = time.perf_counter() - started
    seconds = [timed_generate(model, prompt, gen) for _ in range(args.runs)]
    tokens_per_s = [batch * args.gen_len / s for s in seconds]
    return {"engine": f"transformers {transformers.__version__} generate, static cache, auto-compiled decode",
            "preset": args.preset, "batch_size": batch, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "dtype": args.dtype, "warmup": args.warmup, "runs": args.runs, "warmup_s": warmup_s,
            "total_s_runs": seconds, "tokens_per_s": statistics.median(tokens_per_s),
            "tokens_per_s_runs": tokens_per_s,
            "decode_compiled": hasattr(model, "_compiled_call"),  # what transformers' get_compiled_call leaves
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "env": environment(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gen-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(llama_config(get_preset(args.preset))).to(getattr(torch, args.dtype)).eval()
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        record = measure(model, batch, args)
        append_jsonl(args.out, record)
        print(f"transformers {args.preset} batch {batch}: {record['tokens_per_s']:.1f} tokens/s "
              f"(warm-up {record['warmup_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
