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
  placement's nodes the coordinator has heard of (looked up at most every JOB_SHARDS_SECONDS per job); rows of a job none of whose nodes it has heard of yet
  are counted (`unrouted_rows`) and let go. It only appends to a per-shard outbox: nothing on the Jobs
  API's path waits on a shard.
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
from typing import Callable

import pyarrow as pa

from foreshock import schema as sch
from foreshock.ratelimit import LogLimiter

log = logging.getLogger(__name__)

MAX_ROWS_PER_ACK = 16_384      # about 1.2 MB of IPC: under gRPC's default 4 MiB message
BUFFER_ROWS = 200_000          # per shard; a report holds at most 1,024 (steptimes.MAX_SAMPLES_PER_REPORT)
# A job's shards are looked up afresh this often: every rank of a big job reports every few seconds, and
# looking up each of its nodes per report would cost the Jobs API a lookup per rank squared.
JOB_SHARDS_SECONDS = 5.0
MAX_JOBS_CACHED = 4096


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


class StepTimeRouter:
    """Per shard, the accepted step_times rows of the jobs with a node on it, until its next ack (module
    docstring). Counters (read by service/metrics.py), per shard: `sent_rows`, `dropped_rows`; and
    `unrouted_rows`."""

    def __init__(self, shard_of: Callable[[str], str | None], *, buffer_rows: int = BUFFER_ROWS,
                 monotonic=time.monotonic):
        self.shard_of = shard_of
        self._monotonic = monotonic
        self._job_shards: dict[tuple[str, int], tuple[float, tuple[str, ...]]] = {}
        self.buffer_rows = int(buffer_rows)
        self._lock = threading.Lock()
        self._out: dict[str, collections.deque] = {}    # shard -> tables not sent yet, oldest first
        self._rows: dict[str, int] = {}                 # shard -> rows in its outbox
        self.sent_rows: dict[str, int] = {}
        self.dropped_rows: dict[str, int] = {}
        self.unrouted_rows = 0
        self._log = LogLimiter(log)

    def route(self, rows: pa.Table, job) -> None:
        """One accepted report's rows (service/steptimes.py), of `job` (a domain.Job: its placement)."""
        n = rows.num_rows
        key, now = (job.job_id, job.generation), self._monotonic()
        cached = self._job_shards.get(key)
        if cached is not None and now - cached[0] < JOB_SHARDS_SECONDS:
            shards = cached[1]
        else:
            shards = tuple(sorted({s for s in (self.shard_of(r.node) for r in job.ranks) if s}))
            if len(self._job_shards) >= MAX_JOBS_CACHED:
                self._job_shards.clear()
            self._job_shards[key] = (now, shards)
        with self._lock:
            if not shards:
                self.unrouted_rows += n
                return
            for shard in shards:
                out = self._out.setdefault(shard, collections.deque())
                out.append(rows)
                self._rows[shard] = self._rows.get(shard, 0) + n
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


__all__ = ["StepTimeRouter", "encode", "decode", "MAX_ROWS_PER_ACK", "BUFFER_ROWS"]
