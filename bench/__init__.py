"""splitserve.bench: benchmarks (engine vs transformers now; serving load generator later)."""
