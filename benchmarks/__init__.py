"""Foreshock benchmarks: `python -m benchmarks [NAME ...]` (or `make bench`) runs them and prints figures.

Each module benchmarks/bench_<name>.py has `main(argv) -> int`. Figures are printed, never asserted:
targets are checked by reading them, not by timed tests.
"""
