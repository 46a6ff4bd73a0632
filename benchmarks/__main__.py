"""Run every benchmark (or those named): `python -m benchmarks collectors simulator`; the soak (an hour)
runs only when named: `python -m benchmarks soak`."""

from __future__ import annotations

import importlib
import os
import pkgutil
import platform
import sys

import benchmarks


def main(argv: list[str]) -> int:
    names = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(benchmarks.__path__)
                   if m.name.startswith("bench_"))
    # Benchmark names first, then the options for them (`service --probe 3072` or `--probe=3072`).
    rest = list(argv)
    chosen = []
    while rest and not rest[0].startswith("-"):
        chosen.append(rest.pop(0))
    # Those that take an hour (the soak) run only when named.
    chosen = chosen or [n for n in names if getattr(importlib.import_module(f"benchmarks.bench_{n}"), "IN_ALL", True)]
    unknown = set(chosen) - set(names)
    if unknown:
        print(f"unknown benchmarks {sorted(unknown)}; have {names}", file=sys.stderr)
        return 2
    print(f"# machine: {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}")
    status = 0
    for name in chosen:
        print(f"\n## {name}", flush=True)
        module = importlib.import_module(f"benchmarks.bench_{name}")
        status |= int(module.main(rest) or 0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
