"""gradient_scope benchmark suite (see benchmarks/README.md)."""
