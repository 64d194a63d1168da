"""Measured speedups of a 70B-shard sweep beside the paper's Llama-3-70B H100 numbers, as markdown.

Usage: python experiments/gpu/paper_comparison.py RESULTS.jsonl [--compiled COMPILED.jsonl]
(scripts/gpu_checks.sh runs it; the emulated nvlink-h100 link stands for the paper's P2P-on runs,
pcie-no-p2p for NCCL_P2P_DISABLE=1.)"""

import argparse
from pathlib import Path

from ladder.bench.summary import decode_step, format_summary, hidden_fraction, read_results, summarise
from ladder.comm.links import link_presets
from ladder.model.config import get_preset
from ladder.predict.costmodel import GPUS, Workload, fitted_constants, predicted_speedup
from ladder.predict.paper import P2P_LINKS, paper_throughputs

P2P_OF_LINK = {link: p2p for p2p, link in P2P_LINKS.items()}
STEP_DESCRIPTIONS = {"compiled": "torch.compile with CUDA graphs",
                     "CUDA graph": "the eager step captured as one CUDA graph (--cuda-graph)",
                     "compiled layers + CUDA graph": "each layer compiled once for all layers, the step captured "
                                                     "as one CUDA graph (--compile-layers --cuda-graph)",
                     "compiled layers": "each layer compiled once for all layers, the step eager (--compile-layers)",
                     "eager": "eager"}


def paper_speedups() -> dict[tuple[str, str, int, int], float]:
    """(layout, p2p, tp, batch) -> the paper's tokens/s over standard's. Upper bound does not
    communicate and was run once, with P2P on: it serves both conditions."""
    rows = paper_throughputs()
    out = {}
    for (layout, tp, b, p2p), standard in rows.items():
        if layout != "standard":
            continue
        for other in ("standard", "parallel", "ladder", "upper-bound"):
            tps = rows.get((other, tp, b, "on" if other == "upper-bound" else p2p))
            if tps:
                out[(other, p2p, tp, b)] = tps / standard
    return out


def gpu_of(record: dict) -> str | None:
    """The cost model's GPU preset for the card a record ran on (its name as torch reports it)."""
    name = record.get("env", {}).get("device_name", "").lower()
    return next((gpu for gpu in GPUS if gpu in name), None)


def predicted(row: dict, record: dict) -> float | None:
    """`ladder predict`'s speedup for a summary row, on the record's GPU (the H100-fitted constants)."""
    gpu, link = gpu_of(record), link_presets().get(row["interconnect"])
    if gpu is None or link is None or row["layout"] == "desync":
        return None
    workload = Workload(get_preset(row["preset"]), row["tp"], row["batch_size"], record["prompt_len"],
                        record["gen_len"], quantize=record.get("quantize"))
    return predicted_speedup(workload, row["layout"], GPUS[gpu], link, fitted_constants())


def comparison(records: list[dict]) -> str:
    paper = paper_speedups()
    rows = summarise(records)
    first = next((r for r in records if r.get("status") == "ok"), {})
    lines = ["| link | tp | batch | layout | tokens/s | speedup | predicted | paper | hidden | paper hidden |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p2p = P2P_OF_LINK.get(r["interconnect"])
        same_model = r["preset"] == "llama-3-70b"
        published = paper.get((r["layout"], p2p, r["tp"], r["batch_size"])) if p2p and same_model else None
        upper = paper.get(("upper-bound", p2p, r["tp"], r["batch_size"]))
        paper_hidden = None
        if r["layout"] == "ladder" and published and upper:  # times relative to standard's: 1 / speedup
            paper_hidden = hidden_fraction(1.0, 1 / published, 1 / upper)
        fmt = lambda v, spec: format(v, spec) if v is not None else ""
        lines.append(f"| {r['link']} | {r['tp']} | {r['batch_size']} | {r['layout']} | {r['tokens_per_s']:.1f} | "
                     f"{fmt(r['speedup'], '.3f')} | {fmt(predicted(r, first), '.3f')} | {fmt(published, '.3f')} | "
                     f"{fmt(r['hidden'], '.2f')} | "
                     f"{fmt(paper_hidden, '.2f')} |")
    return "\n".join(lines)


def traces(records: list[dict]) -> str:
    """The overlap read back from each configuration's profiler trace; "" when none was profiled."""
    lines = ["| link | batch | layout | link time in trace (ms) | share overlapped by compute | trace |",
             "|---|---|---|---|---|---|"]
    for r in records:
        link = (r.get("trace") or {}).get("link")
        if r.get("status") == "ok" and link:
            lines.append(f"| {r['interconnect']} | {r['batch_size']} | {r['layout']} | {link['link_s'] * 1e3:.2f} | "
                         f"{link['overlap_fraction']:.2f} | {Path(r['trace']['path']).name} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def commits_by_batch(records: list[dict]) -> str:
    """Which commit measured which batch sizes (a file that resumed across sessions holds several)."""
    batches: dict[str, set[int]] = {}
    for r in records:
        batches.setdefault(str(r["env"].get("git_commit")), set()).add(r["batch_size"])
    if len(batches) == 1:
        return next(iter(batches))
    return ", ".join(f"{commit} (batch {', '.join(map(str, sorted(b)))})" for commit, b in batches.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--compiled", help="the TP-1 compiled sweep")
    args = parser.parse_args()
    records = read_results(Path(args.results))
    ok = [r for r in records if r.get("status") == "ok"]
    env = ok[0]["env"] if ok else {}
    preset, tp = (ok[0]["preset"], ok[0]["tp"]) if ok else ("?", "?")
    print(f"# {preset} at TP {tp}, one rank's shard, emulated links\n")
    print(f"Device: {env.get('device_name')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, ladder "
          f"{commits_by_batch(ok)}; {len(ok)} configurations measured, {len(records) - len(ok)} failed.\n")
    if ok:
        step = STEP_DESCRIPTIONS[decode_step(ok[0])]
        print(f"Decode step: {step}; {ok[0]['warmup']} warm-up + {ok[0]['runs']} measured runs of prompt "
              f"{ok[0]['prompt_len']}, {ok[0]['gen_len']} new tokens per configuration, layouts taking turns.\n")
    print("Speedup over standard at equal link and batch, beside the cost model's prediction for this GPU "
          "(`ladder predict`, constants fitted on the paper's H100 runs) and the paper's (H100; nvlink-h100 = P2P on, "
          "pcie-no-p2p = P2P off); hidden = (t_standard - t_ladder) / (t_standard - t_upper_bound).\n")
    print(comparison(records))
    traced = traces(records)
    if traced:  # (the compiled sweep is not profiled)
        print("\n## Profiler traces (a short run per configuration)\n")
        print(traced)
    failed = [r for r in records if r.get("status") != "ok"]
    if failed:
        print("\n## Failed configurations\n")
        for r in failed:
            print(f"- {r['layout']} {r['interconnect']} batch {r['batch_size']}: {r['error']}")
    if args.compiled:
        print("\n## Compiled path at TP 1 (torch.compile, CUDA graphs on GPU)\n")
        print(format_summary(summarise(read_results(Path(args.compiled))), markdown=True))


if __name__ == "__main__":
    main()
