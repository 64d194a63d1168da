"""`ladder bench`: the paper's throughput protocol over layouts x TP x batch, on real or emulated links.

Protocol (the paper's, gpt-fast style): random weights (or a real checkpoint's, `--model`), one
synthetic prompt repeated over the batch, `gen_len` new tokens with top-k 200 / temperature 0.8,
warm-up runs excluded, devices synchronised before clocks are read,
tokens/s = batch * gen_len / (prefill + decode).

Each configuration runs in its own worker processes (real interconnect: `tp` ranks; emulated: one
process holding rank 0's exact shard, since every rank does the same work) and its result is
appended to the JSON-lines file before the next one starts. `--interleave` measures the layouts of
one configuration in one set of workers, taking turns run by run or step by step, so that a shared
machine's drift hits every layout alike.

Modules, in the order a sweep meets them: `spec` (the points, validated once), `calibrate`
(`--comm-share`), `sweep` (launching and resuming), `worker` (measuring on each rank), `records`
(the results file), `summary` and `plots` (reading results back), `trace` (profiler traces and the
overlap read from them), `linkbench` (`ladder bench link`: timing this machine's all-reduce).
"""
