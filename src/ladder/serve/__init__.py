"""`ladder serve`: an OpenAI-compatible server with continuous batching over tensor-parallel ranks.

    api.py        FastAPI app: the OpenAI routes, errors as OpenAI error objects, /health, /metrics
    protocol.py   pydantic request and response models
    scheduler.py  rank 0: requests, KV-cache rows, the step plan, sampling, stop conditions, streaming
    steps.py      every rank: the step plan, broadcast over the process group, and its execution
    metrics.py    Prometheus metrics
    worker.py     one rank's process: rank 0 serves HTTP and schedules, the others follow the plans
"""
