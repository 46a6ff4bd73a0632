"""The append-only decision log: every policy decision with its reasons, as Parquet (DECISION_SCHEMA).

Layout: `STATE/decisions/date=YYYY-MM-DD/part-<first ts ns>-<writer>-<n>.parquet`, zstd. Files are
only ever added (written under a dot-name, fsynced, renamed: dataset.write_parquet_atomic), never
rewritten, so the log is append-only and a crash never leaves half a file. Rows are buffered (bounded)
and written every `flush_seconds` and on close; each flush's rows then go to the archive, when there is
one (service/archive.py), which derives the incidents from them. What a kill takes from the buffer, the service's state still holds (every
directive is committed to SQLite before anyone hears of it): at start, `catch_up` writes the issue of
each directive the state has and the log lacks, marked `"recovered": true` in `details`.

Kinds: alarm, cleared, evacuate, shrink, checkpoint_exit, cooldown, deferred_max_concurrent,
fabric_incident, fabric_incident_cleared, held_fabric_incident, xid_job_event (one Xid on many nodes of
a job or NVLink domain at once, service/xidcontext.py), fabric_service_down, fabric_service_cleared
(nvidia-fabricmanager or nvidia-imex not serving, service/fabricunits.py), fabric_service_crash_loop,
fabric_service_crash_loop_cleared (one that systemd keeps restarting), drain, ack (accepted, completed, ...),
cancelled, expired; node_action_held, _taken, _failed, _released (service/actions.py).
`incident_rows()` turns fatal and fabric-incident decisions into schema-v1 `incidents` rows, so the log
doubles as incident data for retraining.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads

from foreshock import schema as sch
from foreshock.dataset import write_parquet_atomic
from foreshock.service.domain import DirectiveKind

log = logging.getLogger(__name__)

DECISION_SCHEMA = pa.schema([
    pa.field("ts", pa.timestamp("ns", tz="UTC"), nullable=False),
    pa.field("kind", pa.string(), nullable=False),
    pa.field("node", pa.string()),
    pa.field("job", pa.string()),
    pa.field("directive_id", pa.string()),
    pa.field("risk", pa.float64()),
    pa.field("threshold", pa.float64()),
    pa.field("reason", pa.string()),
    pa.field("to_node", pa.string()),
    pa.field("at_step", pa.int64()),
    pa.field("ranks", pa.list_(pa.int32())),
    pa.field("scope", pa.string()),
    pa.field("nodes", pa.list_(pa.string())),
    pa.field("signals", pa.list_(pa.string())),
    pa.field("model_version", pa.string()),
    pa.field("details", pa.string()),   # JSON of anything else (ack phase seconds, ...)
], metadata={"foreshock.table": "decisions", "foreshock.schema_version": "1"})

_COLUMNS = set(DECISION_SCHEMA.names)


class DecisionLog:
    def __init__(self, root: str | Path, *, flush_seconds: float = 5.0, max_buffer_rows: int = 10_000,
                 model_version: str = "", fsync: bool = True, clock=time.time_ns, archive=None):
        self.root = Path(root)
        self.archive = archive   # gets each flush's rows once they are in the log (service/archive.py)
        self.root.mkdir(parents=True, exist_ok=True)
        self.flush_seconds = flush_seconds
        self.max_buffer_rows = max_buffer_rows
        self.model_version = model_version
        self.fsync = fsync
        self._clock = clock
        self._rows: list[dict] = []
        self._lock = threading.Lock()
        self._id = uuid.uuid4().hex[:8]
        self._seq = 0
        self._last_flush = time.monotonic()
        self.recorded = 0
        self.write_errors = 0
        for tmp in self.root.rglob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    def record(self, kind: str, *, ts_ns: int | None = None, **fields) -> None:
        row = {"ts": ts_ns if ts_ns is not None else self._clock(), "kind": kind,
               "model_version": self.model_version}
        extra = {}
        for k, v in fields.items():
            (row if k in _COLUMNS else extra)[k] = v
        if extra:
            row["details"] = json.dumps(extra, default=str, sort_keys=True)
        with self._lock:
            self._rows.append(row)
            self.recorded += 1
            full = len(self._rows) >= self.max_buffer_rows
        if full:
            self.flush()

    def maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def buffered(self) -> list[dict]:
        with self._lock:
            return list(self._rows)

    def flush(self) -> Path | None:
        with self._lock:
            rows, self._rows = self._rows, []
            self._last_flush = time.monotonic()
            self._seq += 1
            seq = self._seq
        if not rows:
            return None
        try:
            table = pa.Table.from_pylist(rows, schema=DECISION_SCHEMA)
            first = min(r["ts"] for r in rows)
            day = dt.datetime.fromtimestamp(first / 1e9, dt.timezone.utc).strftime("%Y-%m-%d")
            d = self.root / f"date={day}"
            d.mkdir(parents=True, exist_ok=True)
            final = d / f"part-{first}-{self._id}-{seq:06d}.parquet"
            write_parquet_atomic(table, final, fsync=self.fsync, compression="zstd")
        except Exception:
            # Keep the rows for the next attempt rather than lose decisions (bounded by max_buffer_rows).
            self.write_errors += 1
            log.exception("decision log: writing %d rows under %s failed", len(rows), self.root)
            with self._lock:
                self._rows = (rows + self._rows)[-self.max_buffer_rows:]
            return None
        if self.archive is not None:
            self.archive.take_decisions(table)
        return final

    def close(self) -> None:
        self.flush()

    def catch_up(self, directives) -> int:
        """Log the issue of every directive (store.Directive) the log has no issue row of; returns how
        many. The row carries the directive's own time, reason and placement, and its state now."""
        issued = {kind.name.lower() for kind in DirectiveKind}
        files = sorted(str(p) for p in self.root.rglob("part-*.parquet"))
        logged: set[str] = set()
        if files:
            t = pads.dataset(files, schema=DECISION_SCHEMA, format="parquet").to_table(columns=["kind", "directive_id"])
            logged = {i for k, i in zip(t.column("kind").to_pylist(), t.column("directive_id").to_pylist())
                      if k in issued and i}
        missing = [d for d in directives if d.directive_id not in logged]
        for d in missing:
            self.record(d.kind.name.lower(), ts_ns=d.issued_at_ns, node=d.from_node, job=d.job_id,
                        directive_id=d.directive_id, risk=d.risk, reason=d.reason, to_node=d.to_node,
                        at_step=d.at_step, ranks=list(d.ranks), signals=[sig.name for sig in d.signals][:5],
                        recovered=True, state=d.state.name.lower(), origin=d.origin)
        if missing:
            self.flush()
        return len(missing)


def read_decisions(root: str | Path) -> pa.Table:
    root = Path(root)
    files = sorted(str(p) for p in root.rglob("part-*.parquet"))
    if not files:
        return DECISION_SCHEMA.empty_table()
    table = pads.dataset(files, schema=DECISION_SCHEMA, format="parquet").to_table()
    return table.sort_by("ts")


# A fabric incident's scope in the decision log (the topology label) -> the incidents table's scope.
INCIDENT_SCOPES = {"leaf_switch": "switch", "site": "site", "nvlink_domain": "nvlink_domain"}


def incident_rows(decisions: pa.Table) -> pa.Table:
    """Fatal alarms and fabric incidents from the decision log as schema-v1 `incidents` rows."""
    rows = []
    for r in decisions.to_pylist():
        if r["kind"] == "fabric_incident":
            rows.append({"ts": r["ts"], "node": r["node"], "incident_id": f"fabric-{r['node']}-{r['ts'].timestamp():.0f}",
                         "scope": INCIDENT_SCOPES.get(r["scope"], r["scope"]),
                         "affected_nodes": r["nodes"], "category": "fabric", "component": r["node"],
                         "description": r["reason"]})
        elif r["kind"] == "alarm" and (r["reason"] or "").startswith("fatal"):
            rows.append({"ts": r["ts"], "node": r["node"], "incident_id": f"fatal-{r['node']}-{r['ts'].timestamp():.0f}",
                         "scope": "node", "affected_nodes": [r["node"]], "category": "fatal_event",
                         "component": r["node"], "description": r["reason"]})
    return sch.to_table("incidents", rows)
