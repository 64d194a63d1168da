"""Fit the link presets of the paper's two conditions and the cost model's constants on the paper's
table (batch 1 and 64), and store them with the held-out validation in src/ladder/data
(paper-links.json, costmodel-fit.json). Tests check that the stored numbers are this fit.

Run: .venv/bin/python experiments/costmodel/fit.py"""

import json
from dataclasses import asdict
from pathlib import Path

from ladder.comm.links import link_presets
from ladder.predict.fit import fit_on_paper, score, validate, validate_unseen
from ladder.predict.paper import UNSEEN_SETTINGS, fit_paper_links

DATA = Path(__file__).resolve().parents[2] / "src/ladder/data"


def write_json(path: Path, value: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    tmp.replace(path)


write_json(DATA / "paper-links.json", {name: asdict(link) for name, link in fit_paper_links().items()})
link_presets.cache_clear()  # the constants are fitted on the links just stored
constants = fit_on_paper()
report = validate(constants)
write_json(DATA / "costmodel-fit.json", {"constants": asdict(constants), "validation": report,
                                         "unseen": {name: validate_unseen(setting, constants)
                                                    for name, setting in UNSEEN_SETTINGS.items()}})
print(f"held-out ladder/standard speedup within {report['tolerance']}: {score(report)} "
      f"({report['fraction_within']:.0%}) -> {DATA}")
