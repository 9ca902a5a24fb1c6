"""Reports of a run record: the text table, JSON, CSV, Markdown (BENCHMARKS.md) and a plot."""
