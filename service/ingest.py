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

Two stages, so that thousands of nodes a second cost little (docs/scaling.md):
- On receipt (in the stream, answered in that batch's ack): the batch's node, collector id, sequence,
  table names, versions and sizes, and the schema. Each stream keeps its tables' last whole schema
  messages (acks say so: SweepAck.schemas_kept), so a collector sends a table's schema once a stream
  and then only its record batches (TableRows.schema_omitted; one omitted before it was ever sent is
  refused as unknown_schema); an old collector's repeated schema costs a memcmp with the stream's last
  one. A schema never seen before is compared field by field (recognised by a digest afterwards) and,
  where it differs, conformed (cast) with foreshock.schema.conform.
- Once per scoring round, vectorised over every batch of a table received since the last round: the
  values (rows of the right node, timestamps, NaN and infinities, negative counters), by the pure
  functions of service/validation.py, here (`take_round`) or in the scoring worker (service/worker.py,
  whose verdicts come back through `apply_verdicts`). A batch that fails is taken out of the round and
  its Rejection rides on the next ack of its stream. Nothing unvalidated reaches the scorer.

A batch with events (Xid 48/74/79/..., a link going down, NIC errors) or a lost GPU wakes the scoring
loop at once instead of waiting for the next round; the round records fatal ones for the policy. Which Xids
are fatal or precursors is the Xid catalogue's call (foreshock/xid.py, `classify`), not the row's. A fatal
or application Xid the catalogue marks collateral goes to the Xid context first (service/xidcontext.py),
which tells one node's fault from a whole job's event; a row the collector folded (`occurrences`,
collectors/repeats.py) counts as that many.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from foreshock import schema as sch
from foreshock import xid as xidcat
from foreshock.service import validation
from foreshock.service.fabricunits import FabricServices, unit_rows
from foreshock.service.fastipc import EOS, BatchDecoder
from foreshock.service.jobs import ID_RE, NODE_RE
from foreshock.service.nodes import FatalEvent, NodeBook, Topology, lost_gpus
from foreshock.service.validation import RawBatch, decode_raw, wire_schema
from foreshock.service.xidcontext import Sighting, XidContext

log = logging.getLogger(__name__)

MAX_TABLES_PER_BATCH = 32
# Tables whose batch the scoring loop acts on at once (a fatal Xid, a link down, a lost GPU, a topology
# change): they skip the bulk drains and never wait for a close hold (steps.CloseHold).
URGENT_TABLES = frozenset({"events", "inventory"})
# Schema-v1 tables no collector sends: the ground truth, and the step times the Jobs API takes
# (ReportStepTimes, service/steptimes.py), which reach the archive that way only.
NOT_TELEMETRY = frozenset({"incidents", "step_times"})
MAX_UNDELIVERED_COLLECTORS = 10_000   # collectors whose stream ended owing them rejections


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
    acting: bool = False   # queued with an on_acted callback: the ack waits until the policy has acted


@dataclass
class Session:
    peer: str
    subject: str
    node: str = ""
    collector_id: str = ""
    batches: int = 0
    opened_ns: int = 0
    deferred: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1000))
    # table -> (its last whole schema message on this stream, whether it is schema v1 as is): later
    # TableRows may omit it (TableRows.schema_omitted)
    heads: dict = field(default_factory=dict)
    closed: bool = False
    queued: int = 0       # batches handed to scoring (the event loop counts) ...
    checked: int = 0      # ... and those whose value checks have run (the scoring thread counts)

    def unchecked(self) -> int:
        return self.queued - self.checked


@dataclass
class Pending:
    """One accepted batch's decoded tables, waiting for the next round's value checks."""
    session: Session
    sequence: int
    node: str
    tables: dict[str, pa.Table | RawBatch]
    received_ns: int
    # Called (from the scoring thread) once the round that took this batch has run the policy and its
    # directives are committed: its stream acknowledges it only then (servicers.TelemetryServicer).
    acted: Callable[[], None] | None = None
    nbytes: int = 0       # the batch's Arrow IPC bytes as received (what the archive's queue counts)


@dataclass
class IngestLimits:
    max_table_bytes: int = 4 << 20
    max_table_rows: int = 100_000
    max_past_seconds: float = 86_400.0
    max_future_seconds: float = 300.0
    credit_window: int = 16
    high_water: int = 20_000            # queued tables in the scoring backlog before acks are held back


def _schema_key(buf: bytes) -> tuple[bytes, int] | None:
    """Digest of the IPC stream's schema message (continuation marker, length, flatbuffer), and where
    the next message starts."""
    if len(buf) < 8:
        return None
    marker, length = struct.unpack_from("<Ii", buf, 0)
    if marker != 0xFFFFFFFF or not 0 < length <= len(buf) - 8:
        return None
    return hashlib.blake2b(memoryview(buf)[: 8 + length], digest_size=16).digest(), 8 + length


class Ingest:
    """Validates batches; each scoring round takes the pending ones (`take_round`) fully checked."""

    def __init__(self, nodes: NodeBook, sink: Callable[[Pending], int], *,
                 limits: IngestLimits | None = None, wake: Callable[[str], None] | None = None,
                 clock=time.time_ns, steps=None, context: XidContext | None = None, archive=None,
                 last_sequences: Mapping[str, int] | None = None, units: FabricServices | None = None):
        self.nodes = nodes
        # Takes the fabric's services' states (service/fabricunits.py); None: they are not judged.
        self.units = units
        # Xids read in context (service/xidcontext.py); None: every fatal Xid is its node's fault at once.
        self.context = context
        # Gets every batch once its value checks have passed (service/archive.py), handed over by reference.
        self.archive = archive
        self.steps = steps       # a steps.StepTracker: the watermarks say when a step's rows are all in
        self.sink = sink
        self.limits = limits or IngestLimits()
        self.wake = wake or (lambda why: None)
        self._clock = clock
        self._lock = threading.Lock()
        self._good_schemas: dict[bytes, tuple[str, bytes]] = {}   # digest -> (table, schema message)
        # collector -> its last batch taken; from the store at a start, so that telemetry taken before a
        # restart is not taken again when its collector re-sends it
        self._last_sequence: dict[str, int] = dict(last_sequences or {})
        self._taken: dict[str, int] = {}                 # collector -> last batch checked, not yet saved
        # (context mark, {collector: its first batch in that round}): batches with collateral Xids the Xid
        # context has not decided; a restart must take them again, so their sequences are not saved yet
        self._holds: collections.deque[tuple[int, dict[str, int]]] = collections.deque()
        self._unsaved: dict[str, int] = {}               # collector -> last batch checked, held back
        self._undelivered: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self._sessions: dict[int, Session] = {}
        self._decoders: dict[str, BatchDecoder] = {}     # table -> its round decoder (fastipc)
        self.accepted_batches = 0
        self.duplicate_batches = 0
        self.gap_batches = 0
        self.accepted_rows: collections.Counter = collections.Counter()
        self.rejected: collections.Counter = collections.Counter()   # reason -> tables (or batches)
        self.bytes_received = 0
        self.backlog = 0
        self.precursors = 0
        self.bad_watermarks = 0

    # -- sessions ------------------------------------------------------------------------------------
    def open_session(self, peer: str, subject: str) -> Session:
        s = Session(peer, subject, opened_ns=self._clock())
        with self._lock:
            self._sessions[id(s)] = s
        return s

    def close_session(self, s: Session) -> None:
        with self._lock:
            self._sessions.pop(id(s), None)
            s.closed = True
            if s.deferred and s.collector_id:
                # Verdicts the stream ended before hearing. The collector may have reconnected before
                # this end was noticed: its live stream takes them on its next ack; else its next stream.
                live = next((o for o in self._sessions.values() if o.collector_id == s.collector_id), None)
                if live is not None:
                    live.deferred.extend(s.deferred)
                    s.deferred.clear()
                    return
                q = self._undelivered.setdefault(s.collector_id, collections.deque(maxlen=1000))
                q.extend(s.deferred)
                s.deferred.clear()
                self._undelivered.move_to_end(s.collector_id)
                while len(self._undelivered) > MAX_UNDELIVERED_COLLECTORS:
                    _, lost = self._undelivered.popitem(last=False)
                    log.warning("%d rejections never delivered (collector gone), e.g. %s", len(lost), lost[0].detail)

    def still_owed(self, s: Session, rejections: list[Rejection]) -> None:
        """Rejections taken for a stream's last ack that could not be written: owed again, first."""
        with self._lock:
            s.deferred.extendleft(reversed(rejections))

    def final_rejections(self, s: Session) -> list[Rejection]:
        """What the stream still owes its collector (at its end, after the last value checks)."""
        out = []
        while s.deferred:
            out.append(s.deferred.popleft())
        return out

    def taken_sequences(self) -> dict[str, int]:
        """Each collector's last batch checked since the last call (for the store), but never one at or
        past a batch whose collateral Xid the Xid context has not decided yet: if the service dies
        before that, the collector's re-sent batch must be taken again, not refused as a duplicate."""
        for cid, seq in self._taken.items():
            if seq > self._unsaved.get(cid, -1):
                self._unsaved[cid] = seq
        self._taken = {}
        while self._holds and (self.context is None or self.context.settled(self._holds[0][0])):
            self._holds.popleft()
        limit: dict[str, int] = {}
        for _, held in self._holds:
            for cid, seq in held.items():
                limit[cid] = min(limit.get(cid, seq), seq)
        out = {}
        for cid, seq in list(self._unsaved.items()):
            if cid not in limit:
                out[cid] = seq
                del self._unsaved[cid]
            elif limit[cid] > 1:
                out[cid] = min(seq, limit[cid] - 1)
        return out

    def last_sequence(self, collector_id: str) -> int | None:
        """The collector's last batch taken (None: none since the start, nor in the store)."""
        return self._last_sequence.get(collector_id)

    def connected(self) -> int:
        with self._lock:
            return len(self._sessions)

    # -- receipt -------------------------------------------------------------------------------------
    def _reject(self, out, sequence: int, table: str, reason: str, detail: str) -> None:
        with self._lock:
            self.rejected[reason] += 1
        out.append(Rejection(sequence, table, reason, detail))

    def _credits(self) -> tuple[int, float]:
        lim = self.limits
        if self.backlog >= lim.high_water:
            return 1, 0.05
        free = 1.0 - self.backlog / lim.high_water
        return max(1, int(lim.credit_window * free)), 0.0

    def accept(self, s: Session, node: str, collector_id: str, sequence: int,
               tables: list[tuple[str, int, bytes] | tuple[str, int, bytes, bool]],
               watermark_ns: int = 0, on_acted: Callable[[], None] | None = None) -> AckResult:
        """Take one SweepBatch: (table, schema_version, arrow_ipc[, schema_omitted]) per TableRows,
        and its watermark (0: none). Never raises on input: every problem becomes a Rejection.
        `on_acted`: for a batch queued with events or topology, called once the policy has acted on
        it (result.acting says it will be)."""
        rejections: list[Rejection] = []
        while s.deferred:  # value-check verdicts on this stream's earlier batches
            rejections.append(s.deferred.popleft())
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
        if not s.collector_id and self._undelivered:
            with self._lock:
                earlier = self._undelivered.pop(collector_id, None)
            if earlier:
                rejections[:0] = list(earlier)
        s.node, s.collector_id = node, collector_id
        s.batches += 1
        last = self._last_sequence.get(collector_id, 0)
        if sequence <= last:
            self.duplicate_batches += 1  # a re-send after a reconnect: acknowledged, not ingested twice
            self._learn_heads(s, tables)  # but its schemas are this stream's, for the batches after it
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
        nbytes = 0
        for name, version, buf, *omitted in tables:
            self.bytes_received += len(buf)
            nbytes += len(buf)
            try:
                t = self._decode(s, rejections, sequence, name, version, buf, bool(omitted and omitted[0]))
            except Exception as exc:  # never let odd input take the stream down
                log.exception("ingest: unexpected error on table %r of %s", name[:64], node)
                self._reject(rejections, sequence, name[:64], "bad_ipc", f"table {name[:64]!r}: {exc}")
                continue
            if isinstance(t, RawBatch):
                if name in good:  # the same table twice in one batch: decode both now
                    t = decode_raw(name, t)
                    if t is None:
                        self._reject(rejections, sequence, name, "bad_ipc", f"table {name!r}: not an Arrow IPC stream")
                        continue
                else:
                    good[name] = t
                    continue
            if t is not None and t.num_rows:
                if name in good:
                    prev = good[name]
                    prev = decode_raw(name, prev) if isinstance(prev, RawBatch) else prev
                    good[name] = pa.concat_tables([prev, t]) if prev is not None else t
                else:
                    good[name] = t
        if good:
            self.accepted_batches += 1
            s.queued += 1
            urgent = not URGENT_TABLES.isdisjoint(good)
            acted = on_acted if urgent else None
            result.acting = acted is not None
            self.backlog = self.sink(Pending(s, sequence, node, good, now, acted, nbytes))
            if urgent:
                # A possible fatal or precursor event (Xid, link down, GPU lost) or a topology change:
                # a round now rather than at the next interval.
                self.wake("events")
        if self.steps is not None:
            lim = self.limits
            if watermark_ns and not (now - lim.max_past_seconds * 1e9 <= watermark_ns
                                     <= now + lim.max_future_seconds * 1e9):
                # Not a time this node could mean: no promise (the step then waits its grace period).
                self.bad_watermarks += 1
                watermark_ns = 0
            # After the batch is queued: a round woken now takes it with the rest of its step.
            if self.steps.note(node, int(watermark_ns), now):
                self.wake("step")
        return result

    def _decode(self, s: Session, rejections, sequence, name, version, buf, omitted=False) -> pa.Table | None:
        lim = self.limits
        if name not in sch.TABLES or name in NOT_TELEMETRY:
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
        known = s.heads.get(name)
        if omitted:
            if known is None:
                self._reject(rejections, sequence, name, "unknown_schema",
                             f"table {name!r}: schema omitted, but this stream has not sent it whole; send it whole")
                return None
            body = buf[:-8] if buf.endswith(EOS) else buf
            if len(body) < 16 or body[:4] != b"\xff\xff\xff\xff":
                self._reject(rejections, sequence, name, "bad_ipc",
                             f"table {name!r}: not the record batch messages of an Arrow IPC stream")
                return None
            if known[1]:
                return RawBatch(known[0], body)   # decoded in the round with the table's other batches
            buf = known[0] + body + EOS          # a schema that needs conforming: the general way
        elif known is not None and known[1] and buf.startswith(known[0]) and buf.endswith(EOS) \
                and len(buf) >= len(known[0]) + 16 and buf[len(known[0]):len(known[0]) + 4] == b"\xff\xff\xff\xff":
            return RawBatch(known[0], buf[len(known[0]):-8])   # the stream's schema again: one memcmp
        else:
            key = _schema_key(buf)
            good = self._good_schemas.get(key[0]) if key is not None else None
            if good is not None and good[0] == name and buf.endswith(EOS) \
                    and len(buf) >= key[1] + 16 and buf[key[1]:key[1] + 4] == b"\xff\xff\xff\xff":
                s.heads[name] = (good[1], True)
                return RawBatch(good[1], buf[key[1]:-8])
        try:
            t = pa.ipc.open_stream(buf).read_all()
        except Exception as exc:
            self._reject(rejections, sequence, name, "bad_ipc", f"table {name!r}: not an Arrow IPC stream: {exc}")
            return None
        key = None if omitted else _schema_key(buf)
        wire = wire_schema(name)
        if t.schema.equals(wire, check_metadata=False):
            if key is not None:
                head = buf[:key[1]]
                if len(self._good_schemas) < 4096:
                    head = self._good_schemas.setdefault(key[0], (name, head))[1]   # one object per schema
                s.heads[name] = (head, True)
            t = t.cast(wire)
        else:
            try:
                t = sch.conform(name, t).cast(wire)
            except sch.SchemaError as exc:
                self._reject(rejections, sequence, name, "bad_schema", str(exc))
                return None
            if key is not None:
                s.heads[name] = (buf[:key[1]], False)
        if t.num_rows > lim.max_table_rows:
            self._reject(rejections, sequence, name, "oversized",
                         f"table {name!r}: {t.num_rows} rows, at most {lim.max_table_rows}")
            return None
        return t

    def _learn_heads(self, s: Session, tables) -> None:
        for name, _version, buf, *omitted in tables:
            if omitted and omitted[0]:
                continue
            key = _schema_key(buf)
            good = self._good_schemas.get(key[0]) if key is not None else None
            if good is not None and good[0] == name:
                s.heads[name] = (good[1], True)

    # -- the round's value checks (service/validation.py) -------------------------------------------
    def _checked(self, items: list[Pending]) -> None:
        taken = self._taken
        for item in items:
            item.session.checked += 1
            cid = item.session.collector_id
            if cid and item.sequence > taken.get(cid, 0):
                taken[cid] = item.sequence

    def take_round(self, items: list[Pending]) -> dict[str, pa.Table]:
        """Decode and check the values of every pending batch at once, per table; return what passed.
        The verdicts go onto the batches' streams (Session.deferred), each batch counts as checked on
        its stream, and what the events and topology say is acted on."""
        try:
            now = self._clock()
            checked = validation.check_round(items, now, self.limits, self._decoders)
            for v in checked.verdicts:
                self._defer(items[v.part], v.table, v.reason, v.detail)
            out = checked.tables
            with self._lock:
                self.accepted_rows.update(checked.rows)
            mark = self.context.mark() if self.context is not None else 0
            self.act_on_events(out, now)
            if self.context is not None and self.context.mark() != mark:
                held: dict[str, int] = {}
                for item in items:
                    cid = item.session.collector_id
                    if cid and "events" in item.tables:
                        held[cid] = min(held.get(cid, item.sequence), item.sequence)
                self._holds.append((self.context.mark(), held))
            if self.archive is not None:
                self.archive.take_tables(out)
            return out
        finally:
            self._checked(items)

    def _defer(self, item: Pending, table: str, reason: str, detail: str) -> None:
        rejection = Rejection(item.sequence, table, reason, detail)
        s = item.session
        with self._lock:
            self.rejected[reason] += 1
            if getattr(s, "closed", False) and s.collector_id:
                # Its stream is gone: the verdict waits for the collector's next stream.
                q = self._undelivered.setdefault(s.collector_id, collections.deque(maxlen=1000))
                q.append(rejection)
                self._undelivered.move_to_end(s.collector_id)
                while len(self._undelivered) > MAX_UNDELIVERED_COLLECTORS:
                    self._undelivered.popitem(last=False)
                return
        s.deferred.append(rejection)

    def apply_verdicts(self, items: list[Pending], reply: dict) -> None:
        """The scoring worker's answer on a drain (service/worker.py): each refused table's Rejection
        onto its stream's next ack, the rows taken, the GPUs found lost. None: the worker failed on it."""
        if reply is None:
            for item in items:
                item.session.checked += 1
            return
        self._checked(items)
        for i, table, reason, detail in reply["verdicts"]:
            self._defer(items[i], table, reason, detail)
        if self.archive is not None:
            self.archive.take_batches(items, reply["verdicts"], sum(item.nbytes for item in items),
                                      packed=reply.get("packed"))
        with self._lock:
            self.accepted_rows.update(reply["rows"])
        for event in reply["lost"]:
            self.nodes.record_fatal(event)
        if self.units is not None and reply.get("units"):
            self.units.observe(reply["units"], self._clock())

    def act_on_events(self, good: dict[str, pa.Table], now: int) -> None:
        """The events stage: what checked tables say that cannot wait for a step to close, acted on at
        once. Inventory rows set each node's topology; the fabric's services' states go to their judge
        (service/fabricunits.py); fatal Xids (classified by foreshock/xid.py, a
        collateral one first weighed by the Xid context with its job's other nodes) and lost GPUs
        become fatal alarms; precursor Xids and link-downs are counted. `good`: table name -> the rows
        that passed the value checks; `now`: the round's time (ns)."""
        inv = good.get("inventory")
        if inv is not None:
            for row in inv.select(["node", "site", "spine", "leaf_switch", "nvlink_domain", "job"]).to_pylist():
                self.nodes.set_topology(row["node"], Topology(row["site"] or "", row["spine"] or "",
                                                              row["leaf_switch"] or "", row["nvlink_domain"] or "",
                                                              row["job"] or ""))
        units = good.get("systemd_unit")
        if units is not None and self.units is not None:
            self.units.observe(unit_rows(units), now)
        ev = good.get("events")
        if ev is not None:
            ts_ns = ev.column("ts").cast(pa.int64()).to_pylist()
            first = ev.column("first_ts").cast(pa.int64()).to_pylist()
            last = ev.column("last_ts").cast(pa.int64()).to_pylist()
            for ts_i, first_i, last_i, row in zip(ts_ns, first, last, ev.select(
                    ["node", "kind", "source", "severity", "xid", "gpu", "pci_bus_id", "device", "message",
                     "occurrences"]).to_pylist()):
                xid, sev, kind = row["xid"], row["severity"], row["kind"]
                msg = (row["message"] or "").lower()
                # A folded row (collectors/repeats.py) stands for `occurrences` lines, the last at last_ts.
                n = max(row["occurrences"] or 1, 1)
                when = min(last_i, ts_i) if last_i is not None else ts_i   # a folded row is written after its lines
                if kind == "gpu_lost" and row["source"] == "kmsg":
                    xid = xidcat.FALLEN_OFF_THE_BUS   # the kernel's line is the report Xid 79 is
                if kind == "xid":
                    # The catalogue decides, whatever severity the sender wrote: an unknown Xid alarms no one.
                    sev = xidcat.classify(xid, sev)
                    if self.context is not None and xid is not None:
                        said = self.context.xid_seen(row["node"], row["pci_bus_id"] or row["gpu"], xid,
                                                     first_i if first_i is not None else ts_i, when)
                        if said:
                            log.warning("%s", said)
                if sev == "fatal" or kind == "gpu_lost":
                    what = f"Xid {xid}" if kind == "xid" else kind.replace("_", " ")
                    device = row["device"] or row["pci_bus_id"]
                    where = f" on GPU {row['gpu']}" if row["gpu"] is not None else (f" on {device}" if device else "")
                    fatal = FatalEvent(row["node"], when, kind, f"{what}{where}", now)
                    if self.context is not None and xidcat.lookup(xid).collateral:
                        # Perhaps one node among many of a job at its end: the context decides
                        # (service/xidcontext.py); it answers at once only when it cannot wait.
                        fatal = self.context.observe(Sighting(row["node"], when, xid, fatal))
                    if fatal is not None:
                        self.nodes.record_fatal(fatal)
                elif sev == "precursor" or (kind == "link_state" and "down" in msg):
                    self.precursors += n
                elif kind == "xid" and sev == "application" and self.context is not None and \
                        xidcat.lookup(xid).collateral:
                    # No alarm either way; seen with its job's other nodes it is recorded as the job's event.
                    self.context.observe(Sighting(row["node"], when, xid, None))
        gpu = good.get("gpu")
        if gpu is not None:
            for event in lost_gpus(gpu, now):
                self.nodes.record_fatal(event)

    def stats(self) -> dict:
        return {"accepted_batches": self.accepted_batches, "duplicate_batches": self.duplicate_batches,
                "gap_batches": self.gap_batches, "rejected": dict(self.rejected),
                "accepted_rows": dict(self.accepted_rows), "bytes_received": self.bytes_received,
                "connected": self.connected(), "backlog": self.backlog}
