"""The jobs' step times to the shards' scorers: in a sharded control plane the Jobs API (ReportStepTimes)
runs on the jobs coordinator, which scores nothing, while the shards score the telemetry. The
coordinator's accepted `step_times` rows (schema v1, foreshock/schema.py; built by service/steptimes.py)
ride Coordinator.ForwardAlarms' acks to the shards (proto/foreshock/v1/coordinator.proto ForwardAck
`step_times`: one Arrow IPC stream of rows, `encode` / `decode`; the shard's side is
service/forwarder.py, which hands them to its round scheduler as an unsharded service's Jobs API does).

- Where the comparison runs: a job's ranks span shards, and the job-relative comparison
  (foreshock/stepcompare.py) needs every rank of a job's step. So a shard is sent every row of each job
  with a node on it, its other shards' ranks included, and its scorer judges them exactly as offline
  (predictor/steptimes.py `node_minutes` over the same rows), keeping the values of its own nodes; the
  rows of the job's nodes elsewhere only make the median (the scorer counts those nodes'
  values as `step_times_unknown_node`). No per-node value is computed here: the shard's features are
  offline's from the same rows, bit for bit.
- `StepTimeRouter.route` (called by StepTimes as it accepts a report, on the Jobs API's thread): a
  node's shard is the one that last forwarded an event about it (Coordinator.shard_of: every scored
  node's risk summary names it every summary_seconds), so a job is sent to the shards of its
  placement's nodes the coordinator has heard of (looked up at most every JOB_SHARDS_SECONDS per job).
  It only appends to a per-shard outbox: nothing on the Jobs API's path waits on a shard.
- A node the coordinator has not heard of yet (a new node: its shard scores it from its second feature
  step and names it in the risk summary after that, a minute or two in) has a shard the coordinator
  cannot work out itself: the shard map places by leaf switch and inventory labels
  (service/shardmap.py), the coordinator holds no map (it takes no telemetry), a job's placement names
  nodes only, and the map file changes while serving. So the rows of such a node's job are held, each
  report's once however many of the job's nodes wait on them, with the nodes still waiting and the
  shards that have the rows already; when the coordinator applies a shard's events about the node
  (`placed`, called by Coordinator.receive after its commit, so the same ack carries them) they go to
  that shard's outbox, unless it had them (another node of the job is on it), and the node's shard
  judges them from every rank's rows, as offline does. The hold is bounded: `hold_rows` in all (past it
  the oldest go) and `hold_seconds` from arrival (at most MAX_HOLD_SECONDS). Longer is of no use: a
  shard's scorer takes a minute's rows until the minute OPEN_STEPS after it closes
  (predictor/steptimes.py) and drops later ones as late, so a row, which ended before it arrived, is late
  everywhere (OPEN_STEPS + 1) minutes after arriving. Rows let go before their node's shard was heard
  of are counted (`unrouted_rows` by reason: "expired", as for a node no shard scores, or "full"). Rows
  of a new node's very first minute still reach its shard late: the round that first scores the node,
  which the risk summary naming it follows, is the one that closes the minute after, so its scorer
  counts them as `late_step_times`; from the node's second minute on its job's rows are judged.
  Holding rather than sending the job's rows to every shard meanwhile: a node no shard ever scores (no
  collector on it) would have its job's rows sent to, and judged by, every shard for as long as it runs.
- The outboxes are bounded (`buffer_rows` per shard): past it the oldest report's rows go, counted per
  shard (`dropped_rows`), so a shard that is down or slow costs memory up to the bound and loses its
  oldest rows, never the service's time. `take` gives a shard's ack at most MAX_ROWS_PER_ACK rows, and
  says whether more wait (the shard asks again at once).
- Step times are best effort, as the archive's: outside what an ack's `acked_sequence` promises. Rows
  on an ack the stream loses, and rows that wait while the coordinator's leadership moves, are not sent
  again; each is counted where it is lost (sent here, received or refused on the shard).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import pyarrow as pa

from foreshock import schema as sch
from foreshock.predictor import signals as sg
from foreshock.predictor import steptimes as stt
from foreshock.ratelimit import LogLimiter

log = logging.getLogger(__name__)

MAX_ROWS_PER_ACK = 16_384      # about 1.2 MB of IPC: under gRPC's default 4 MiB message
BUFFER_ROWS = 200_000          # per shard; a report holds at most 1,024 (steptimes.MAX_SAMPLES_PER_REPORT)
# A job's shards are looked up afresh this often: every rank of a big job reports every few seconds, and
# looking up each of its nodes per report would cost the Jobs API a lookup per rank squared.
JOB_SHARDS_SECONDS = 5.0
MAX_JOBS_CACHED = 4096
# Rows held for nodes whose shard is not known yet (module docstring). A scorer takes a row until the
# minute OPEN_STEPS after the row's own closes, at most (OPEN_STEPS + 1) minutes after the row's minute
# began, which was before the row arrived: past MAX_HOLD_SECONDS from its arrival a row is late at any
# scorer, and holding it longer holds only memory. The rows bound: a new 512-node job of 8 ranks at a
# step a second reports about 4,000 rows a second, and its nodes are known a minute or two in.
MAX_HOLD_SECONDS = float((stt.OPEN_STEPS + 1) * sg.STEP_SECONDS)
HOLD_SECONDS = MAX_HOLD_SECONDS
HOLD_ROWS = 200_000
UNROUTED_REASONS = ("expired", "full")


def encode(rows: pa.Table) -> bytes:
    """step_times rows -> one Arrow IPC stream (ForwardAck.step_times)."""
    return sch.ipc_stream(rows)


def decode(data: bytes) -> pa.Table:
    """ForwardAck.step_times -> schema-v1 step_times rows; ValueError when they are not that (bad IPC,
    another table's columns, too many rows)."""
    try:
        rows = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"step_times: not an Arrow IPC stream ({exc})") from None
    if rows.num_rows > MAX_ROWS_PER_ACK:
        raise ValueError(f"step_times: {rows.num_rows} rows on one ack; at most {MAX_ROWS_PER_ACK}")
    try:
        return sch.conform("step_times", rows)
    except (sch.SchemaError, pa.ArrowException) as exc:
        raise ValueError(f"step_times: {exc}") from None


@dataclass(eq=False)
class _Held:
    """One report's rows, held for the nodes of its job whose shard is not known yet."""
    rows: pa.Table
    at: float                 # monotonic, when it arrived
    nodes: set[str]           # still waiting for their shard
    shards: set[str]          # the shards that have these rows (an outbox took them)


class StepTimeRouter:
    """Per shard, the accepted step_times rows of the jobs with a node on it, until its next ack; and the
    rows held for nodes whose shard is not known yet (module docstring). Counters (read by
    service/metrics.py), per shard: `sent_rows`, `dropped_rows`, `released_rows` (held rows released
    to it); and `unrouted_rows` by reason (UNROUTED_REASONS)."""

    def __init__(self, shard_of: Callable[[str], str | None], *, buffer_rows: int = BUFFER_ROWS,
                 hold_rows: int = HOLD_ROWS, hold_seconds: float = HOLD_SECONDS, monotonic=time.monotonic):
        self.shard_of = shard_of
        self._monotonic = monotonic
        # (job, generation) -> (when looked up, the shards of its known nodes, its nodes of no known shard)
        self._job_shards: dict[tuple[str, int], tuple[float, tuple[str, ...], frozenset[str]]] = {}
        self.buffer_rows = int(buffer_rows)
        self.hold_rows = int(hold_rows)
        self.hold_seconds = float(hold_seconds)
        self._lock = threading.Lock()
        self._out: dict[str, collections.deque] = {}    # shard -> tables not sent yet, oldest first
        self._rows: dict[str, int] = {}                 # shard -> rows in its outbox
        self._held: collections.deque[_Held] = collections.deque()   # oldest first; each waits on a node
        self._held_by_node: dict[str, collections.deque[_Held]] = {}  # node -> what waits on it, oldest first
        self._held_rows = 0
        self.sent_rows: dict[str, int] = {}
        self.dropped_rows: dict[str, int] = {}
        self.released_rows: dict[str, int] = {}
        self.unrouted_rows = dict.fromkeys(UNROUTED_REASONS, 0)
        self._log = LogLimiter(log)

    def route(self, rows: pa.Table, job) -> None:
        """One accepted report's rows (service/steptimes.py), of `job` (a domain.Job: its placement)."""
        key, now = (job.job_id, job.generation), self._monotonic()
        cached = self._job_shards.get(key)
        if cached is not None and now - cached[0] < JOB_SHARDS_SECONDS:
            _, shards, unknown = cached
        else:
            owner = {r.node: self.shard_of(r.node) for r in job.ranks}
            shards = tuple(sorted({s for s in owner.values() if s}))
            unknown = frozenset(n for n, s in owner.items() if not s)
            if len(self._job_shards) >= MAX_JOBS_CACHED:
                self._job_shards.clear()
            self._job_shards[key] = (now, shards, unknown)
        with self._lock:
            self._expire(now)
            for shard in shards:
                self._enqueue(shard, rows)
            if unknown:
                self._hold(_Held(rows, now, set(unknown), set(shards)))

    def placed(self, shard: str, nodes: Iterable[str]) -> None:
        """`shard` forwarded events about `nodes` (Coordinator.receive, once they are applied): the rows
        held for any of them go to its outbox, unless it has them already."""
        with self._lock:
            self._expire(self._monotonic())
            if not self._held_by_node:
                return
            released = finished = 0
            for node in nodes:
                waited = self._held_by_node.pop(node, None)
                if waited is None:
                    continue
                # the jobs' cached views name the node unknown: their shards are looked up afresh
                self._job_shards.clear()
                for held in waited:
                    held.nodes.discard(node)
                    if shard not in held.shards:
                        held.shards.add(shard)
                        self._enqueue(shard, held.rows)
                        released += held.rows.num_rows
                    if not held.nodes:
                        self._held_rows -= held.rows.num_rows
                        finished += 1
            if released:
                self.released_rows[shard] = self.released_rows.get(shard, 0) + released
            if finished:
                self._held = collections.deque(h for h in self._held if h.nodes)

    def held(self) -> int:
        """Rows held for nodes whose shard is not known yet (each report's once)."""
        with self._lock:
            self._expire(self._monotonic())
            return self._held_rows

    def _hold(self, held: _Held) -> None:
        n = held.rows.num_rows
        if self.hold_seconds <= 0:
            self._unrouted("expired", n, held.nodes)
            return
        self._held.append(held)
        self._held_rows += n
        for node in held.nodes:
            self._held_by_node.setdefault(node, collections.deque()).append(held)
        while self._held_rows > self.hold_rows:
            self._let_go(self._held.popleft(), "full")

    def _expire(self, now: float) -> None:
        while self._held and now - self._held[0].at >= self.hold_seconds:
            self._let_go(self._held.popleft(), "expired")

    def _let_go(self, held: _Held, reason: str) -> None:
        """The oldest held rows, not released to every node they waited for."""
        for node in held.nodes:
            # everything older that waited on the node has gone before it, released or let go
            waiting = self._held_by_node[node]
            waiting.popleft()
            if not waiting:
                del self._held_by_node[node]
        self._held_rows -= held.rows.num_rows
        self._unrouted(reason, held.rows.num_rows, held.nodes)

    def _unrouted(self, reason: str, n: int, nodes: Iterable[str]) -> None:
        self.unrouted_rows[reason] += n
        why = (f"their shard not heard of within {self.hold_seconds:g} s" if reason == "expired"
               else f"over {self.hold_rows} rows held")
        self._log.warning(("unrouted", reason), "step times: %d rows of a job with nodes of no known shard (%s) "
                          "let go, %s; %d so far", n, ", ".join(sorted(nodes)[:5]), why, self.unrouted_rows[reason])

    def _enqueue(self, shard: str, rows: pa.Table) -> None:
        out = self._out.setdefault(shard, collections.deque())
        out.append(rows)
        self._rows[shard] = self._rows.get(shard, 0) + rows.num_rows
        dropped = 0
        while self._rows[shard] > self.buffer_rows and out:
            gone = out.popleft().num_rows
            self._rows[shard] -= gone
            dropped += gone
        if dropped:
            self.dropped_rows[shard] = self.dropped_rows.get(shard, 0) + dropped
            self._log.warning(("drop", shard), "step times for shard %s: %d rows wait (it is down or "
                              "not asking); dropped the oldest %d, %d so far", shard, self._rows[shard],
                              dropped, self.dropped_rows[shard])

    def take(self, shard: str) -> tuple[pa.Table | None, bool]:
        """(the oldest rows waiting for `shard`, at most MAX_ROWS_PER_ACK; None when none wait), and
        whether more wait after them."""
        with self._lock:
            out = self._out.get(shard)
            if not out:
                return None, False
            parts, n = [], 0
            while out and (not parts or n + out[0].num_rows <= MAX_ROWS_PER_ACK):
                t = out.popleft()
                parts.append(t)
                n += t.num_rows
            self._rows[shard] -= n
            self.sent_rows[shard] = self.sent_rows.get(shard, 0) + n
            more = bool(out)
        return (parts[0] if len(parts) == 1 else pa.concat_tables(parts)), more

    def waiting(self) -> dict[str, int]:
        """shard -> rows in its outbox."""
        with self._lock:
            return dict(self._rows)


__all__ = ["StepTimeRouter", "encode", "decode", "MAX_ROWS_PER_ACK", "BUFFER_ROWS", "HOLD_ROWS",
           "HOLD_SECONDS", "MAX_HOLD_SECONDS", "UNROUTED_REASONS"]
