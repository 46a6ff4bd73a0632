"""The collector as a library: one node's sources, swept together into a DatasetWriter (and an uplink).

`Collector.sweep_once(ts_ns)` reads every source once at the same timestamp, buffers the tables in the
DatasetWriter (which writes them as Parquet when its interval closes), hands the sweep's tables to the
optional uplink (whose `submit` never blocks), and records per-source success, duration and errors in a
snapshot that the Prometheus endpoint (foreshock.collectors.metrics) exports. A source that raises is a
failed source for that sweep, never a failed sweep: the others are still read and written. The demo runs
many Collectors (one per simulated node) in one process; `foreshock collect` runs one forever.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import pyarrow as pa

from foreshock import schema as sch
from foreshock.dataset import DatasetWriter

from .base import Source

log = logging.getLogger("foreshock.collectors")


@dataclass
class SourceStatus:
    success: bool = False
    duration_seconds: float = 0.0
    errors: int = 0  # cumulative: the source's own count plus failed sweeps
    failed_sweeps: int = 0
    absent: bool = False
    rows: int = 0  # rows in the last sweep
    unknown_xids: int = 0  # cumulative: Xid events outside the catalogue (foreshock/xid.py)
    folded_xids: int = 0   # cumulative: Xid lines counted into folded rows (collectors/repeats.py)


@dataclass
class Snapshot:
    """What the last sweep did, and the writer's totals: the data behind /metrics."""

    node: str
    sweeps: int = 0
    last_sweep_ts: float = 0.0
    last_sweep_duration_seconds: float = 0.0
    sources: dict[str, SourceStatus] = field(default_factory=dict)
    rows_written: dict[str, int] = field(default_factory=dict)
    files_written: int = 0
    bytes_written: int = 0
    files_dropped: int = 0
    bytes_dropped: int = 0
    write_errors: int = 0
    buffered_rows: int = 0
    spool_bytes: int = 0
    rejected_tables: int = 0
    uplink_submitted: int = 0
    uplink_refused: int = 0
    uplink: dict = field(default_factory=dict)  # the uplink's own stats() (queued, dropped_oldest, ...)


class Collector:
    def __init__(self, node: str, sources: list[Source], writer: DatasetWriter | None, *, uplink=None,
                 clock=time.time_ns):
        self.node = node
        self.sources = sources
        self.writer = writer
        self.uplink = uplink
        self._clock = clock
        self._lock = threading.Lock()
        # Two sources of one kind (say two rdma roots) are reported apart: rdma, rdma#2, ...
        self._labels: list[str] = []
        for s in sources:
            label, k = s.name, 1
            while label in self._labels:
                k += 1
                label = f"{s.name}#{k}"
            self._labels.append(label)
        self._status = {label: SourceStatus() for label in self._labels}
        self._failed = collections.Counter()
        self._sweeps = 0
        self._rejected = 0
        self._uplink_ok = 0
        self._uplink_refused = 0
        self._last = (0.0, 0.0)
        self.last_tables: dict[str, pa.Table] = {}

    def sweep_once(self, ts_ns: int | None = None, *, next_sweep_ns: int = 0) -> dict[str, pa.Table]:
        """Read every source at one timestamp; return the sweep's tables (concatenated per table).

        next_sweep_ns: when the next sweep will be taken at the earliest (wall clock, Unix ns), sent
        to the service as this sweep's watermark; 0 when unknown (a one-off sweep)."""
        ts_ns = self._clock() if ts_ns is None else int(ts_ns)
        t_sweep = time.perf_counter()
        parts: dict[str, list[pa.Table]] = collections.defaultdict(list)
        for label, src in zip(self._labels, self.sources):
            t0 = time.perf_counter()
            ok, rows = True, 0
            try:
                for name, table in src.sweep(ts_ns).items():
                    if not table.num_rows:
                        continue
                    try:
                        table = sch.conform(name, table)
                    except sch.SchemaError as exc:
                        # Rows that do not fit schema v1: refuse that batch whole, keep everything else.
                        self._rejected += 1
                        log.error("source %s: table %s refused: %s", src.name, name, exc)
                        continue
                    parts[name].append(table)
                    rows += table.num_rows
            except Exception as exc:  # noqa: BLE001 - a broken source must not stop the others
                ok = False
                self._failed[label] += 1
                log.exception("source %s failed this sweep: %s", src.name, exc)
            st = self._status[label]
            st.success, st.duration_seconds, st.rows = ok, time.perf_counter() - t0, rows
            st.failed_sweeps = self._failed[label]
            st.errors = src.errors + st.failed_sweeps
            st.absent = src.absent
            st.unknown_xids = src.unknown_xids
            st.folded_xids = src.folder.folded if src.folder is not None else 0
        tables: dict[str, pa.Table] = {}
        for name, ts in parts.items():
            table = ts[0] if len(ts) == 1 else pa.concat_tables(ts, promote_options="none")
            if self.writer is not None:
                self.writer.append_table(name, table)
            tables[name] = table
        if self.writer is not None:
            self.writer.maybe_rotate()
        if self.uplink is not None and tables:
            try:
                # the watermark only when there is one: an uplink may take just the tables
                accepted = (self.uplink.submit(tables, watermark_ns=next_sweep_ns) if next_sweep_ns
                            else self.uplink.submit(tables))
            except Exception as exc:  # noqa: BLE001 - the network side never stops sampling
                accepted = False
                log.warning("uplink submit failed: %s", exc)
            if accepted:
                self._uplink_ok += 1
            else:
                self._uplink_refused += 1
        with self._lock:
            self._sweeps += 1
            self._last = (time.time(), time.perf_counter() - t_sweep)
            self.last_tables = tables
        return tables

    def snapshot(self) -> Snapshot:
        with self._lock:
            snap = Snapshot(node=self.node, sweeps=self._sweeps, last_sweep_ts=self._last[0],
                            last_sweep_duration_seconds=self._last[1],
                            sources={k: SourceStatus(**vars(v)) for k, v in self._status.items()},
                            rejected_tables=self._rejected, uplink_submitted=self._uplink_ok,
                            uplink_refused=self._uplink_refused)
        if self.uplink is not None and hasattr(self.uplink, "stats"):
            try:
                snap.uplink = dict(self.uplink.stats())
            except Exception as exc:  # noqa: BLE001 - health reporting must not fail the scrape
                log.debug("uplink stats: %s", exc)
        w = self.writer
        if w is not None:
            st = w.stats
            snap.rows_written = dict(st.rows_written)
            snap.files_written, snap.bytes_written = st.files_written, st.bytes_written
            snap.files_dropped, snap.bytes_dropped = st.files_dropped, st.bytes_dropped
            snap.write_errors = st.write_errors
            snap.buffered_rows = w.buffered_rows()
            snap.spool_bytes = w.spool_bytes
        return snap

    def _flush_sources(self) -> None:
        ts_ns = self._clock()
        tables: dict[str, list[pa.Table]] = collections.defaultdict(list)
        for src in self.sources:
            try:
                for name, table in src.flush(ts_ns).items():
                    if table.num_rows:
                        tables[name].append(sch.conform(name, table))
            except Exception as exc:  # noqa: BLE001 - one source's leftovers must not cost the others'
                log.warning("source %s: writing what it held at close failed: %s", src.name, exc)
        joined = {name: pa.concat_tables(ts) if len(ts) > 1 else ts[0] for name, ts in tables.items()}
        if not joined:
            return
        if self.writer is not None:
            for name, table in joined.items():
                self.writer.append_table(name, table)
        if self.uplink is not None:
            try:
                self.uplink.submit(joined)
            except Exception as exc:  # noqa: BLE001
                log.warning("uplink submit at close failed: %s", exc)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Flush everything and release every source (the SIGTERM path): what the sources still hold
        (folded Xid counts) is written and handed to the uplink first."""
        try:
            self._flush_sources()
            self.flush()
        finally:
            for src in self.sources:
                try:
                    src.close()
                except Exception as exc:  # noqa: BLE001
                    log.warning("closing source %s: %s", src.name, exc)
