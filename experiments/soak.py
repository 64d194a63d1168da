"""Soak and faults against `ladder serve` (the code, also run by tests/test_soak.py: ladder/bench/soak.py).

    .venv/bin/python experiments/soak.py [--requests 3000] [--tps 1,2] [--short]
    .venv/bin/python experiments/soak.py --memory-curve --requests 6000 --tps 1   (docs/serving.md's curves)
"""

from ladder.bench.soak import main

if __name__ == "__main__":
    main()
