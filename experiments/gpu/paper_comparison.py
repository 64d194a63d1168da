"""Measured speedups of a 70B-shard sweep beside the paper's Llama-3-70B H100 numbers, as markdown
(the code, also run by tests/test_trace.py: ladder/bench/paper_comparison.py).

Usage: python experiments/gpu/paper_comparison.py RESULTS.jsonl [--compiled COMPILED.jsonl]"""

from ladder.bench.paper_comparison import main

if __name__ == "__main__":
    main()
