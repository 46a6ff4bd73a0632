"""Offline feature building: a schema-v1 Parquet dataset, streamed node partition by node partition.

Reads the dataset of foreshock/dataset.py (ROOT/table=/date=/node=, and the archive's files directly
under a date, filtered by node), a local directory or a URI, through its pyarrow filesystem
(dataset.DatasetRoot), with `iter`-style per-node reads,
so memory is bounded by one node's rows plus a per-(group, step) table of peer totals, whatever the
dataset's size; each node is independent work, so the same passes could run on a cluster engine.

Two passes:
1. per node: base and fabric signals (signals.py), cached to a temporary Parquet file; the node's peer inputs are
   added into per-(leaf switch | job | site, step) totals, with the topology taken as of each step from
   the inventory table. Then the `step_times` table, a date at a time (every node's rows of the date:
   a job's ranks run on many nodes; a feature step never spans two dates): the job-relative step-time
   signal (steptimes.py) of each node and step, cached per node and date.
2. per node: peer signals from those totals, then features.compute over all of the node's steps (the
   same function the online scorer calls), yielding one NodeFeatures per node.

The per-node work of both passes runs on an executor (executors.py): a pool of `workers` processes
(default: FORESHOCK_FEATURE_WORKERS, else os.cpu_count()), or Ray tasks (`executor="ray"`); the
parent adds the peer totals and yields NodeFeatures in node order, so the output is identical to the
serial one (workers=1 runs the same functions in-process) on every executor. At most two nodes per
worker are in flight, each worker holds one node's rows, and the peer totals reach the workers as
memory-mapped files in the cache directory: memory stays bounded.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from foreshock import dataset as ds
from foreshock import schema as sch
from foreshock.predictor import executors
from foreshock.predictor import features as ft
from foreshock.predictor import signals as sg
from foreshock.predictor import steptimes as stt

STEP_NS = ft.STEP_SECONDS * 1_000_000_000
log = logging.getLogger(__name__)


@dataclass
class NodeFeatures:
    node: str
    steps: np.ndarray      # [T] step indices (ts // step); the features describe the step's end
    present: np.ndarray    # [T] the node had telemetry in the step
    X: np.ndarray          # [T, F] float32 features

    @property
    def step_end_ns(self) -> np.ndarray:
        return (self.steps + 1) * STEP_NS

    @property
    def scoreable(self) -> np.ndarray:
        """[T] the rows a model scores: present, and past the node's first step (ft.scoreable)."""
        since = self.steps - self.steps[0] if len(self.steps) else self.steps
        return self.present & ft.scoreable(since)


SPARSE_SHARE = 0.5       # a node whose sampled steps mostly follow an unsampled one is sampled less than once a step


class TelemetryInterval:
    """How often a dataset's nodes were sampled, against the features' step (features.STEP_SECONDS).

    The features read a counter's growth per step. A delta that spans more than signals.GAP_FACTOR steps
    is scaled to one step's worth (signals.gap_scale: a missed sample's errors are not one step's burst),
    except where an entity is sampled less often than once a step (a 2-minute collector, another writer's
    history): from its signals.SPREAD_AFTER_GAPS-th gap in a row, each delta is spread over the steps its
    span covers, gauges held (signals.py), so windowed counts and node-days read as a once-a-step
    collector's would, up to one sampling interval later. Spans of more than signals.OUTAGE_STEPS steps
    are outages and stay scaled: a node sampled that seldom has its windowed counts read low by about the
    ratio, a condition such as "link down twice in 30 minutes" needs as many times more, and an
    evaluation's node-days count its sampled steps only. Each table is judged on its own, since a writer
    may sample its GPUs every minute and its ports every two. FeatureBuilder `add`s each node in its first
    pass (`FeatureBuilder.telemetry_interval`); `summary` says how the nodes were sampled, overall and by
    table (telemetry_interval_warning: what the figures then mean)."""

    def __init__(self):
        self.steps_per_sample: list[float] = []   # per node, its most seldom sampled table's mean interval
        self.sparse_nodes = 0
        self.spread_nodes = 0
        self.spread_steps = 0
        self.by_table: dict[str, dict] = {}

    def add(self, sampled: dict[str, np.ndarray], spread: Counter | None = None) -> None:
        """One node: per sampled table (not events), `sampled[table]` [T] whether the node had a row of it
        in each step of its range (a sample, not a spread delta's share); `spread` the entity steps a
        spread delta filled, by table. A node is sampled less than once a step when any table is."""
        spread = spread or Counter()
        coarsest, sparse_tables = None, []
        for table, got in sorted(sampled.items()):
            d = np.diff(np.flatnonzero(got))
            if len(d) == 0:
                continue
            interval = d[d <= sg.OUTAGE_STEPS]
            if len(interval) == 0:   # never sampled within an outage's span: the interval is the gaps
                interval = d
            mean = float(interval.mean())
            t = self.by_table.setdefault(table, {"steps_per_sample": [], "sparse": 0, "spread": 0})
            t["steps_per_sample"].append(mean)
            if (interval >= 2).mean() > SPARSE_SHARE:
                sparse_tables.append(table)
                t["sparse"] += 1
                t["spread"] += spread[table] > 0
            coarsest = mean if coarsest is None else max(coarsest, mean)
        if coarsest is None:
            return
        self.steps_per_sample.append(coarsest)
        self.sparse_nodes += bool(sparse_tables)
        self.spread_nodes += bool(sparse_tables) and all(spread[t] > 0 for t in sparse_tables)
        self.spread_steps += int(sum(spread.values()))

    def summary(self) -> dict:
        def seconds(steps):
            return round(float(np.median(steps)) * ft.STEP_SECONDS, 1) if steps else None
        return {"step_seconds": ft.STEP_SECONDS, "nodes": len(self.steps_per_sample),
                "median_seconds_between_samples": seconds(self.steps_per_sample),
                "nodes_sampled_less_than_once_a_step": self.sparse_nodes,
                "of_those_spread_over_their_steps": self.spread_nodes,
                "entity_steps_filled_by_spreading": self.spread_steps,
                "by_table": {table: {"nodes": len(t["steps_per_sample"]),
                                     "median_seconds_between_samples": seconds(t["steps_per_sample"]),
                                     "nodes_sampled_less_than_once_a_step": t["sparse"],
                                     "of_those_spread_over_their_steps": t["spread"]}
                             for table, t in sorted(self.by_table.items())}}


def telemetry_interval_warning(summary: dict | None) -> str | None:
    """The warning for TelemetryInterval.summary, or None when every node was sampled at least once a step."""
    if not summary or not summary.get("nodes_sampled_less_than_once_a_step"):
        return None
    sparse = summary["nodes_sampled_less_than_once_a_step"]
    spread = summary.get("of_those_spread_over_their_steps", 0)
    tables = ", ".join(f"{table} on {t['nodes_sampled_less_than_once_a_step']} (median {t['median_seconds_between_samples']:g} s)"
                       for table, t in summary.get("by_table", {}).items() if t["nodes_sampled_less_than_once_a_step"])
    out = (f"WARNING: {sparse} of {summary['nodes']} nodes were sampled less often than once per feature step of "
           f"{summary['step_seconds']} s (median {summary['median_seconds_between_samples']:g} s between samples"
           + (f"; by table: {tables}" if tables else "") + ").")
    if spread:
        out += (f" {spread} of them had each sample's counts spread over the steps it covers: their windowed counts "
                "and node-days read as a once-a-step collector's would, up to one sampling interval later, a burst "
                "shorter than the interval reads as a steady rate, and the model learned from histories sampled "
                "every step.")
    if sparse > spread:
        out += (f" {sparse - spread} {'was' if sparse - spread == 1 else 'were'} sampled too seldom to spread (gaps of "
                f"more than {sg.OUTAGE_STEPS} steps are outages): their windowed error counts read low by about that "
                "ratio, count conditions need more events to be met, and node-days count only their sampled steps, "
                "so false evacuations per 1,000 node-days read high by the same ratio.")
    return out + " Collect at least once a minute (docs/predictor.md, \"Telemetry interval\")."


def list_dataset_nodes(root) -> list[str]:
    r = ds.dataset_root(root)
    nodes = set()
    for table in sg.TABLES:
        nodes.update(ds.list_nodes(r, table))
    return sorted(nodes)


def read_node(root, node: str, dates: dict[str, list[str]] | None = None) -> dict[str, pa.Table]:
    """One node's rows of every base-signal table, as dataset.read_table(nodes=[node]) reads them.

    `root` is a path, a URI or a dataset.DatasetRoot; every listing and read goes through its
    filesystem. The node's partition directories are named directly (dataset.partition_dir) for each
    date of the table (`dates`, listed once by the caller): listing every node's directory of every
    date for each node read would cost nodes^2 directory entries.

    The archive's files (every node's rows in one file per table and date, dataset.date_files) are
    read with a filter on the node, which their row groups' statistics mostly answer.
    """
    r = ds.dataset_root(root)
    out = {}
    for table in sg.TABLES:
        files, shared = [], []
        for date in (dates[table] if dates is not None else ds.table_dates(r, table)):
            pdir = str(ds.partition_dir(r.path, table, date, node))
            shared += ds.date_files(pdir.rpartition("/")[0], r.fs)
            files += ds.list_dir(r.fs, pdir)[1]
        # in file order, unsorted: SampleStage sorts each entity's rows by time itself (stably, so
        # duplicates resolve as after read_table's stable sort)
        parts = []
        try:
            if files:
                parts.append(pads.dataset(files, schema=sch.schema(table), format="parquet",
                                          filesystem=r.fs).to_table(columns=sg._needed_columns(table)))
            if shared:
                parts.append(pads.dataset(shared, schema=sch.schema(table), format="parquet", filesystem=r.fs).to_table(
                    columns=sg._needed_columns(table), filter=pc.field("node") == node))
        except (OSError, pa.ArrowException) as exc:
            bad = _unreadable(r, files + shared)
            raise ValueError(f"{r.show(bad) if bad else f'table={table}, node {node}'}: {exc}") from exc
        data = pa.concat_tables(parts) if len(parts) > 1 else (parts[0] if parts else None)
        if data is not None and data.num_rows:
            out[table] = data
    return out


def _unreadable(root: ds.DatasetRoot, files: list[str]) -> str | None:
    """The first of `files` whose Parquet footer does not read (the file a failed read tripped on)."""
    for f in files:
        try:
            pq.read_metadata(f, filesystem=root.fs)
        except (OSError, pa.ArrowException):
            return f
    return None


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

    def rows_at(self, node: str, at_ns: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """labels_at as (the inventory row of each time [T], each group's label per row): a node
        has a handful of rows, so per-row work replaces per-step work."""
        got = self._rows.get(node)
        if got is None:
            return np.zeros(len(at_ns), dtype=np.intp), {g: np.array([None], dtype=object) for g in ft.PEER_GROUPS}
        ts, labels = got
        return np.clip(np.searchsorted(ts, at_ns, side="right") - 1, 0, None), labels


# A day of steps: the peer totals are kept by (group, day), so a job takes memory for the days it ran,
# not for the dataset's whole span (a month of a cluster whose jobs start, end and change holds hundreds
# of jobs: 896 in 512 nodes x 28 days of the random world, 3.8 GB as one dense (job, step) table).
TOTALS_CHUNK_STEPS = 1440


class PeerTotals:
    """Per group kind and (group, step): nodes present, totals and nonzero counts of the peer inputs.

    Stored by (group, day): `slot[group][code, day]` is the row of `values[group]` holding that day
    (-1: no node of the group was present that day, all zeros), and a row is [day's steps, 1 + 2K]:
    the count, the K totals, the K nonzero counts. Each cell sums the same values in the same order as
    a dense table would, so the totals are bit for bit the same."""

    def __init__(self, first_step: int, last_step: int):
        self.first = int(first_step)
        self.t = int(last_step) - int(first_step) + 1
        self.days = -(-self.t // TOTALS_CHUNK_STEPS)
        self.codes: dict[str, dict[str, int]] = {g: {} for g in ft.PEER_GROUPS}
        k = len(ft.PEER_INPUTS)
        self.slot = {g: np.full((0, self.days), -1, dtype=np.int64) for g in ft.PEER_GROUPS}
        self.values = {g: np.zeros((0, TOTALS_CHUNK_STEPS, 1 + 2 * k)) for g in ft.PEER_GROUPS}
        self.used = {g: 0 for g in ft.PEER_GROUPS}

    def code_array(self, group: str, labels: np.ndarray) -> np.ndarray:
        codes = self.codes[group]
        out = np.empty(len(labels), dtype=np.int64)
        uniq, inv = np.unique(np.array([lab if lab else "" for lab in labels], dtype=object), return_inverse=True)
        mapped = np.array([codes.setdefault(u, len(codes)) if u else -1 for u in uniq], dtype=np.int64)
        out[:] = mapped[inv] if len(uniq) else -1
        self._grow(group)
        return out

    def code_rows(self, group: str, row_labels: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """code_array(group, row_labels[idx]) (the same codes, assigned in the same order), from
        the few distinct rows instead of every step's label."""
        codes = self.codes[group]
        used = np.unique(idx)
        labs = [row_labels[r] if row_labels[r] else "" for r in used]
        mapping = {u: (codes.setdefault(u, len(codes)) if u else -1) for u in sorted(set(labs))}
        row_code = np.full(len(row_labels), -1, dtype=np.int64)
        row_code[used] = [mapping[lab] for lab in labs]
        self._grow(group)
        return row_code[idx]

    def _grow(self, group: str) -> None:
        grow = len(self.codes[group]) - self.slot[group].shape[0]
        if grow > 0:
            self.slot[group] = np.concatenate([self.slot[group], np.full((grow, self.days), -1, dtype=np.int64)])

    def _rows(self, group: str, codes: np.ndarray, days: np.ndarray) -> np.ndarray:
        """The value rows of these (code, day) pairs, made (zeros) where new; capacity doubles."""
        slot = self.slot[group]
        missing = slot[codes, days] < 0
        new = np.unique(codes[missing] * self.days + days[missing])
        if len(new):
            slot[new // self.days, new % self.days] = self.used[group] + np.arange(len(new))
            self.used[group] += len(new)
            vals = self.values[group]
            if self.used[group] > len(vals):
                bigger = np.zeros((max(self.used[group], 2 * len(vals)),) + vals.shape[1:])
                bigger[:len(vals)] = vals
                self.values[group] = bigger
        return slot[codes, days]

    def add(self, group: str, codes: np.ndarray, steps: np.ndarray, present: np.ndarray, own: np.ndarray):
        """One node's steps (each step once, so indexed += adds exactly what np.add.at would)."""
        ok = (codes >= 0) & present
        c, s = codes[ok], steps[ok] - self.first
        rows = self._rows(group, c, s // TOTALS_CHUNK_STEPS)
        at = s % TOTALS_CHUNK_STEPS
        k = own.shape[1]
        vals = self.values[group]
        parts = ((slice(0, 1), np.ones((len(s), 1))), (slice(1, 1 + k), own[ok]),
                 (slice(1 + k, 1 + 2 * k), (own[ok] > 0).astype(np.float64)))
        if len(np.unique(s)) != len(s):
            for cols, v in parts:
                view = vals[:, :, cols]
                np.add.at(view, (rows, at), v)
            return
        for cols, v in parts:
            vals[rows, at, cols] += v

    def save(self, directory: Path) -> None:
        """The totals as .npy files, for workers to memory-map (lookup works on the mapped arrays)."""
        for g in ft.PEER_GROUPS:
            np.save(directory / f"totals-{g}-slot.npy", self.slot[g])
            np.save(directory / f"totals-{g}-values.npy", self.values[g][:self.used[g]])

    @classmethod
    def load(cls, directory: Path, first: int, t: int) -> "PeerTotals":
        out = cls(first, first + t - 1)
        for g in ft.PEER_GROUPS:
            out.slot[g] = np.load(directory / f"totals-{g}-slot.npy", mmap_mode="r")
            out.values[g] = np.load(directory / f"totals-{g}-values.npy", mmap_mode="r")
            out.used[g] = len(out.values[g])
        return out

    def lookup(self, group: str, codes: np.ndarray, steps: np.ndarray):
        """(count [n], totals [n, K], nonzero counts [n, K]) of each (code, step); a code of -1 reads
        group 0's, as the caller masks it."""
        n, k = len(codes), len(ft.PEER_INPUTS)
        if self.slot[group].shape[0] == 0:
            return np.zeros(n), np.zeros((n, k)), np.zeros((n, k))
        safe = np.where(codes >= 0, codes, 0)
        s = steps - self.first
        rows = np.asarray(self.slot[group][safe, s // TOTALS_CHUNK_STEPS])
        got = np.zeros((n, 1 + 2 * k))
        have = rows >= 0
        if have.any():
            got[have] = self.values[group][rows[have], s[have] % TOTALS_CHUNK_STEPS]
        return got[:, 0], got[:, 1:1 + k], got[:, 1 + k:]


def densify(base: sg.StepSignals) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One node's step signals -> (steps [T] from its first to last step, x [T, len(signals.STEP_NAMES)],
    present [T])."""
    steps_have = base.step.astype(np.int64)
    first, last = int(steps_have.min()), int(steps_have.max())
    steps = np.arange(first, last + 1, dtype=np.int64)
    x = np.full((len(steps), len(sg.STEP_NAMES)), np.nan)
    x[steps_have - first] = base.values
    present = np.zeros(len(steps), dtype=bool)
    present[steps_have - first] = True
    return steps, x, present


def _base_pass(root: ds.DatasetRoot, node: str, cache_path: str, dates: dict[str, list[str]]):
    """Pass 1 for one node (in a worker): base signals to the cache; returns what the totals need.
    `root` comes pickled, its filesystem with it: the worker reads the dataset wherever it is. Also
    returns the fabric readings the signals left out, by reason (signals.MALFORMED), and what
    TelemetryInterval.add reads: per sampled table, the steps with a row of the node's own, and the entity
    steps a spread delta filled."""
    malformed, spread = Counter(), Counter()
    tables = read_node(root, node, dates)
    base = sg.node_base_signals(tables, malformed=malformed, spread=spread)
    if len(base) == 0:
        return None
    steps, x, present = densify(base)
    sampled = {}
    for table, data in tables.items():
        if table != "events" and data.num_rows:
            got = pc.cast(data.column("ts"), pa.int64()).to_numpy(zero_copy_only=False) // STEP_NS - steps[0]
            sampled[table] = np.zeros(len(steps), dtype=bool)
            sampled[table][got[(got >= 0) & (got < len(steps))]] = True
    cols = {"step": steps, "present": present}
    cols.update({name: x[:, j] for j, name in enumerate(sg.STEP_NAMES)})
    pq.write_table(pa.table(cols), cache_path, compression="zstd")
    return steps, present, ft.peer_inputs(x), malformed, (sampled, spread)


_WORKER_TOTALS: dict[tuple, PeerTotals] = {}
FEATURE_BLOCK_STEPS = 1024
STEP_TIME_CHUNK_STEPS = 60   # feature steps of step_times rows judged at a time (FeatureBuilder.step_time_pass)
ON_ERROR = ("stop", "skip")   # a node partition whose work fails: stop the build, or leave the node out


def _feature_pass(cache_dir: str, run: str, i: int, node: str, first: int, t: int, out_path: str | None,
                  totals: PeerTotals | None = None):
    """Pass 2 for one node (in a worker): peer signals from the mapped totals, then the features."""
    cache = Path(cache_dir)
    if totals is None:
        key = (cache_dir, run)
        totals = _WORKER_TOTALS.get(key)
        if totals is None:
            _WORKER_TOTALS.clear()
            totals = _WORKER_TOTALS[key] = PeerTotals.load(cache, first, t)
    steps, x, present = _load_cache(cache / f"base-{i:06d}.parquet")
    codes_all = np.load(cache / f"codes-{i:06d}.npy")
    own = ft.peer_inputs(x)
    codes, looked = {}, {}
    for j, g in enumerate(ft.PEER_GROUPS):
        codes[g] = codes_all[j].astype(np.int64)
        looked[g] = totals.lookup(g, codes[g], steps)
    peers = ft.peer_signals(own, present, codes, looked)
    full = ft.all_signals(x, peers, _step_time_values(cache, i, steps))[None]
    # in blocks of steps, carrying the state (the same values as one block: features.compute's
    # contract): the temporaries stay small enough to be reused rather than mapped afresh each time
    X = np.empty((len(steps), ft.N_FEATURES), dtype=np.float32)
    state = ft.FeatureState.empty(1)
    for a in range(0, len(steps), FEATURE_BLOCK_STEPS):
        b = a + FEATURE_BLOCK_STEPS
        block, state = ft.compute(full[:, a:b], steps[a:b], state)
        X[a:b] = block[0]
    nf = NodeFeatures(node, steps, present, X)
    if out_path is None:
        return nf
    np.save(out_path, nf.X)   # a file in the page cache: cheaper than pickling through the pipe
    return NodeFeatures(node, steps, present, None)


def _step_time_values(cache: Path, i: int, steps: np.ndarray) -> np.ndarray:
    """[T, len(stt.SIGNALS)]: node i's step-time signal at its steps, from FeatureBuilder.step_time_pass."""
    out = stt.empty_values(len(steps))
    for path in sorted(cache.glob(f"steptimes-{i:06d}-*.npy")):
        got = np.load(path)
        at = got[:, 0].astype(np.int64) - int(steps[0])
        ok = (at >= 0) & (at < len(steps))
        out[at[ok]] = got[ok, 1:]
    return out


def _load_cache(path: Path):
    t = pq.read_table(path)
    steps = t.column("step").to_numpy()
    present = t.column("present").to_numpy(zero_copy_only=False)
    x = np.column_stack([t.column(n).to_numpy(zero_copy_only=False) for n in sg.STEP_NAMES]).astype(np.float64)
    return steps, x, present


# Below this many nodes per worker, starting the workers (a second or two each) costs more than they save.
MIN_NODES_PER_WORKER = 8


def feature_workers(workers: int | None = None, nodes: int | None = None) -> int:
    """The worker count: the argument, else FORESHOCK_FEATURE_WORKERS, else os.cpu_count() (fewer
    for a small dataset of `nodes` nodes)."""
    if workers is None:
        workers = env_int("FORESHOCK_FEATURE_WORKERS", 0)
        if workers <= 0:
            workers = os.cpu_count() or 1
            if nodes is not None:
                workers = min(workers, max(1, nodes // MIN_NODES_PER_WORKER))
    workers = max(1, int(workers))
    return workers if nodes is None else min(workers, max(nodes, 1))


class FeatureBuilder:
    """Both passes over a dataset; iterate it for one NodeFeatures per node (in node order)."""

    def __init__(self, root, *, nodes: list[str] | None = None, progress=None, cache_dir=None,
                 workers: int | None = None, executor: str = "local", ray_address: str | None = None,
                 on_error: str = "stop"):
        # the dataset: any filesystem (dataset.open_dataset_root); the cache stays a local directory
        # (on Ray across machines, one every worker mounts)
        self.root = ds.open_dataset_root(root)
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error {on_error!r} is not one of {', '.join(ON_ERROR)}")
        self.nodes = nodes if nodes is not None else list_dataset_nodes(self.root)
        self.inventory = Inventory.read(self.root)
        self.progress = progress
        self.workers = feature_workers(workers, len(self.nodes))
        self._own_cache = cache_dir is None
        self.cache = Path(cache_dir or tempfile.mkdtemp(prefix="foreshock-features-"))
        self.cache.mkdir(parents=True, exist_ok=True)
        self._ranges: dict[str, tuple[int, int]] = {}
        self.totals: PeerTotals | None = None
        self._run = ""
        self.on_error = on_error
        self.skipped: dict[str, str] = {}    # node -> why its partition was left out (on_error="skip")
        # step_times rows left out, by reason (steptimes.SKIP_REASONS), and those of nodes without telemetry
        self.step_time_stats: Counter = Counter()
        # gpu and events rows whose fabric reading was left out, by reason (signals.MALFORMED)
        self.fabric_stats: Counter = Counter()
        self.telemetry_interval = TelemetryInterval()   # how often the nodes iterated over were sampled
        try:
            self._executor = executors.make_executor(executor, self.workers, ray_address)
        except BaseException:
            self.close()
            raise

    def close(self):
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.close()
            self._executor = None
        if self._own_cache:
            shutil.rmtree(self.cache, ignore_errors=True)

    @property
    def in_process(self) -> bool:
        """The work runs in this process (results come back as objects, not through the cache)."""
        return isinstance(self._executor, executors.SerialExecutor)

    def _map(self, fn, argses, labels) -> Iterator:
        """fn(*args) for each args, results in order, on the executor. A node whose work fails for good
        (bad data, as a file the reader refuses) stops the build with a ValueError naming the node and
        the file; with on_error="skip" it yields None for it instead, and `skipped` says why."""
        keep_going = self.on_error == "skip"
        try:
            for result in self._executor.map(fn, argses, labels, keep_going=keep_going):
                if isinstance(result, executors.WorkError):
                    self.skipped[result.label] = str(result)
                    log.warning("dataset %s: node partition %s left out", self.root, result)
                    yield None
                else:
                    yield result
        except executors.WorkError as exc:
            raise ValueError(f"dataset {self.root}, node partition {exc}") from exc

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _cache_path(self, i: int) -> Path:
        return self.cache / f"base-{i:06d}.parquet"

    def pass1(self) -> None:
        self.telemetry_interval = TelemetryInterval()
        dates = {table: ds.table_dates(self.root, table) for table in sg.TABLES}
        # each node's peer inputs wait on disk (bounded memory) until every node's step range is known
        got = {}
        jobs = ((self.root, node, str(self._cache_path(i)), dates) for i, node in enumerate(self.nodes))
        for i, (node, res) in enumerate(zip(self.nodes, self._map(_base_pass, jobs, self.nodes))):
            if res is not None:
                steps, present, own, malformed, (sampled, spread) = res
                self.fabric_stats.update(malformed)
                self.telemetry_interval.add(sampled, spread)
                self._ranges[node] = (int(steps[0]), int(steps[-1]))
                np.savez(self.cache / f"own-{i:06d}.npz", steps=steps, present=present, own=own)
                got[i] = node
            if self.progress:
                self.progress("base signals", i + 1, len(self.nodes))
        if not self.nodes:
            raise ValueError(f"dataset {self.root} has no telemetry: no node partitions of the tables the "
                             f"predictor reads ({', '.join(f'table={t}/' for t in sg.TABLES)}; docs/schema.md)")
        if not self._ranges:
            raise ValueError(f"dataset {self.root} has no telemetry rows for nodes {self.nodes[:5]}")
        first = min(r[0] for r in self._ranges.values())
        last = max(r[1] for r in self._ranges.values())
        self.totals = PeerTotals(first, last)
        # group codes are assigned here, serially in node order: the same codes whatever the workers
        for i, node in got.items():
            with np.load(self.cache / f"own-{i:06d}.npz") as f:
                steps, present, own = f["steps"], f["present"], f["own"]
            idx, labels = self.inventory.rows_at(node, (steps + 1) * STEP_NS)
            codes = []
            for g in ft.PEER_GROUPS:
                c = self.totals.code_rows(g, labels[g], idx)
                self.totals.add(g, c, steps, present, own)
                codes.append(c)
            np.save(self.cache / f"codes-{i:06d}.npy", np.stack(codes).astype(np.int32))
            os.unlink(self.cache / f"own-{i:06d}.npz")
        self.totals.save(self.cache)
        if self.fabric_stats:
            log.warning("dataset %s: fabric readings left out: %s", self.root,
                        ", ".join(f"{n} {r}" for r, n in sorted(self.fabric_stats.items())))
        self.step_time_pass()
        self._run = os.urandom(8).hex()   # names this pass's totals for the workers' cache

    def step_time_pass(self) -> None:
        """The step-time signal of every node with telemetry, a date of step_times at a time, cached per
        node and date (steptimes-<node index>-<date index>.npy: the step, then the signal's values)."""
        index = {node: i for i, node in enumerate(self.nodes) if node in self._ranges}
        for k, date in enumerate(ds.table_dates(self.root, "step_times")):
            try:
                rows = ds.read_table(self.root, "step_times", dates=[date], columns=list(stt.COLUMNS))
            except (OSError, pa.ArrowException) as exc:
                raise ValueError(f"dataset {self.root}, table=step_times/date={date}: {exc}") from exc
            self.step_time_stats["rows"] += rows.num_rows
            got = stt.lagged(self._step_time_chunks(rows))
            if not len(got):
                continue
            order = np.argsort(got.node, kind="stable")
            names = got.node[order]
            starts = np.flatnonzero(np.concatenate([[True], names[1:] != names[:-1]]))
            for a, b in zip(starts, np.append(starts[1:], len(names))):
                i = index.get(names[a])
                if i is None:
                    self.step_time_stats["unknown_node"] += int(b - a)
                    continue
                rows_of = order[a:b]
                np.save(self.cache / f"steptimes-{i:06d}-{k:04d}.npy",
                        np.column_stack([got.step[rows_of].astype(np.float64), got.values[rows_of]]))
        left_out = {r: n for r, n in self.step_time_stats.items() if r in stt.SKIP_REASONS and n}
        if left_out:
            log.warning("dataset %s: step_times rows left out: %s", self.root,
                        ", ".join(f"{n} {r}" for r, n in sorted(left_out.items())))

    def _step_time_chunks(self, rows: pa.Table) -> stt.NodeMinutes:
        """node_minutes of a date's rows, STEP_TIME_CHUNK_STEPS feature steps at a time: a step's signal
        reads its own rows only, so the chunks change no value, and the work arrays stay an hour's."""
        ts = rows.column("ts").cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        chunk = ts // (STEP_NS * STEP_TIME_CHUNK_STEPS)
        order = np.argsort(chunk, kind="stable")
        del ts
        starts = np.flatnonzero(np.concatenate([[True], chunk[order][1:] != chunk[order][:-1]]))
        parts = []
        for a, b in zip(starts, np.append(starts[1:], len(order))):
            parts.append(stt.node_minutes(rows.take(pa.array(order[a:b])), self.step_time_stats))
        return stt.NodeMinutes.concat(parts)

    def _load(self, i: int):
        return _load_cache(self._cache_path(i))

    @property
    def step_range(self) -> tuple[int, int]:
        return self.totals.first, self.totals.first + self.totals.t - 1

    def node_features(self, i: int) -> NodeFeatures:
        return _feature_pass(str(self.cache), self._run, i, self.nodes[i], self.totals.first, self.totals.t,
                             None, self.totals)

    def __iter__(self) -> Iterator[NodeFeatures]:
        if self.totals is None:
            self.pass1()
        todo = [(i, node) for i, node in enumerate(self.nodes) if node in self._ranges]
        via_file = not self.in_process
        jobs = ((str(self.cache), self._run, i, node, self.totals.first, self.totals.t,
                 str(self.cache / f"X-{i:06d}.npy") if via_file else None, None if via_file else self.totals)
                for i, node in todo)
        for (i, node), nf in zip(todo, self._map(_feature_pass, jobs, [node for _, node in todo])):
            if nf is None:
                continue
            if via_file:
                path = self.cache / f"X-{i:06d}.npy"
                nf.X = np.load(path)
                os.unlink(path)
            yield nf
            if self.progress:
                self.progress("features", i + 1, len(self.nodes))


_HASHES: dict[tuple, str] = {}


def dataset_hash(root) -> str:
    """sha256 over every Parquet file of the dataset (relative path and content), in sorted order.

    Remembered for the same files (path, size, modification time): train.py asks twice, and a
    512-node month is 4 GB to read. Read through the dataset's filesystem (a path or a URI: the same
    files give the same hash).
    """
    import hashlib

    r = ds.dataset_root(root)
    infos = r.fs.get_file_info(pafs.FileSelector(r.path, recursive=True, allow_not_found=True))
    prefix = r.path.rstrip("/") + "/"
    files = [(i.path[len(prefix):], i) for i in infos
             if i.type == pafs.FileType.File and ds.data_file(i.base_name) and i.path.startswith(prefix)]
    files.sort(key=lambda f: f[0].split("/"))   # by path component, as pathlib sorts
    stats = tuple((rel, i.size, i.mtime_ns) for rel, i in files)
    key = (r.fs.type_name, r.path, stats)
    got = _HASHES.get(key)
    if got is not None:
        return got
    h = hashlib.sha256()
    for rel, i in files:
        h.update(rel.encode() + b"\0")
        with r.fs.open_input_stream(i.path) as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    if len(_HASHES) >= 8:
        _HASHES.clear()
    _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
