"""Batch simulation: a cluster over days, written as a schema-v1 Parquet dataset with its incident log.

Runs day by day (a chunk never crosses a UTC date, so each node writes one file per table per date)
and node block by node block, so memory is bounded by one block-day whatever the cluster size. Every
table goes through foreshock.dataset.DatasetWriter, the writer the collectors use. The `incidents`
table holds the ground truth: one row per failure (wide faults name the switch or site, with the nodes
they took out). The `step_times` table holds the simulated jobs' step times (docs/simulator.md, "Step times").
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from foreshock import schema as sch
from foreshock.dataset import DatasetWriter
from foreshock.simulator.faults import DAY, MODES, NS, Episode, FaultSettings, schedule
from foreshock.simulator.model import ClusterModel, job_name, job_runs
from foreshock.simulator.scenarios import World
from foreshock.simulator.topology import Topology

DEFAULT_START = "2026-01-05T00:00:00Z"


def parse_start(text: str) -> int:
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"start time {text!r} is not an ISO 8601 time such as {DEFAULT_START}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp()) * NS


@dataclass
class SimSettings:
    topology: Topology = field(default_factory=Topology)
    days: float = 1.0
    interval_s: float = 60.0
    seed: int = 0
    start_ns: int = parse_start(DEFAULT_START)
    faults: FaultSettings = field(default_factory=FaultSettings)
    block_nodes: int = 32
    world: str = "clean"                          # scenarios.WORLDS
    knobs: dict = field(default_factory=dict)     # single knobs set by a scenario file

    def __post_init__(self):
        if not self.days > 0:
            raise ValueError(f"days must be > 0, got {self.days}")
        if not 1.0 <= self.interval_s <= 86400.0:
            raise ValueError(f"interval must be between 1 s and 1 day, got {self.interval_s}")
        if self.block_nodes < 1:
            raise ValueError(f"block_nodes must be >= 1, got {self.block_nodes}")

    @property
    def end_ns(self) -> int:
        return self.start_ns + int(round(self.days * DAY))

    def make_world(self) -> World:
        return World(self.world, seed=self.seed, n_pods=self.topology.n_leaves, knobs=self.knobs)


@dataclass
class Summary:
    rows: collections.Counter
    incidents: collections.Counter
    recoveries: int
    seconds: float
    bytes_written: int
    files_written: int

    def lines(self) -> list[str]:
        out = [f"rows: {sum(self.rows.values()):,} ("
               + ", ".join(f"{k} {v:,}" for k, v in sorted(self.rows.items())) + ")",
               f"incidents: {sum(self.incidents.values())} ("
               + (", ".join(f"{k} {v}" for k, v in self.incidents.most_common()) or "none") + ")",
               f"degrade-then-recover episodes: {self.recoveries}",
               f"written: {self.files_written:,} files, {self.bytes_written / 1e6:,.1f} MB in {self.seconds:.1f} s"]
        return out


def parquet_options() -> dict[str, dict]:
    """Per-table Parquet encodings for simulated telemetry: cumulative counters and timestamps grow by
    nearly constant steps, so DELTA_BINARY_PACKED stores them in a few bits a row; gauges (floats) are
    byte-stream-split; strings and flags stay dictionary-encoded. Readers need nothing special."""
    out = {}
    for table in ("gpu", "nvlink", "rdma_port", "netdev", "host_net", "path_probe", "step_times"):
        delta, split, dictionary = {}, {}, []
        for f in sch.schema(table):
            if pa.types.is_integer(f.type) or pa.types.is_timestamp(f.type):
                delta[f.name] = "DELTA_BINARY_PACKED"
            elif pa.types.is_floating(f.type):
                split[f.name] = "BYTE_STREAM_SPLIT"
            elif pa.types.is_string(f.type) or pa.types.is_boolean(f.type):
                dictionary.append(f.name)
        # statistics only where readers filter (time), which also saves most of the write time
        out[table] = {"use_dictionary": dictionary, "column_encoding": {**delta, **split},
                      "write_statistics": ["ts"]}
    return out


def describe(ep: Episode) -> str:
    """The incident's description: the mode's, or in a random world 'mode: signature / shape[ / faint]'
    (docs/simulator.md), so evaluation can group by signature and shape."""
    if "signature" not in ep.extra:
        return MODES[ep.mode].description
    faint = " / faint" if ep.extra.get("faint") else ""
    return f"{ep.mode}: {ep.extra['signature']} / {ep.extra['shape']}{faint}"


def inventory(topo: Topology, world: World, seed: int, start_ns: int, end_ns: int) -> pa.Table:
    """The topology's inventory with each node's type (GPU and HCA counts) from the world; where jobs
    change (the world's job_epoch_h), a row per node at the start and at every change, naming its job."""
    types = ClusterModel.node_type_arrays(topo, world)
    epoch_h = float(world.scalar("job_epoch_h"))
    times = [start_ns]
    if epoch_h > 0:
        epoch_ns = int(epoch_h * 3600 * NS)
        times += list(range((start_ns // epoch_ns + 1) * epoch_ns, end_ns, epoch_ns))
    n_slots = max(topo.n_jobs, 1)
    parts = []
    for t in times:
        table = topo.inventory(t)
        columns = {"gpus": pa.array(types["gpus"].astype(np.int16)), "hcas": pa.array(types["hcas"].astype(np.int16))}
        if epoch_h > 0:
            runs = job_runs(topo, world, seed, np.arange(topo.nodes), np.array([t], dtype=np.int64))[:, 0]
            columns["job"] = pa.array([job_name(int(r), n_slots, True) for r in runs], sch.STR)
        for name, values in columns.items():
            i = table.schema.get_field_index(name)
            table = table.set_column(i, table.schema.field(i), values)
        parts.append(table)
    return pa.concat_tables(parts)


def incidents_table(topo: Topology, episodes: list[Episode], start_ns: int, end_ns: int) -> pa.Table:
    rows = []
    for ep in episodes:
        if not ep.fails or not start_ns <= ep.end_ns < end_ns:
            continue
        mode = MODES[ep.mode]
        scope = mode.component if mode.component in ("switch", "site", "nvlink_domain") else "node"
        nodes = [topo.names[n] for n in ep.nodes]
        if mode.component == "gpu":
            component = f"gpu{ep.component}"
        elif mode.component == "hca":
            component = f"{topo.hca_device(ep.component)}/1"
        elif mode.component == "nvlink_domain":
            component = topo.nvswitch_device(ep.component)
        elif scope != "node":
            component = ep.scope_name
        else:
            component = "node"
        rows.append({
            "ts": ep.end_ns, "node": ep.scope_name or nodes[0], "incident_id": ep.episode_id, "scope": scope,
            "affected_nodes": nodes, "category": ep.category, "component": component,
            "description": describe(ep), "has_precursor": mode.precursor,
            "precursor_start": ep.start_ns if mode.precursor else None, "repaired_at": ep.repair_ns,
        })
    return sch.to_table("incidents", rows)


def _node_slices(table: pa.Table):
    """(start, length) of each node's contiguous run of rows (the model writes rows node by node)."""
    if table.num_rows == 0:
        return
    codes = pc.dictionary_encode(table.column("node")).combine_chunks().indices.to_numpy()
    bounds = np.flatnonzero(np.diff(codes)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(codes)]])
    for s, e in zip(starts, ends):
        yield int(s), int(e - s)


def _blocks(settings: SimSettings) -> list[np.ndarray]:
    n, b = settings.topology.nodes, settings.block_nodes
    return [np.arange(b0, min(b0 + b, n)) for b0 in range(0, n, b)]


def _day_chunks(settings: SimSettings) -> list[np.ndarray]:
    step = int(round(settings.interval_s * NS))
    all_ts = np.arange(settings.start_ns, settings.end_ns, step, dtype=np.int64)
    bounds = np.flatnonzero(np.diff(all_ts // DAY)) + 1
    return [c for c in np.split(all_ts, bounds) if c.size]


def print_progress(now: int, start: int, end: int) -> None:
    print(f"  {100.0 * (now - start) / (end - start):5.1f}% simulated", flush=True)


def _simulate_blocks(settings: SimSettings, episodes: list[Episode], out: str, block_ids: list[int],
                     writer_options: dict, progress=None, barrier=None) -> tuple[dict, int, int]:
    """One worker: the given node blocks over the whole span (each block's stream depends only on the
    block, so how blocks are shared among workers does not change the data)."""
    model = ClusterModel(settings.topology, seed=settings.seed, episodes=episodes,
                         difficulty=settings.faults.difficulty, start_ns=settings.start_ns,
                         interval_s=settings.interval_s, world=settings.make_world(), step_times=True)
    # no crash journal: a simulation that dies is run again, and journaling would double its writes
    writer = DatasetWriter(out, fsync=False, max_buffer_rows=1 << 40, journal=False, **writer_options)
    if barrier is not None:
        # A writer clears leftover temporary files when it opens: every worker opens its writer before
        # any of them starts writing, so none clears another's file in flight.
        barrier.wait(timeout=600)
    blocks = _blocks(settings)
    for chunk in _day_chunks(settings):
        for i in block_ids:
            tables = model.generate(blocks[i], chunk)
            for name, table in tables.items():
                if name == "events":
                    writer.write_table(name, table)
                    continue
                for s, n in _node_slices(table):
                    writer.write_table(name, table.slice(s, n))
        if progress:
            progress(int(chunk[-1]), settings.start_ns, settings.end_ns)
    writer.close()
    return dict(writer.stats.rows_written), writer.stats.bytes_written, writer.stats.files_written


def _simulate_on_ray(settings, episodes, out, n_blocks: int, options: dict, workers: int,
                     ray_address: str | None) -> list:
    """Every node block as a Ray task; a block that keeps failing stops the run naming its nodes."""
    from foreshock.predictor import executors

    blocks = _blocks(settings)
    shared = {**options, "clear_leftovers": False}
    labels = [f"nodes {blocks[i][0]}-{blocks[i][-1]}" for i in range(n_blocks)]
    ex = executors.make_executor("ray", workers or (os.cpu_count() or 1), ray_address)
    try:
        return list(ex.map(_simulate_blocks, [(settings, episodes, str(out), [i], shared) for i in range(n_blocks)],
                           labels))
    except executors.WorkError as exc:
        raise RuntimeError(f"simulation under {out}: {exc}") from exc
    finally:
        ex.close()


def run(settings: SimSettings, out: str | Path, *, writer_options: dict | None = None,
        episodes: list[Episode] | None = None, progress=None, workers: int = 0, executor: str = "local",
        ray_address: str | None = None) -> Summary:
    """Simulate and write the dataset under `out`. `episodes` replaces the drawn schedule (tests).

    `workers` processes share the node blocks (0: one per CPU, at most one per block); the data do not
    depend on it. `executor="ray"`: each node block is a Ray task (predictor/executors.py), the same
    function over the same block, so the data are the same; its writer leaves the other tasks'
    temporary files alone, the parent's writer having cleared the leftovers when it opened."""
    t_start = time.perf_counter()
    topo = settings.topology
    start, end = settings.start_ns, settings.end_ns
    world = settings.make_world()
    if episodes is None:
        episodes = schedule(topo, start, end, settings.seed, settings.faults, world)
    options = {"parquet_options": parquet_options(), **(writer_options or {})}
    n_blocks = len(_blocks(settings))
    workers = min(workers or (os.cpu_count() or 1), n_blocks)
    Path(out).mkdir(parents=True, exist_ok=True)
    writer = DatasetWriter(out, fsync=False, journal=False, **options)
    writer.write_table("inventory", inventory(topo, world, settings.seed, start, end))
    rows = collections.Counter()
    bytes_written = files_written = 0
    if executor == "ray":
        results = _simulate_on_ray(settings, episodes, out, n_blocks, options, workers, ray_address)
    elif workers <= 1:
        results = [_simulate_blocks(settings, episodes, str(out), list(range(n_blocks)), options, progress)]
    else:
        from foreshock.predictor.executors import exit_with_parent

        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager, \
                concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=exit_with_parent,
                                                       initargs=(os.getpid(),)) as pool:
            barrier = manager.Barrier(workers)
            # a callback does not cross into a process: the first worker prints the progress itself
            report = print_progress if progress is not None else None
            futures = [pool.submit(_simulate_blocks, settings, episodes, str(out),
                                   list(range(w, n_blocks, workers)), options, report if w == 0 else None, barrier)
                       for w in range(workers)]
            results = [f.result() for f in futures]
    for r, b, f in results:
        rows.update(r)
        bytes_written += b
        files_written += f
    incidents = incidents_table(topo, episodes, start, end)
    writer.write_table("incidents", incidents)
    writer.close()
    rows.update(writer.stats.rows_written)
    cats = collections.Counter(incidents.column("category").to_pylist())
    return Summary(rows=rows, incidents=cats,
                   recoveries=sum(1 for e in episodes if not e.fails and e.start_ns < end and e.end_ns > start),
                   seconds=time.perf_counter() - t_start, bytes_written=bytes_written + writer.stats.bytes_written,
                   files_written=files_written + writer.stats.files_written)
