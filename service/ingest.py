"""Telemetry ingest: validate streamed sweeps (schema-v1 rows as Arrow IPC) and hand them to scoring.

Wire format: foreshock.v1.SweepBatch (proto/foreshock/v1/telemetry.proto); each TableRows carries one
schema-v1 table (foreshock/schema.py) as an Arrow IPC stream. Validation, per table, refuses with a
machine-readable reason (a Rejection) and changes nothing for that table; the other tables of the batch
are still taken, and the stream goes on:

  unknown_table, bad_schema_version, oversized (bytes or rows), bad_ipc (not an Arrow IPC stream),
  bad_schema (columns or types that do not conform), node_mismatch (rows of another node, or a batch
  from a node other than the stream's or the credential's), ts_future / ts_past (clock or replay
  trouble), nan_value (NaN or infinity: a missing value is null, never NaN), negative_counter,
  bad_batch (no node, no collector id, too many tables).

Fast path: a collector sends the same schema every sweep, so the schema check is cached by the bytes
of the IPC schema message; only a schema never seen before is compared field by field and, where it
differs, conformed (cast) with foreshock.schema.conform.

Fatal events (Xid 48/74/79/..., GPU lost, severity "fatal") and precursors (severity "precursor", a link
going down) wake the scoring loop at once instead of waiting for the next round.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from foreshock import schema as sch
from foreshock.service.jobs import ID_RE, NODE_RE
from foreshock.service.nodes import FatalEvent, NodeBook, Topology

log = logging.getLogger(__name__)

# Xids fatal to the job or node (../shared/reference/signals.md, "Xid catalogue").
FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 95, 119, 120, 136, 140, 155})
PRECURSOR_XIDS = frozenset({63, 92, 137})
COUNTER_UNITS = frozenset({"errors", "count", "bytes", "rows", "replays", "KiB", "J", "probes"})
MAX_TABLES_PER_BATCH = 32


@dataclass(frozen=True)
class Rejection:
    sequence: int
    table: str
    reason: str
    detail: str


@dataclass
class AckResult:
    acked_sequence: int
    credits: int
    rejections: list[Rejection] = field(default_factory=list)
    delay_seconds: float = 0.0


@dataclass
class Session:
    peer: str
    subject: str
    node: str = ""
    collector_id: str = ""
    batches: int = 0
    opened_ns: int = 0


@dataclass
class IngestLimits:
    max_table_bytes: int = 4 << 20
    max_table_rows: int = 100_000
    max_past_seconds: float = 86_400.0
    max_future_seconds: float = 300.0
    credit_window: int = 16
    high_water: int = 20_000            # queued tables in the scoring backlog before acks are held back


class _TableCheck:
    """What to check in one schema-v1 table, derived from its declaration once."""

    def __init__(self, table: str):
        self.schema = sch.schema(table)
        fields = sch.TABLES[table]
        self.floats = [f.name for f in fields if pa.types.is_floating(f.type)]
        self.signed_counters = [f.name for f in fields if f.unit in COUNTER_UNITS and
                                (pa.types.is_signed_integer(f.type) or pa.types.is_floating(f.type))]
        self.ts_columns = [f.name for f in fields if pa.types.is_timestamp(f.type)]


_CHECKS = {name: _TableCheck(name) for name in sch.TABLES}


def _schema_key(buf: bytes) -> bytes | None:
    """Digest of the IPC stream's schema message (continuation marker, length, flatbuffer)."""
    if len(buf) < 8:
        return None
    marker, length = struct.unpack_from("<Ii", buf, 0)
    if marker != 0xFFFFFFFF or not 0 < length <= len(buf) - 8:
        return None
    return hashlib.blake2b(memoryview(buf)[: 8 + length], digest_size=16).digest()


class Ingest:
    """Validates batches and passes the good tables to `sink(node, {table: arrow_table})`."""

    def __init__(self, nodes: NodeBook, sink: Callable[[str, dict[str, pa.Table]], int], *,
                 limits: IngestLimits | None = None, wake: Callable[[str], None] | None = None,
                 clock=time.time_ns):
        self.nodes = nodes
        self.sink = sink
        self.limits = limits or IngestLimits()
        self.wake = wake or (lambda why: None)
        self._clock = clock
        self._lock = threading.Lock()
        self._good_schemas: dict[bytes, str] = {}
        self._last_sequence: dict[str, int] = {}
        self.sessions: set[int] = set()
        self._sessions: dict[int, Session] = {}
        self.accepted_batches = 0
        self.duplicate_batches = 0
        self.gap_batches = 0
        self.accepted_rows: collections.Counter = collections.Counter()
        self.rejected: collections.Counter = collections.Counter()   # reason -> tables (or batches)
        self.bytes_received = 0
        self.backlog = 0

    # -- sessions ------------------------------------------------------------------------------------
    def open_session(self, peer: str, subject: str) -> Session:
        s = Session(peer, subject, opened_ns=self._clock())
        with self._lock:
            self._sessions[id(s)] = s
        return s

    def close_session(self, s: Session) -> None:
        with self._lock:
            self._sessions.pop(id(s), None)

    def connected(self) -> int:
        with self._lock:
            return len(self._sessions)

    # -- batches -------------------------------------------------------------------------------------
    def _reject(self, out: list, sequence: int, table: str, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        out.append(Rejection(sequence, table, reason, detail))

    def _credits(self) -> tuple[int, float]:
        lim = self.limits
        if self.backlog >= lim.high_water:
            return 1, 0.05
        free = 1.0 - self.backlog / lim.high_water
        return max(1, int(lim.credit_window * free)), 0.0

    def accept(self, s: Session, node: str, collector_id: str, sequence: int,
               tables: list[tuple[str, int, bytes]]) -> AckResult:
        """Validate one SweepBatch. Never raises on input: every problem becomes a Rejection."""
        rejections: list[Rejection] = []
        credits, delay = self._credits()
        result = AckResult(sequence, credits, rejections, delay)
        if not node or not NODE_RE.match(node):
            self._reject(rejections, sequence, "", "bad_batch", f"batch {sequence}: node {node[:80]!r} is not a node name")
            return result
        if not collector_id or not ID_RE.match(collector_id):
            self._reject(rejections, sequence, "", "bad_batch",
                         f"batch {sequence} of {node}: collector_id {collector_id[:80]!r} is not a valid id")
            return result
        if s.subject not in ("", "*") and node != s.subject:
            self._reject(rejections, sequence, "", "node_mismatch",
                         f"batch {sequence}: node {node!r}, but the credential is for node {s.subject!r}")
            return result
        if s.node and node != s.node:
            self._reject(rejections, sequence, "", "node_mismatch",
                         f"batch {sequence}: node {node!r} on a stream opened by node {s.node!r}")
            return result
        if s.collector_id and collector_id != s.collector_id:
            self._reject(rejections, sequence, "", "bad_batch",
                         f"batch {sequence}: collector_id changed from {s.collector_id!r} to {collector_id!r} mid-stream")
            return result
        s.node, s.collector_id = node, collector_id
        s.batches += 1
        last = self._last_sequence.get(collector_id, 0)
        if sequence <= last:
            self.duplicate_batches += 1  # a re-send after a reconnect: acknowledged, not ingested twice
            return result
        if sequence > last + 1 and last:
            self.gap_batches += sequence - last - 1
        self._last_sequence[collector_id] = sequence
        if len(tables) > MAX_TABLES_PER_BATCH:
            self._reject(rejections, sequence, "", "bad_batch",
                         f"batch {sequence} of {node}: {len(tables)} tables, at most {MAX_TABLES_PER_BATCH}")
            return result
        now = self._clock()
        self.nodes.seen(node, now)
        good: dict[str, pa.Table] = {}
        for name, version, buf in tables:
            self.bytes_received += len(buf)
            try:
                t = self._table(rejections, sequence, node, name, version, buf, now)
            except Exception as exc:  # never let odd input take the stream down
                log.exception("ingest: unexpected error on table %r of %s", name, node)
                self._reject(rejections, sequence, name[:64], "bad_ipc", f"table {name[:64]!r}: {exc}")
                continue
            if t is not None and t.num_rows:
                if name in good:
                    good[name] = pa.concat_tables([good[name], t])
                else:
                    good[name] = t
        if good:
            self.accepted_batches += 1
            for name, t in good.items():
                self.accepted_rows[name] += t.num_rows
            self._side_effects(node, good, now)
            self.backlog = self.sink(node, good)
        return result

    def _table(self, rejections, sequence, node, name, version, buf, now) -> pa.Table | None:
        lim = self.limits
        check = _CHECKS.get(name)
        if check is None or name == "incidents":
            self._reject(rejections, sequence, name[:64], "unknown_table",
                         f"table {name[:64]!r} is not a telemetry table of schema v1")
            return None
        if version != sch.SCHEMA_VERSION:
            self._reject(rejections, sequence, name, "bad_schema_version",
                         f"table {name!r}: schema_version {version}; this service reads {sch.SCHEMA_VERSION}")
            return None
        if len(buf) > lim.max_table_bytes:
            self._reject(rejections, sequence, name, "oversized",
                         f"table {name!r}: {len(buf)} bytes, at most {lim.max_table_bytes}")
            return None
        key = _schema_key(buf)
        try:
            t = pa.ipc.open_stream(buf).read_all()
        except Exception as exc:
            self._reject(rejections, sequence, name, "bad_ipc", f"table {name!r}: not an Arrow IPC stream: {exc}")
            return None
        if t.num_rows > lim.max_table_rows:
            self._reject(rejections, sequence, name, "oversized",
                         f"table {name!r}: {t.num_rows} rows, at most {lim.max_table_rows}")
            return None
        if key is None or self._good_schemas.get(key) != name:
            if t.schema.equals(check.schema, check_metadata=False):
                if key is not None and len(self._good_schemas) < 4096:
                    self._good_schemas[key] = name
            else:
                try:
                    t = sch.conform(name, t)
                except sch.SchemaError as exc:
                    self._reject(rejections, sequence, name, "bad_schema", str(exc))
                    return None
        if not t.num_rows:
            return t
        if t.column("node").null_count:
            self._reject(rejections, sequence, name, "bad_schema", f"table {name!r}: null node")
            return None
        lo, hi = pc.min_max(t.column("node")).values()
        if lo.as_py() != node or hi.as_py() != node:
            self._reject(rejections, sequence, name, "node_mismatch",
                         f"table {name!r}: rows of node {lo.as_py() if lo.as_py() != node else hi.as_py()!r} "
                         f"in a batch from {node!r}")
            return None
        for col in check.ts_columns:
            mm = pc.min_max(t.column(col).cast(pa.int64()))
            lo_ts, hi_ts = mm["min"].as_py(), mm["max"].as_py()
            if hi_ts is None:
                continue
            if hi_ts > now + lim.max_future_seconds * 1e9:
                self._reject(rejections, sequence, name, "ts_future",
                             f"table {name!r}: {col} {(hi_ts - now) / 1e9:.0f} s in the future "
                             f"(at most {lim.max_future_seconds:.0f} s; check the node's clock)")
                return None
            if col == "ts" and lo_ts < now - lim.max_past_seconds * 1e9:
                self._reject(rejections, sequence, name, "ts_past",
                             f"table {name!r}: ts {(now - lo_ts) / 1e9:.0f} s in the past "
                             f"(at most {lim.max_past_seconds:.0f} s)")
                return None
        for col in check.floats:
            c = t.column(col)
            if c.null_count == len(c):
                continue
            if pc.any(pc.invert(pc.is_finite(c))).as_py():
                self._reject(rejections, sequence, name, "nan_value",
                             f"table {name!r}: column {col!r} holds NaN or infinity (a missing value is null)")
                return None
        for col in check.signed_counters:
            c = t.column(col)
            if c.null_count == len(c):
                continue
            lo_c = pc.min(c).as_py()
            if lo_c is not None and lo_c < 0:
                self._reject(rejections, sequence, name, "negative_counter",
                             f"table {name!r}: counter {col!r} is negative ({lo_c})")
                return None
        return t

    def _side_effects(self, node: str, good: dict[str, pa.Table], now: int) -> None:
        inv = good.get("inventory")
        if inv is not None:
            last = inv.slice(inv.num_rows - 1).to_pylist()[0]
            self.nodes.set_topology(node, Topology(last.get("site") or "", last.get("spine") or "",
                                                   last.get("leaf_switch") or ""))
        ev = good.get("events")
        if ev is not None:
            why = None
            ts_ns = ev.column("ts").cast(pa.int64()).to_pylist()
            for ts_i, row in zip(ts_ns, ev.select(["kind", "severity", "xid", "gpu", "device", "message"]).to_pylist()):
                xid, sev, kind = row["xid"], row["severity"], row["kind"]
                msg = (row["message"] or "").lower()
                if sev == "fatal" or (kind == "xid" and xid in FATAL_XIDS) or kind == "gpu_lost":
                    what = f"Xid {xid}" if kind == "xid" else kind.replace("_", " ")
                    where = f" on GPU {row['gpu']}" if row["gpu"] is not None else \
                        (f" on {row['device']}" if row["device"] else "")
                    self.nodes.record_fatal(FatalEvent(node, ts_i, kind,
                                                       f"{what}{where}", now))
                    why = "fatal"
                elif sev == "precursor" or (kind == "xid" and xid in PRECURSOR_XIDS) or \
                        (kind == "link_state" and "down" in msg):
                    why = why or "precursor"
            if why:
                self.wake(why)
        gpu = good.get("gpu")
        if gpu is not None and pc.any(gpu.column("gpu_lost")).as_py():
            lost = gpu.filter(gpu.column("gpu_lost"))
            self.nodes.record_fatal(FatalEvent(node, lost.column("ts").cast(pa.int64())[0].as_py(), "gpu_lost",
                                               f"GPU {lost.column('gpu')[0].as_py()} lost", now))
            self.wake("fatal")

    def stats(self) -> dict:
        return {"accepted_batches": self.accepted_batches, "duplicate_batches": self.duplicate_batches,
                "gap_batches": self.gap_batches, "rejected": dict(self.rejected),
                "accepted_rows": dict(self.accepted_rows), "bytes_received": self.bytes_received,
                "connected": self.connected(), "backlog": self.backlog}


def finite(x: float) -> bool:
    return math.isfinite(x)
