"""Fit the cost model on the paper's table (batch 1 and 64) and store the constants and the
held-out validation in src/ladder/data/costmodel-fit.json. Run: .venv/bin/python scripts/fit_costmodel.py"""

import json
from dataclasses import asdict
from pathlib import Path

from ladder.costmodel import UNSEEN_SETTINGS, fit_on_paper, score, validate, validate_unseen

constants = fit_on_paper()
report = validate(constants)
out = Path(__file__).resolve().parent.parent / "src/ladder/data/costmodel-fit.json"
tmp = out.with_suffix(".tmp")
tmp.write_text(json.dumps({"constants": asdict(constants), "validation": report,
                           "unseen": {name: validate_unseen(setting, constants)
                                      for name, setting in UNSEEN_SETTINGS.items()}}, indent=2) + "\n")
tmp.replace(out)
print(f"held-out ladder/standard speedup within {report['tolerance']}: {score(report)} "
      f"({report['fraction_within']:.0%}) -> {out}")
