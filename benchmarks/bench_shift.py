"""Distribution shift: a model's budgets on a world noisier than any in the scenario catalogue.

    .venv/bin/python -m benchmarks shift [--nodes 128] [--days 14] [--seed 171] [--model DIR]
                                         [--keep DIR] [--scenario shifted|far|FILE.toml]

Simulates two worlds of the same size, seed, failure rate (5x) and recovery ratio (0.2) with the real
`foreshock simulate`: the catalogue's random world, and the same with every healthy-fleet nuisance and
collection-noise knob drawn past the end of its catalogue range (scenarios/shifted.toml beside this
file: chronic and burst rates, marginal devices, look-alikes, load swings, jitter, gaps, outages,
reloads, PMA clears; no clean pods; `--scenario far`: scenarios/far.toml, past the ranges of the
wider training world scenarios/wide.toml too). A model's thresholds are chosen on its training history's
validation slice, so a fleet whose healthy nodes are noisier than that history spends more false
evacuations at every threshold: the shipped model raised 479 per 1,000 node-days on the independent
histories of issue 16. This measures how far.

Printed for each world, at the manifest's thresholds for budgets 1, 2 and 5 (false evacuations per
1,000 node-days): recall of precursor failures, median lead, false evacuations, for the model and the
DCGM-style rule, and the fleet-calibrated figures (`foreshock evaluate`'s, calibration.py); for the
shifted world, the signals the model's own explanation names first at each false evacuation at budget
5 (explain.py, the service's explanation), and the nodes that raised most of them. The load average is
printed with the figures. Neither world was seen in training, and neither is evidence about data
nobody here wrote: both come from this project's simulator. Results:
benchmarks/results/predictor-shift-2026-12-05.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import worlds

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
DRIVER_BUDGET = "5.0"


def _drivers(data: Path, model_dir) -> tuple[collections.Counter, collections.Counter, int]:
    """The first-named signal of the model's explanation at the first step of each false evacuation at
    DRIVER_BUDGET, and the false evacuations per node: the episodes and their verdicts are evaluate.py's
    own (`at_threshold` on each node's scores), so they add up to the false evacuations it reports."""
    from foreshock import dataset as ds
    from foreshock.predictor import evaluate as ev
    from foreshock.predictor import explain as ex
    from foreshock.predictor import features as ft
    from foreshock.predictor import labels as lb
    from foreshock.predictor import offline, registry

    model = registry.load_model(model_dir)
    threshold = float(model.manifest["thresholds"][DRIVER_BUDGET])
    reference = ft.full_width(model.manifest.get("reference_features"))
    root = ds.open_dataset_root(str(data))
    incidents = lb.Incidents.from_table(ds.read_table(root, "incidents"))
    first, per_node, episodes = collections.Counter(), collections.Counter(), 0
    with offline.FeatureBuilder(root) as fb:
        fb.pass1()
        for nf in fb:
            ns = ev.score_node(nf, incidents, {"model": model.probability}, model.horizon_seconds)
            got = ev.at_threshold([ns], "model", threshold, incidents, model.horizon_seconds)["episodes"]
            p = ns.scores["model"]
            for start_ns in got["start_ns"][got["false"]]:
                start = int(np.searchsorted(ns.step_end_ns, start_ns))
                episodes += 1
                per_node[nf.node] += 1
                named = ex.explain(model.probability, nf.X[start:start + 1], p[start:start + 1], reference, top=1)[0]
                first[named[0].name if named else "(none worth naming)"] += 1
    return first, per_node, episodes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_shift")
    worlds.add_world_arguments(parser, seed=171, keep_help="write the two worlds here and keep them (reused "
                               "when present)")
    parser.add_argument("--scenario", default="shifted", help="the noisier world: a scenario of "
                        f"{SCENARIOS} by name (shifted, far) or a .toml file (default shifted)")
    args = parser.parse_args(argv)
    scenario = Path(args.scenario) if args.scenario.endswith(".toml") else SCENARIOS / f"{args.scenario}.toml"
    if not scenario.is_file():
        parser.error(f"--scenario {args.scenario}: no scenario file {scenario}")

    from foreshock.predictor import evaluate as ev

    with tempfile.TemporaryDirectory(prefix="bench-shift-") as tmp:
        where = args.keep or Path(tmp)
        for name, world in (("catalogue", None), (scenario.stem, scenario)):
            data = where / f"{name}-{args.seed}-{args.nodes}n-{args.days:g}d"
            if not (data / "table=incidents").exists():
                took = worlds.simulate(data, nodes=args.nodes, days=args.days, seed=args.seed, scenario=world)
                print(f"simulated the {name} world in {took:.0f} s", flush=True)
            t0 = time.perf_counter()
            rep = ev.evaluate_dataset(data, args.model)
            print(f"evaluated in {time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.2f}")
            worlds.print_budgets(f"{name} world (seed {args.seed})", rep)
            if world is not None:
                first, per_node, n = _drivers(data, args.model)
                print(f"  false evacuations at budget {float(DRIVER_BUDGET):g}: {n}; the signal named first: "
                      + ", ".join(f"{k} {v}" for k, v in first.most_common(6)))
                top = per_node.most_common(5)
                print(f"  on {len(per_node)} nodes; the five with most: "
                      + ", ".join(f"{k} {v}" for k, v in top))
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0
