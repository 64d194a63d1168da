"""Where the cost model's errors come from, at every point of the paper's Llama-3-70B table: the link
(upper-bound / standard, i.e. how much communication standard pays; and what one decode all-reduce
costs) and the overlap (the fraction of communication ladder hides), published vs predicted with the
stored constants.

The published all-reduce cost is implied by the table: standard's time beyond upper bound's, less the
modelled prefill all-reduces, over the 512 x 160 decode all-reduces; the predicted one is the link's.

Run: .venv/bin/python experiments/costmodel/diagnosis.py"""

from ladder.bench.summary import hidden_fraction
from ladder.comm.links import link_presets
from ladder.model.config import get_preset
from ladder.predict.costmodel import GPUS, Workload, fitted_constants, predict_tokens_per_s
from ladder.predict.paper import P2P_LINKS, paper_throughputs

constants = fitted_constants()
table = paper_throughputs()
ALL_REDUCES_PER_STEP = 160  # 2 per layer of 80

print(f"{'tp':>3}{'batch':>6}{'p2p':>5}  {'upper/standard':>20}  {'decode all-reduce us':>20}  {'ladder/standard':>20}"
      f"  {'hidden':>14}")
print(f"{'':>14}  {'published predicted':>20}  {'published predicted':>20}  {'published predicted':>20}"
      f"  {'pub.  pred.':>14}")
for (layout, tp, b, p2p), standard in sorted(table.items(), key=lambda kv: kv[0][1:]):
    if layout != "standard":
        continue
    upper, ladder = table[("upper-bound", tp, b, "on")], table[("ladder", tp, b, p2p)]
    w = Workload(get_preset("llama-3-70b"), tp, b)
    link = link_presets()[P2P_LINKS[p2p]]
    predicted = {name: predict_tokens_per_s(w, name, GPUS["h100"], link, constants)
                 for name in ("standard", "ladder", "upper-bound")}
    hidden = hidden_fraction(1 / standard, 1 / ladder, 1 / upper)
    hidden_predicted = hidden_fraction(*(1 / predicted[n] for n in ("standard", "ladder", "upper-bound")))
    tokens, message = b * w.gen_len, b * w.config.dim * w.dtype_bytes
    prefill_s = ALL_REDUCES_PER_STEP * link.all_reduce_s(w.prompt_len * message, tp)
    implied_s = (tokens / standard - tokens / upper - prefill_s) / (w.gen_len * ALL_REDUCES_PER_STEP)
    print(f"{tp:>3}{b:>6}{p2p:>5}  {upper / standard:>9.3f} {predicted['upper-bound'] / predicted['standard']:>10.3f}"
          f"  {implied_s * 1e6:>9.1f} {link.all_reduce_s(message, tp) * 1e6:>10.1f}"
          f"  {ladder / standard:>9.3f} {predicted['ladder'] / predicted['standard']:>10.3f}"
          f"  {hidden:>6.2f} {hidden_predicted:>6.2f}")
