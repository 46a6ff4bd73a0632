"""`foreshock simulate`: write a simulated cluster's telemetry and incident log as a schema-v1 dataset.

Settings resolve through foreshock.config ([simulate] in the TOML file < FORESHOCK_SIMULATE_* < flags);
`--scenario FILE` is a TOML file whose [simulate] table is read the same way (it wins over --config);
its [simulate.knobs] table sets single knobs of the scenario catalogue (simulator/scenarios.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULTS = {
    "nodes": 64, "days": 1.0, "interval": 60.0, "seed": 0, "out": "sim-data", "start": "2026-01-05T00:00:00Z",
    "gpus_per_node": 8, "hcas_per_node": 8, "nodes_per_leaf": 16, "leaves_per_spine": 8, "sites": 1,
    "nvlink_domain_nodes": 0, "job_nodes": 32, "spare_fraction": 0.05, "link_layer": "InfiniBand",
    "rate_scale": 1.0, "difficulty": 1.0, "recovery_ratio": 1.0, "lead_scale": 1.0, "block_nodes": 32, "workers": 0,
    "world": "clean", "executor": "local", "ray_address": "",
}


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate a fault-injecting GPU cluster into a Parquet dataset",
                              description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, help="nodes in the cluster (default 64)")
    p.add_argument("--days", type=float, help="simulated days (default 1)")
    p.add_argument("--interval", type=float, help="seconds between samples (default 60)")
    p.add_argument("--seed", type=int, help="random seed; the same seed gives the same data (default 0)")
    p.add_argument("--out", help="dataset directory (default sim-data)")
    p.add_argument("--start", help="first sample time, ISO 8601 UTC (default 2026-01-05T00:00:00Z)")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--hcas-per-node", type=int)
    p.add_argument("--nodes-per-leaf", type=int)
    p.add_argument("--leaves-per-spine", type=int)
    p.add_argument("--sites", type=int, help="sites joined by scale-across links (default 1)")
    p.add_argument("--nvlink-domain-nodes", type=int, help="nodes per multi-node NVLink domain: 18 with --gpus-per-node 4 for GB200 NVL72 racks (default 0: NVLink inside the node)")
    p.add_argument("--job-nodes", type=int, help="nodes per training job (default 32)")
    p.add_argument("--spare-fraction", type=float, help="share of idle spare nodes (default 0.05)")
    p.add_argument("--link-layer", choices=["InfiniBand", "Ethernet"], help="RDMA fabric (Ethernet = RoCE)")
    p.add_argument("--rate-scale", type=float, help="multiplies every failure rate (default 1: Llama 3's 3.8/1,000 node-days)")
    p.add_argument("--difficulty", type=float, help="precursor weakness, benign noise and recoveries (default 1)")
    p.add_argument("--recovery-ratio", type=float, help="degrade-then-recover episodes per precursor failure (default 1)")
    p.add_argument("--lead-scale", type=float, help="multiplies precursor lead times (default 1)")
    p.add_argument("--block-nodes", type=int, help="nodes generated together (memory vs speed, default 32)")
    p.add_argument("--workers", type=int, help="worker processes (default 0: one per CPU); the data do not depend on it")
    p.add_argument("--world", choices=["clean", "random"],
                   help="clean (default): one tidy world; random: every knob of the scenario catalogue drawn per "
                        "pod (leaf) from the seed, so one dataset holds many worlds")
    p.add_argument("--executor", choices=("local", "ray"),
                   help="where the node blocks are simulated: local (the process pool, the default) or ray (a Ray "
                        "task per block); the data do not depend on it")
    p.add_argument("--ray-address", dest="ray_address", metavar="HOST:PORT",
                   help="with --executor ray: the Ray head to join (default: a local Ray instance)")
    p.add_argument("--scenario", metavar="FILE", help="TOML scenario file with a [simulate] table "
                   "(and [simulate.knobs] for single knobs)")
    p.set_defaults(run=run)


def settings_from(args, file_data) -> dict:
    from foreshock.config import ConfigError, load_file, resolve

    data = dict(file_data or {})
    if getattr(args, "scenario", None):
        scenario = load_file(args.scenario)
        if "simulate" not in scenario:
            raise ConfigError(f"scenario file {args.scenario} has no [simulate] table")
        data = {**data, "simulate": {**data.get("simulate", {}), **scenario["simulate"]}}
    section = dict(data.get("simulate", {}))
    knobs = section.pop("knobs", {})
    if not isinstance(knobs, dict):
        raise ConfigError("[simulate] knobs must be a table ([simulate.knobs])")
    flags = {k: getattr(args, k, None) for k in DEFAULTS}
    cfg = resolve("simulate", DEFAULTS, file_data={**data, "simulate": section}, flags=flags)
    cfg["knobs"] = knobs
    return cfg


def build(cfg: dict):
    from foreshock.simulator.batch import SimSettings, parse_start
    from foreshock.simulator.faults import FaultSettings
    from foreshock.simulator.scenarios import World
    from foreshock.simulator.topology import Topology

    topo = Topology(nodes=cfg["nodes"], gpus_per_node=cfg["gpus_per_node"], hcas_per_node=cfg["hcas_per_node"],
                    nodes_per_leaf=cfg["nodes_per_leaf"], leaves_per_spine=cfg["leaves_per_spine"],
                    sites=cfg["sites"], nvlink_domain_nodes=cfg["nvlink_domain_nodes"], job_nodes=cfg["job_nodes"],
                    spare_fraction=cfg["spare_fraction"], link_layer=cfg["link_layer"])
    faults = FaultSettings(rate_scale=cfg["rate_scale"], difficulty=cfg["difficulty"],
                           recovery_ratio=cfg["recovery_ratio"], lead_scale=cfg["lead_scale"])
    if cfg["rate_scale"] < 0 or cfg["difficulty"] <= 0 or cfg["recovery_ratio"] < 0 or cfg["lead_scale"] <= 0:
        raise ValueError("rate_scale and recovery_ratio must be >= 0, difficulty and lead_scale > 0")
    settings = SimSettings(topology=topo, days=cfg["days"], interval_s=cfg["interval"], seed=cfg["seed"],
                           start_ns=parse_start(cfg["start"]), faults=faults, block_nodes=cfg["block_nodes"],
                           world=cfg["world"], knobs=dict(cfg.get("knobs", {})))
    World(settings.world, seed=settings.seed, n_pods=topo.n_leaves, knobs=settings.knobs)  # checks the knobs
    return settings


def run(args, file_data) -> int:
    from foreshock.simulator import batch
    from foreshock.simulator.topology import TopologyError

    cfg = settings_from(args, file_data)
    try:
        settings = build(cfg)
    except (TopologyError, ValueError) as exc:
        print(f"foreshock simulate: {exc}", file=sys.stderr)
        return 2
    out = Path(cfg["out"])
    if out.exists() and (not out.is_dir() or any(out.glob("table=*"))):
        print(f"foreshock simulate: {out} already holds a dataset (or is not a directory); "
              f"choose an empty --out so two simulations never mix", file=sys.stderr)
        return 2
    if cfg["workers"] < 0:
        print(f"foreshock simulate: workers must be >= 0, got {cfg['workers']}", file=sys.stderr)
        return 2
    if cfg["executor"] not in ("local", "ray"):
        print(f"foreshock simulate: executor must be local or ray, got {cfg['executor']!r}", file=sys.stderr)
        return 2
    try:   # an --out that cannot be made fails now, not after the simulation
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"foreshock simulate: --out {out}: cannot create it ({exc.strerror})", file=sys.stderr)
        return 2
    if not os.access(out, os.W_OK):
        print(f"foreshock simulate: --out {out}: not writable", file=sys.stderr)
        return 2
    topo = settings.topology
    print(f"simulating {topo.nodes} nodes x {topo.gpus_per_node} GPUs x {topo.hcas_per_node} HCAs, "
          f"{settings.days:g} days at {settings.interval_s:g} s, seed {settings.seed}, {settings.world} world "
          f"-> {cfg['out']}", flush=True)

    from foreshock.predictor import executors

    try:
        summary = batch.run(settings, out, progress=batch.print_progress if settings.days >= 2 else None,
                            workers=cfg["workers"], executor=cfg["executor"], ray_address=cfg["ray_address"] or None)
    except executors.ExecutorError as exc:
        print(f"foreshock simulate: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:    # a node block that kept failing on Ray, named
        print(f"foreshock simulate: {exc}", file=sys.stderr)
        return 1
    for line in summary.lines():
        print(line)
    if not summary.incidents:
        print(f"foreshock simulate: no incident in {topo.nodes} nodes x {settings.days:g} days: nothing to train "
              f"on (`foreshock train` needs incidents); simulate more nodes or days, or a higher --rate-scale",
              file=sys.stderr)
    return 0
