"""Offline feature building: a schema-v1 Parquet dataset, streamed node partition by node partition.

Reads the dataset of foreshock/dataset.py (ROOT/table=/date=/node=) with `iter`-style per-node reads,
so memory is bounded by one node's rows plus a per-(group, step) table of peer totals, whatever the
dataset's size; each node is independent work, so the same passes could run on a cluster engine.

Two passes:
1. per node: base signals (signals.py), cached to a temporary Parquet file; the node's peer inputs are
   added into per-(leaf switch | job | site, step) totals, with the topology taken as of each step from
   the inventory table.
2. per node: peer signals from those totals, then features.compute over all of the node's steps (the
   same function the online scorer calls), yielding one NodeFeatures per node.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from foreshock import dataset as ds
from foreshock.predictor import features as ft
from foreshock.predictor import signals as sg

STEP_NS = ft.STEP_SECONDS * 1_000_000_000


@dataclass
class NodeFeatures:
    node: str
    steps: np.ndarray      # [T] step indices (ts // step); the features describe the step's end
    present: np.ndarray    # [T] the node had telemetry in the step
    X: np.ndarray          # [T, F] float32 features

    @property
    def step_end_ns(self) -> np.ndarray:
        return (self.steps + 1) * STEP_NS


def list_dataset_nodes(root) -> list[str]:
    nodes = set()
    for table in sg.TABLES:
        nodes.update(ds.list_nodes(root, table))
    return sorted(nodes)


def read_node(root, node: str) -> dict[str, pa.Table]:
    out = {}
    for table in sg.TABLES:
        data = ds.read_table(root, table, nodes=[node], columns=sg._needed_columns(table))
        if data.num_rows:
            out[table] = data
    return out


class Inventory:
    """Topology labels as of any time, per node, from the inventory table."""

    def __init__(self, table: pa.Table | None):
        self._rows: dict[str, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
        if table is None or table.num_rows == 0:
            return
        df = table.select(["ts", "node", *ft.PEER_GROUPS]).to_pandas()
        df["ts"] = df["ts"].astype("int64")
        for node, part in df.sort_values(["node", "ts"], kind="stable").groupby("node", sort=False):
            self._rows[node] = (part["ts"].to_numpy(),
                                {g: part[g].astype(object).where(part[g].notna(), None).to_numpy() for g in ft.PEER_GROUPS})

    @classmethod
    def read(cls, root) -> "Inventory":
        return cls(ds.read_table(root, "inventory"))

    def labels_at(self, node: str, at_ns: np.ndarray) -> dict[str, np.ndarray]:
        got = self._rows.get(node)
        if got is None:
            return {g: np.full(len(at_ns), None, dtype=object) for g in ft.PEER_GROUPS}
        ts, labels = got
        idx = np.clip(np.searchsorted(ts, at_ns, side="right") - 1, 0, None)
        return {g: labels[g][idx] for g in ft.PEER_GROUPS}


class PeerTotals:
    """Per group kind and (group, step): nodes present, totals and nonzero counts of the peer inputs."""

    def __init__(self, first_step: int, last_step: int):
        self.first = int(first_step)
        self.t = int(last_step) - int(first_step) + 1
        self.codes: dict[str, dict[str, int]] = {g: {} for g in ft.PEER_GROUPS}
        self.count = {g: np.zeros((0, self.t)) for g in ft.PEER_GROUPS}
        self.total = {g: np.zeros((0, self.t, 3)) for g in ft.PEER_GROUPS}
        self.nonzero = {g: np.zeros((0, self.t, 3)) for g in ft.PEER_GROUPS}

    def code_array(self, group: str, labels: np.ndarray) -> np.ndarray:
        codes = self.codes[group]
        out = np.empty(len(labels), dtype=np.int64)
        uniq, inv = np.unique(np.array([lab if lab else "" for lab in labels], dtype=object), return_inverse=True)
        mapped = np.array([codes.setdefault(u, len(codes)) if u else -1 for u in uniq], dtype=np.int64)
        out[:] = mapped[inv] if len(uniq) else -1
        grow = len(codes) - self.count[group].shape[0]
        if grow > 0:
            self.count[group] = np.concatenate([self.count[group], np.zeros((grow, self.t))])
            self.total[group] = np.concatenate([self.total[group], np.zeros((grow, self.t, 3))])
            self.nonzero[group] = np.concatenate([self.nonzero[group], np.zeros((grow, self.t, 3))])
        return out

    def add(self, group: str, codes: np.ndarray, steps: np.ndarray, present: np.ndarray, own: np.ndarray):
        ok = (codes >= 0) & present
        c, s = codes[ok], steps[ok] - self.first
        np.add.at(self.count[group], (c, s), 1.0)
        np.add.at(self.total[group], (c, s), own[ok])
        np.add.at(self.nonzero[group], (c, s), (own[ok] > 0).astype(np.float64))

    def lookup(self, group: str, codes: np.ndarray, steps: np.ndarray):
        n = len(codes)
        safe = np.where(codes >= 0, codes, 0)
        s = steps - self.first
        if self.count[group].shape[0] == 0:
            return np.zeros(n), np.zeros((n, 3)), np.zeros((n, 3))
        return self.count[group][safe, s], self.total[group][safe, s], self.nonzero[group][safe, s]


def densify(base: sg.StepSignals) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One node's step signals -> (steps [T] from its first to last step, base [T, S], present [T])."""
    steps_have = base.step.astype(np.int64)
    first, last = int(steps_have.min()), int(steps_have.max())
    steps = np.arange(first, last + 1, dtype=np.int64)
    x = np.full((len(steps), len(sg.BASE_NAMES)), np.nan)
    x[steps_have - first] = base.values
    present = np.zeros(len(steps), dtype=bool)
    present[steps_have - first] = True
    return steps, x, present


class FeatureBuilder:
    """Both passes over a dataset; iterate it for one NodeFeatures per node."""

    def __init__(self, root, *, nodes: list[str] | None = None, progress=None, cache_dir=None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"dataset directory {self.root} does not exist")
        self.nodes = nodes if nodes is not None else list_dataset_nodes(self.root)
        self.inventory = Inventory.read(self.root)
        self.progress = progress
        self._own_cache = cache_dir is None
        self.cache = Path(cache_dir or tempfile.mkdtemp(prefix="foreshock-features-"))
        self.cache.mkdir(parents=True, exist_ok=True)
        self._ranges: dict[str, tuple[int, int]] = {}
        self.totals: PeerTotals | None = None

    def close(self):
        if self._own_cache:
            shutil.rmtree(self.cache, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _cache_path(self, i: int) -> Path:
        return self.cache / f"base-{i:06d}.parquet"

    def pass1(self) -> None:
        for i, node in enumerate(self.nodes):
            base = sg.node_base_signals(read_node(self.root, node))
            if len(base) == 0:
                continue
            steps, x, present = densify(base)
            cols = {"step": steps, "present": present}
            cols.update({name: x[:, j] for j, name in enumerate(sg.BASE_NAMES)})
            pq.write_table(pa.table(cols), self._cache_path(i), compression="zstd")
            self._ranges[node] = (int(steps[0]), int(steps[-1]))
            if self.progress:
                self.progress("base signals", i + 1, len(self.nodes))
        if not self._ranges:
            raise ValueError(f"dataset {self.root} has no telemetry rows for nodes {self.nodes[:5]}")
        first = min(r[0] for r in self._ranges.values())
        last = max(r[1] for r in self._ranges.values())
        self.totals = PeerTotals(first, last)
        for i, node in enumerate(self.nodes):
            if node not in self._ranges:
                continue
            steps, x, present = self._load(i)
            own = ft.peer_inputs(x)
            labels = self.inventory.labels_at(node, (steps + 1) * STEP_NS)
            for g in ft.PEER_GROUPS:
                self.totals.add(g, self.totals.code_array(g, labels[g]), steps, present, own)

    def _load(self, i: int):
        t = pq.read_table(self._cache_path(i))
        steps = t.column("step").to_numpy()
        present = t.column("present").to_numpy(zero_copy_only=False)
        x = np.column_stack([t.column(n).to_numpy(zero_copy_only=False) for n in sg.BASE_NAMES]).astype(np.float64)
        return steps, x, present

    @property
    def step_range(self) -> tuple[int, int]:
        return self.totals.first, self.totals.first + self.totals.t - 1

    def node_features(self, i: int) -> NodeFeatures:
        node = self.nodes[i]
        steps, x, present = self._load(i)
        own = ft.peer_inputs(x)
        labels = self.inventory.labels_at(node, (steps + 1) * STEP_NS)
        codes, totals = {}, {}
        for g in ft.PEER_GROUPS:
            codes[g] = self.totals.code_array(g, labels[g])
            totals[g] = self.totals.lookup(g, codes[g], steps)
        peers = ft.peer_signals(own, present, codes, totals)
        full = np.concatenate([x, peers], axis=1)[None]
        X, _ = ft.compute(full, steps, ft.FeatureState.empty(1))
        return NodeFeatures(node, steps, present, X[0])

    def __iter__(self) -> Iterator[NodeFeatures]:
        if self.totals is None:
            self.pass1()
        for i, node in enumerate(self.nodes):
            if node not in self._ranges:
                continue
            yield self.node_features(i)
            if self.progress:
                self.progress("features", i + 1, len(self.nodes))


def dataset_hash(root) -> str:
    """sha256 over every Parquet file of the dataset (relative path and content), in sorted order."""
    import hashlib

    root = Path(root)
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.parquet")):
        if path.name.startswith((".", "_")):
            continue
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
