"""How long `ladder.comm.launch` takes to start workers that do nothing: the first launch (which on CPU
starts the fork server) and the ones after it. Run: .venv/bin/python experiments/investigations/launch_time.py [--nproc 2]"""

import argparse
import time

from ladder.comm.launch import launch


def nothing() -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--launches", type=int, default=4)
    args = parser.parse_args()
    for i in range(args.launches):
        start = time.perf_counter()
        launch(nothing, args.nproc, isolate=True)
        print(f"launch {i + 1} of {args.nproc} worker(s): {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
