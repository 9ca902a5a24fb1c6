"""backplan.artifacts: export a compiled step to one verified file and load it back without the
model's source. Sits above the tracer: exporting traces, loading rebuilds traced functions."""
