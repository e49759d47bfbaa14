"""Observability: what operators scrape and users query (docs/observability.md).

- `identity`: who is writing or consuming now (a context variable the Flight server sets per call).
- `timings`: latency histograms and outcome counts of store operations and Flight verbs (no dependency).
- `lineage`: per row the writer, write time and policy version; per (row, task) the consumer, time and staleness.
- `progress`: per-task production and consumption progress computed from a store's internals at scrape time.
- `metrics`: the Prometheus collector and `/metrics` endpoint (needs `arrowbuf[metrics]`, imported lazily).
- `ui`: the live web inspector (`arrowbuf ui`; stdlib only).

This package's `__init__` imports nothing, so the recording modules can sit below the store internals while
`metrics` and `ui` sit above the Flight server (scripts/check_layers.py places each module).
"""
