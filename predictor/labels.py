"""Labels from the incidents table: does a node fail within the horizon after a step?

Reads schema-v1 `incidents` rows (foreshock/schema.py): node, ts, scope (node | switch | site) with
`affected_nodes` (the blast radius), category, description (for the signature, groups.py),
has_precursor, repaired_at. `precursor_start` is never read here or anywhere features are built: it
is ground truth for the simulator's own tests only.

A step (features as of its end, e) is positive when an incident affecting the node happens in
(e, e + horizon]. Steps from an incident until the node is back (repaired_at; 6 hours when unknown)
are excluded: a failed node's telemetry says nothing about failing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd
import pyarrow as pa

from foreshock.predictor.groups import signature

DEFAULT_HORIZON_S = 30 * 60
DEFAULT_DOWN_S = 6 * 3600
# What `foreshock train` learns to rank high by default (None): a node that fails within the horizon. A longer
# training label (`--label-horizon-minutes 360`, the steps beyond the horizon at EARLY_LABEL_WEIGHT)
# warns earlier when the training world is large (the shipped model: 512 nodes x 28 days), but trained
# on a 128-node world its budget-2 threshold gave 20 times the budget on another world, where the
# horizon's label held it; a user's own history is that size or smaller. Calibration and thresholds
# always stay on the horizon (docs/predictor.md, Labels; benchmarks/results/predictor-label-horizon-2026-12-04.md).
TRAINING_LABEL_HORIZON_S: int | None = None
EARLY_LABEL_WEIGHT = 0.3
# Categories that show no precursor (failure-figures.md), used when has_precursor is not recorded
# (operators' own incident records).
NO_PRECURSOR_CATEGORIES = {"software_bug", "host_maintenance", "silent_data_corruption", "dependency",
                           "nccl_watchdog_timeout", "power_supply", "ssd", "cpu", "system_memory",
                           "server_chassis", "io_expansion_board"}


@dataclass
class Incidents:
    frame: pd.DataFrame   # one row per (incident, affected node): incident_id, node, ts, end, category, has_precursor, scope, signature
    by_incident: pd.DataFrame  # one row per incident

    @classmethod
    def from_table(cls, table: pa.Table | None) -> "Incidents":
        cols = ["incident_id", "node", "ts", "end", "category", "has_precursor", "scope", "signature"]
        if table is None or table.num_rows == 0:
            empty = pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(cols, (
                object, object, np.int64, np.int64, object, bool, object, object))})
            return cls(empty, empty.drop(columns=["node"]))
        df = table.to_pandas()
        rows = []
        for r in df.itertuples(index=False):
            ts = pd.Timestamp(r.ts).value
            rep = r.repaired_at
            end = pd.Timestamp(rep).value if rep is not None and not pd.isna(rep) else ts + DEFAULT_DOWN_S * 10**9
            affected = list(r.affected_nodes) if r.affected_nodes is not None and len(r.affected_nodes) else [r.node]
            hp = r.has_precursor
            if hp is None or pd.isna(hp):
                hp = r.category not in NO_PRECURSOR_CATEGORIES
            iid = r.incident_id or f"{r.node}-{ts}"
            sig = signature(r.category, r.description)
            for node in affected:
                rows.append((iid, node, ts, max(end, ts), r.category, bool(hp), r.scope or "node", sig))
        frame = pd.DataFrame(rows, columns=cols)
        by_incident = frame.drop_duplicates("incident_id").drop(columns=["node"]).reset_index(drop=True)
        return cls(frame, by_incident)

    @cached_property
    def nodes_per_incident(self) -> dict[str, int]:
        """incident_id -> how many nodes it took down (1 for a node's own failure, the nodes under a leaf
        switch or in a site for a wide one)."""
        return {str(k): int(v) for k, v in self.frame.groupby("incident_id").size().items()}

    @cached_property
    def _by_node(self) -> dict[str, pd.DataFrame]:
        return {node: part for node, part in self.frame.groupby("node", sort=False)}

    def of_node(self, node: str) -> pd.DataFrame:
        # evaluation asks once per node and threshold: one groupby, not a scan of the frame each time
        got = self._by_node.get(node)
        return got if got is not None else self.frame.iloc[:0]


def _in_horizon(step_end_ns: np.ndarray, ts: int, horizon_s: int) -> slice:
    """The steps labelled for an incident at `ts`: step ends e with ts - horizon <= e < ts."""
    lo = np.searchsorted(step_end_ns, ts - int(horizon_s) * 1_000_000_000, side="left")
    return slice(lo, np.searchsorted(step_end_ns, ts, side="left"))


def node_labels(step_end_ns: np.ndarray, incidents: pd.DataFrame, horizon_s: int = DEFAULT_HORIZON_S):
    """(y [T] int8, excluded [T] bool) for one node's steps, given its rows of Incidents.frame."""
    t = len(step_end_ns)
    y = np.zeros(t, dtype=np.int8)
    excluded = np.zeros(t, dtype=bool)
    for ts, end in zip(incidents["ts"].to_numpy(np.int64), incidents["end"].to_numpy(np.int64)):
        y[_in_horizon(step_end_ns, ts, horizon_s)] = 1
        a = np.searchsorted(step_end_ns, ts, side="left")
        b = np.searchsorted(step_end_ns, end, side="right")
        excluded[a:b] = True
    return y, excluded


def incident_weights(step_end_ns: np.ndarray, incidents: pd.DataFrame, horizon_s: int,
                     nodes_per_incident: dict[str, int]) -> np.ndarray:
    """[T] float: each step in the horizon before one of the node's incidents (Incidents.frame rows) weighs
    1 / the number of nodes that incident took down (Incidents.nodes_per_incident); every other step 1. A
    leaf switch's failure then weighs as one failure over its nodes, as evaluation counts it (one
    incident, caught when any of its nodes is warned of); where two incidents' horizons overlap, the
    later one's weight holds."""
    w = np.ones(len(step_end_ns), dtype=np.float64)
    order = np.argsort(incidents["ts"].to_numpy(np.int64), kind="stable")
    ts_all = incidents["ts"].to_numpy(np.int64)[order]
    ids = incidents["incident_id"].to_numpy(object)[order]
    for ts, iid in zip(ts_all, ids):
        w[_in_horizon(step_end_ns, ts, horizon_s)] = 1.0 / max(1, int(nodes_per_incident.get(iid, 1)))
    return w


def before_horizon(step_end_ns: np.ndarray, incidents: pd.DataFrame, horizon_s: int, gap_s: float) -> np.ndarray:
    """[T] bool: steps whose node fails within `gap_s` but not within the horizon: (e + horizon, e + gap].

    A precursor that builds for hours already shows in these steps, so calling them healthy would
    teach the model that the early signs of a failure are benign; training leaves them out (they stay
    in every evaluation, where an alert on them is judged like any other)."""
    out = np.zeros(len(step_end_ns), dtype=bool)
    if gap_s <= horizon_s:
        return out
    h, g = int(horizon_s) * 1_000_000_000, int(gap_s * 1e9)
    for ts in incidents["ts"].to_numpy(np.int64):
        lo = np.searchsorted(step_end_ns, ts - g, side="left")
        hi = np.searchsorted(step_end_ns, ts - h, side="left")
        out[lo:hi] = True
    return out
