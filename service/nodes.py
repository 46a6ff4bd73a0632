"""What the control plane knows about each node: topology labels, liveness, latest risk, fatal events.

Topology (site, spine, leaf switch, NVLink domain, the job label) comes from the schema-v1 `inventory`
table the collectors (or the simulator) stream, or from a topology file given to `foreshock serve`; the
policy reads it to find a fault's blast radius. Risk is written once per scoring round for every scored
node at once (arrays in, dicts out), so readers (the Risk API, the metrics collector) see one
consistent round.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from foreshock.service.domain import SignalRecord


@dataclass(frozen=True)
class Topology:
    site: str = ""
    spine: str = ""
    leaf_switch: str = ""
    nvlink_domain: str = ""  # a multi-node NVLink domain (an NVL72 rack); "" where NVLink stays inside the node
    job: str = ""            # the inventory's job label, if any (jobs registered here are the store's)


@dataclass(frozen=True)
class NodeRisk:
    node: str
    probability: float
    scored_at_ns: int
    signals: tuple[SignalRecord, ...] = ()


@dataclass(frozen=True)
class FatalEvent:
    node: str
    ts_ns: int
    kind: str
    description: str
    received_ns: int = 0


def lost_gpus(gpu: pa.Table, received_ns: int) -> list[FatalEvent]:
    """The fatal events a checked schema-v1 `gpu` table reports: each row with gpu_lost set."""
    if not pc.any(gpu.column("gpu_lost")).as_py():
        return []
    lost = gpu.filter(gpu.column("gpu_lost")).select(["ts", "node", "gpu"])
    return [FatalEvent(row["node"], ts_i, "gpu_lost", f"GPU {row['gpu']} lost", received_ns)
            for ts_i, row in zip(lost.column("ts").cast(pa.int64()).to_pylist(), lost.to_pylist())]


@dataclass
class NodeBook:
    """Thread-safe per-node state shared by ingest, scoring, policy, the Risk API and the metrics."""

    topology: dict[str, Topology] = field(default_factory=dict)
    last_seen_ns: dict[str, int] = field(default_factory=dict)
    risk: dict[str, NodeRisk] = field(default_factory=dict)
    fatal: dict[str, FatalEvent] = field(default_factory=dict)
    round_ns: int = 0
    # Node history score (predictor/history.py): P(a fault within days) per node with a past fault, and
    # the score of a node with none; None while no fault log is loaded (`serve --history`).
    history: dict[str, float] = field(default_factory=dict)
    history_default: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_topology(self, node: str, topo: Topology) -> None:
        with self._lock:
            self.topology[node] = topo

    def topologies(self) -> dict[str, Topology]:
        with self._lock:
            return dict(self.topology)

    def topo(self, node: str) -> Topology:
        return self.topology.get(node, Topology())

    def seen(self, node: str, now_ns: int) -> None:
        self.last_seen_ns[node] = now_ns  # a dict store is atomic under the GIL

    def record_fatal(self, event: FatalEvent) -> None:
        with self._lock:
            old = self.fatal.get(event.node)
            if old is None or event.ts_ns > old.ts_ns:  # the first report of an instant names it
                self.fatal[event.node] = event

    def clear_fatal(self, node: str) -> None:
        with self._lock:
            self.fatal.pop(node, None)

    def update_risk(self, nodes: list[str], probability: np.ndarray, signals: list, now_ns: int) -> None:
        fresh = {n: NodeRisk(n, float(p), now_ns, tuple(s)) for n, p, s in zip(nodes, probability.tolist(), signals)}
        with self._lock:
            self.risk.update(fresh)
            self.round_ns = now_ns

    def probability(self, node: str) -> float | None:
        r = self.risk.get(node)
        return None if r is None else r.probability

    def set_history(self, scores: dict[str, float], default: float) -> None:
        with self._lock:
            self.history, self.history_default = dict(scores), float(default)

    def history_risk(self, node: str) -> float | None:
        return self.history.get(node, self.history_default)

    def known_nodes(self) -> set[str]:
        return set(self.last_seen_ns) | set(self.topology) | set(self.risk)

    def nodes_under(self, attr: str, value: str) -> set[str]:
        if not value:
            return set()
        with self._lock:
            return {n for n, t in self.topology.items() if getattr(t, attr) == value}

    def riskiest(self, limit: int, min_probability: float = 0.0) -> list[NodeRisk]:
        with self._lock:
            items = [r for r in self.risk.values() if r.probability >= min_probability]
        items.sort(key=lambda r: (-r.probability, r.node))
        return items[:limit]

    def snapshot(self) -> list[NodeRisk]:
        with self._lock:
            return list(self.risk.values())

    def forget(self, nodes: Iterable[str]) -> None:
        """What is held of these nodes (another shard serves them now): they leave the Risk API and the
        per-node metrics. A fatal event stays: the policy's fatal alarm holds its time out on it."""
        with self._lock:
            for n in nodes:
                self.risk.pop(n, None)
                self.last_seen_ns.pop(n, None)
                self.topology.pop(n, None)
