"""A harsher check of the cost model than `ladder predict --validate`: leave one (TP, batch) cell of the
paper's Llama-3-70B table out at a time, refit everything on the other cells (the two link presets and
the model's constants, exactly as the stored fit is made on batch 1 and 64), and predict the left-out
cell's ladder/standard speedup with P2P on and off. Every point is held out once, the table's ends
(batch 1 and 64) included, where the stored split only interpolates. About 15 s on 2 cores.

Run: .venv/bin/python experiments/costmodel/crossval.py"""

from dataclasses import asdict

from ladder.comm.links import fit_link
from ladder.model.config import get_preset
from ladder.predict.costmodel import GPUS, CostConstants, Workload, predicted_speedup
from ladder.predict.fit import fit_constants
from ladder.predict.paper import P2P_LINKS, paper_measurements, paper_table, paper_throughputs

TOLERANCE = 0.05
rows, published = paper_table(), paper_throughputs()
cells = sorted({(r["tp"], r["batch_size"]) for r in rows})
print(f"{'tp':>3}{'batch':>6}{'p2p':>5}  published  predicted   error")
within = 0
for cell in cells:
    others = lambda tp, batch: (tp, batch) != cell
    links = {name: fit_link(name, paper_measurements(p2p, calibrates=others), "cross-validation fold")
             for p2p, name in P2P_LINKS.items()}
    constants = fit_constants([r for r in rows if others(r["tp"], r["batch_size"])], asdict(CostConstants()),
                              link_of=links.__getitem__)
    for p2p, name in P2P_LINKS.items():
        tp, batch = cell
        speedup = published[("ladder", tp, batch, p2p)] / published[("standard", tp, batch, p2p)]
        predicted = predicted_speedup(Workload(get_preset("llama-3-70b"), tp, batch), "ladder", GPUS["h100"],
                                      links[name], constants)
        error = predicted - speedup
        within += abs(error) <= TOLERANCE
        print(f"{tp:>3}{batch:>6}{p2p:>5}  {speedup:>9.3f}  {predicted:>9.3f}  {error:+.3f}"
              f"{'' if abs(error) <= TOLERANCE else '  *'}", flush=True)
total = 2 * len(cells)
print(f"{within}/{total} within {TOLERANCE} of the published ladder/standard speedup ({within / total:.0%}), "
      "each predicted by a fit that never saw its cell")
