"""The live cluster: the simulated cluster stepping in real time, sampled node by node by the collectors.

`LiveCluster` runs the same ClusterModel as the batch simulator (no second physics). Sample times are
the caller's clock (the collector's `ts_ns`), and counters grow at their real per-second rates, so a
collector, the service and the predictor see ordinary telemetry. What is accelerated is the fault
process: failure rates are multiplied by `speed` and precursor lead times and repair times divided by
it, so at speed 60 an HBM precursor of 8 hours plays out in 8 minutes and the demo sees faults develop.

Each node is handed out as an object with the node-model protocol of foreshock.collectors.simulated:
`node: str` and `sample(ts_ns) -> dict[str, pyarrow.Table]` (schema-v1 tables keyed by table name), so
the real collector code runs on simulated nodes. Faults can be injected on command
(`cluster.inject("node-017", "ib_cable", component=3, lead_seconds=120)`: "degrade node-17's HCA 3 now,
it fails in two minutes"), and the ground truth read back with `incidents()` and `ground_truth()`.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from foreshock.simulator.batch import incidents_table
from foreshock.simulator.faults import MODES, NS, Episode, FaultSettings, injected, schedule
from foreshock.simulator.model import ClusterModel
from foreshock.simulator.topology import Topology, TopologyError

# Friendly names for inject(): what an operator says -> the failure mode.
MODE_ALIASES = {"hca": "ib_cable", "cable": "ib_cable", "link": "ib_cable", "gpu": "gpu_off_bus_pcie",
                "memory": "hbm", "switch": "leaf_switch", "slow": "straggler", "gsp": "gsp"}


class SimulatedNode:
    """One node of a LiveCluster, in the collectors' node-model protocol."""

    def __init__(self, cluster: "LiveCluster", index: int):
        self._cluster = cluster
        self.index = index
        self.node = cluster.topology.names[index]
        self.gpus = cluster.topology.gpus_per_node
        self.hcas = cluster.topology.hcas_per_node

    def sample(self, ts_ns: int) -> dict[str, pa.Table]:
        """The node's schema-v1 tables at ts_ns (counters advanced from the previous sample)."""
        return self._cluster._sample([self.index], int(ts_ns))

    def __repr__(self) -> str:
        return f"SimulatedNode({self.node!r})"


class LiveCluster:
    def __init__(self, topology: Topology | None = None, *, seed: int = 0, speed: float = 60.0,
                 rate_scale: float = 1.0, difficulty: float = 1.0, recovery_ratio: float = 1.0,
                 horizon_s: float = 86400.0, start_ns: int | None = None, interval_s: float = 1.0):
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.topology = topology or Topology(nodes=16)
        self.speed = float(speed)
        self.start_ns = time.time_ns() if start_ns is None else int(start_ns)
        self._lock = threading.Lock()
        faults = FaultSettings(rate_scale=rate_scale, difficulty=difficulty, recovery_ratio=recovery_ratio,
                               time_compression=self.speed)
        episodes = schedule(self.topology, self.start_ns, self.start_ns + int(horizon_s * NS), seed, faults) \
            if rate_scale > 0 else []
        self.model = ClusterModel(self.topology, seed=seed, episodes=episodes, difficulty=difficulty,
                                  start_ns=self.start_ns, interval_s=interval_s, time_compression=self.speed)
        self._serial = 0
        self._seed = seed
        self._nodes = [SimulatedNode(self, i) for i in range(self.topology.nodes)]
        self._cache: tuple[int, dict[str, dict[str, pa.Table]]] | None = None

    # -- the protocol --------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return list(self.topology.names)

    def node_model(self, node: str | int) -> SimulatedNode:
        index = node if isinstance(node, int) else self.topology.index(node)
        if not 0 <= index < self.topology.nodes:
            raise TopologyError(f"no node index {index} in this cluster of {self.topology.nodes}")
        return self._nodes[index]

    def node_models(self) -> list[SimulatedNode]:
        return list(self._nodes)

    def inventory(self) -> pa.Table:
        return self.topology.inventory(self.start_ns)

    def step(self, ts_ns: int | None = None) -> dict[str, pa.Table]:
        """Sample every node at once (vectorised), for callers that do not run one collector per node."""
        return self._sample(list(range(self.topology.nodes)), time.time_ns() if ts_ns is None else int(ts_ns))

    def sample_all(self, ts_ns: int) -> None:
        """Sample every node at ts_ns in one vectorised call and keep it, so that the per-node models
        sampled at that same ts_ns (one collector per node, all sweeping at one timestamp) take their
        slice instead of each paying for a generate() call of their own."""
        tables = self.step(ts_ns)
        # every node gets every table, empty where it had no rows, as a sample of its own would give
        by_node: dict[str, dict[str, pa.Table]] = {n: {name: t.slice(0, 0) for name, t in tables.items()}
                                                   for n in self.topology.names}
        for name, table in tables.items():
            if table.num_rows == 0:
                continue
            codes = pc.dictionary_encode(table.column("node")).combine_chunks()
            order = np.argsort(codes.indices.to_numpy(), kind="stable")
            sorted_codes = codes.indices.to_numpy()[order]
            bounds = np.flatnonzero(np.diff(sorted_codes)) + 1
            taken = table.take(pa.array(order))
            for s, e in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(order)]])):
                node = codes.dictionary[int(sorted_codes[s])].as_py()
                by_node.setdefault(node, {})[name] = taken.slice(int(s), int(e - s))
        with self._lock:
            self._cache = (int(ts_ns), by_node)

    def _sample(self, indices: list[int], ts_ns: int) -> dict[str, pa.Table]:
        cache = self._cache
        if len(indices) == 1 and cache is not None and cache[0] == ts_ns:
            with self._lock:
                part = cache[1].pop(self.topology.names[indices[0]], None)
            if part is not None:
                return part
        with self._lock:
            last = int(self.model.last_ts[indices].max())
            ts = max(ts_ns, last + 1)  # a clock that did not move still yields a fresh sample
            if len(indices) > 1 and np.any(self.model.last_ts[indices] != last):
                # nodes sampled at different times: advance each from its own last sample
                parts = [self.model.generate(np.array([i]), np.array([max(ts_ns, int(self.model.last_ts[i]) + 1)]))
                         for i in indices]
                return {name: pa.concat_tables([p[name] for p in parts if name in p]) for name in parts[0]}
            return self.model.generate(np.array(indices), np.array([ts]))

    # -- faults on command ----------------------------------------------------------------------------
    def inject(self, node: str | int, mode: str, *, component: int | None = None, lead_seconds: float = 120.0,
               repair_seconds: float = 600.0, now_ns: int | None = None) -> Episode:
        """Degrade a node now: its precursor starts now and it fails `lead_seconds` from now."""
        mode = MODE_ALIASES.get(mode, mode)
        if mode not in MODES:
            raise ValueError(f"unknown failure mode {mode!r}; known: {', '.join(sorted(MODES))} "
                             f"(or {', '.join(sorted(MODE_ALIASES))})")
        index = node if isinstance(node, int) else self.topology.index(node)
        kind = MODES[mode].component
        limit = self.topology.gpus_per_node if kind == "gpu" else self.topology.hcas_per_node
        if component is not None and kind in ("gpu", "hca") and not 0 <= component < limit:
            raise ValueError(f"{mode} takes a {kind} index in 0..{limit - 1}, got {component}")
        if lead_seconds < 0 or repair_seconds <= 0:
            raise ValueError("lead_seconds must be >= 0 and repair_seconds > 0")
        now = time.time_ns() if now_ns is None else int(now_ns)
        with self._lock:
            self._serial += 1
            ep = injected(self.topology, index, mode, now, int(lead_seconds * NS), component or 0,
                          int(repair_seconds * NS), self._seed, self._serial)
            self.model.add_episode(ep)
        return ep

    def detach(self, node: str | int, now_ns: int | None = None) -> None:
        """The training job has moved off `node` (Foreshock evacuated it): when the node fails later,
        its job no longer stalls (ClusterModel.detach)."""
        index = node if isinstance(node, int) else self.topology.index(node)
        with self._lock:
            self.model.detach(index, time.time_ns() if now_ns is None else int(now_ns))

    def disturb(self, node: str | int, mode: str, *, component: int | None = None, seconds: float = 60.0,
                peak: float = 0.4, now_ns: int | None = None) -> Episode:
        """A benign disturbance: the mode's precursor rises to `peak` (1.0 = a failing device's) over
        `seconds` and fades away, with no failure: the degrade-then-recover hard negative, on command."""
        mode = MODE_ALIASES.get(mode, mode)
        if mode not in MODES or not MODES[mode].precursor or MODES[mode].component not in ("gpu", "hca", "node"):
            raise ValueError(f"disturb takes a node-level mode with a precursor, got {mode!r}")
        if seconds <= 0 or not 0 < peak <= 1:
            raise ValueError("disturb needs seconds > 0 and 0 < peak <= 1")
        index = node if isinstance(node, int) else self.topology.index(node)
        now = time.time_ns() if now_ns is None else int(now_ns)
        with self._lock:
            self._serial += 1
            ep = Episode(f"disturbance-{self._serial:04d}", mode, None, (index,), component or 0, now,
                         now + int(seconds * NS), False, 0, float(peak), "", self._serial,
                         self._seed ^ (self._serial * 0x9E3779B97F4A7C15 % (1 << 62)), injected=True)
            self.model.add_episode(ep)
        return ep

    # -- ground truth (evaluation only) ---------------------------------------------------------------
    def incidents(self, until_ns: int | None = None) -> pa.Table:
        """Failures that have happened by until_ns (default now), as the incidents table."""
        until = time.time_ns() if until_ns is None else int(until_ns)
        with self._lock:
            episodes = list(self.model.episodes)
        return incidents_table(self.topology, episodes, self.start_ns - 365 * 86400 * NS, until + 1)

    def ground_truth(self) -> list[dict]:
        """Every episode, future ones and degrade-then-recover ones included."""
        with self._lock:
            episodes = list(self.model.episodes)
        out = []
        for ep in episodes:
            out.append({"id": ep.episode_id, "mode": ep.mode, "category": ep.category,
                        "nodes": [self.topology.names[n] for n in ep.nodes], "component": ep.component,
                        "precursor_start_ns": ep.start_ns if ep.has_precursor else None,
                        "fail_ns": ep.fail_ns, "end_ns": ep.end_ns, "repaired_ns": ep.repair_ns or None,
                        "injected": ep.injected})
        return out


__all__ = ["LiveCluster", "SimulatedNode", "MODE_ALIASES"]
