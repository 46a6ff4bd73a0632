"""Each job's recent step times per rank, and the fail-slow rule that reads them.

The migrator reports every rank's step durations (jobs.proto ReportStepTimes, batched: a `StepTime` is
the step, its whole duration, the rank's compute part, from the step's start to its entry into the
gradient all-reduce, and when the step ended by the rank's wall clock). `StepTimes.record` checks a
report and keeps it in the job's window: the last `2 x window` steps by step number, a float32 cell
per (step, rank), so memory is bounded by `MAX_CELLS` over all jobs. A window belongs to one placement
generation of its job: a move, a shrink or a new registration starts it over, so a rank's samples never
follow it to another node.

The rule (`StepTimes.evaluate`, once per policy round, over the jobs that got reports since): at every
step that at least `min_ranks` ranks, and at least half of the job's ranks, have reported, each rank's
time (the compute part, or the whole step) is compared with the job's median at that step and judged
slow or not by foreshock/stepcompare.py, the comparison the predictor's step-time features use too.
A rank is **fail-slow** when it was slow in at least `min_steps` of its last `window` judged steps, and
stays so until fewer than half that many remain. A node is fail-slow in a job when one of its ranks is.
docs/service.md ("Fail-slow") describes it for operators; the settings are `FailSlowSettings`.

With the archive on (`foreshock serve --archive`), the samples a report adds to its window (those its
response counts as accepted) go to the archive as `step_times` rows (schema v1, foreshock/schema.py),
through the archive's bounded queue like every other table: best-effort, dropped and counted when the
queue is full, outside what an ack promises (docs/service.md, "The archive"). A report refused is not
archived, nor are the samples of it that were old or repeated. A row's `ts` is the step's end as the
rank sent it, or, from a migrator that sends none, when the service took the report. The rule itself
reads step numbers only, never these times.

The same rows go to the online scorer (`feed`, the round scheduler's take_checked, in an unsharded
service: service/server.py; in a sharded one the jobs coordinator's `route` sends them to the shards that
run the job, service/steptimefeed.py), whose step-time features (predictor/steptimes.py) compare the
ranks with their job by the same rule. They read the rows, not the windows: the archive keeps the rows, so the
offline features of an archive are the online ones bit for bit, and the windows hold float32.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa

from foreshock import schema as sch
from foreshock import stepcompare

from foreshock.service.errors import (
    FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, ServiceError)
from foreshock.service.jobs import MAX_RANKS, MAX_STEP, check_id, check_node
from foreshock.service.domain import Job

MAX_SAMPLES_PER_REPORT = 1024     # StepTimes in one ReportStepTimes (the migrator sends at most 256)
MAX_STEP_SECONDS = 86_400.0
MAX_CELLS = 32 << 20              # (step, rank) cells kept over all jobs: 256 MiB of float32 pairs
# A step's end (StepTime.end_ns) is the rank's wall clock, checked against the service's wall clock (as
# the telemetry's sample times are, service/ingest.py), not its scoring clock, which the demo runs
# simulated while its job's ranks run on the wall clock. Nodes keep NTP time to milliseconds, so 5
# minutes ahead is a wrong clock, not skew (the telemetry's ts_future default).
MAX_END_AHEAD_SECONDS = 300.0
# A rank sends each step within about two report intervals of its end (FORESHOCK_STEP_REPORT_INTERVAL_S,
# at most 1 h) and never again, so a step that ended over a day before its report means a wrong clock too.
MAX_END_AGE_SECONDS = 86_400.0


@dataclass
class FailSlowSettings:
    """The fail-slow rule's thresholds (module docstring). Each is range-checked here; an error names
    it as `fail_slow_<field>`, the name `foreshock serve` gives it."""

    enabled: bool = True
    ratio: float = stepcompare.RATIO    # the comparison's thresholds (foreshock/stepcompare.py) ...
    min_steps: int = stepcompare.FAIL_SLOW_MIN_STEPS    # slow in at least this many ...
    window: int = stepcompare.FAIL_SLOW_WINDOW          # ... of its last this many judged steps
    min_ranks: int = stepcompare.MIN_RANKS
    mad_k: float = stepcompare.MAD_K
    min_excess_seconds: float = stepcompare.MIN_EXCESS_SECONDS

    _RANGES = {"ratio": (1.05, 10.0), "min_steps": (1, 1024), "window": (2, 1024),
               "min_ranks": (3, MAX_RANKS), "mad_k": (0.0, 100.0), "min_excess_seconds": (0.0, 3600.0)}

    def __post_init__(self):
        for f in fields(self):
            if f.name not in self._RANGES:
                continue
            low, high = self._RANGES[f.name]
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"fail_slow_{f.name} {value!r} must be in [{low:g}, {high:g}]")
            if isinstance(low, int):
                if value != int(value):
                    raise ValueError(f"fail_slow_{f.name} {value!r} must be a whole number")
                setattr(self, f.name, int(value))
        if self.min_steps > self.window:
            raise ValueError(f"fail_slow_min_steps {self.min_steps} must be <= fail_slow_window {self.window}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"fail_slow {self.enabled!r} must be true or false")


@dataclass(frozen=True)
class FailSlow:
    """A node held fail-slow in one job, with its slowest rank's figures over the window."""

    job_id: str
    node: str
    rank: int
    ratio: float          # the rank's median time over the job's median, over its judged steps
    slow_steps: int
    judged_steps: int
    measure: str          # "compute" or "step": what was compared at most of those steps

    def reason(self, s: FailSlowSettings) -> str:
        what = "compute time" if self.measure == "compute" else "step time"
        return (f"fail-slow: rank {self.rank} {what} {self.ratio:.2f}x its job's median, at or above "
                f"{s.ratio:g}x in {self.slow_steps} of its last {self.judged_steps} steps")


class _Window:
    """One job's step times under one placement generation."""

    def __init__(self, job: Job, slots: int):
        self.generation = job.generation
        self.column = {r.rank: i for i, r in enumerate(job.ranks)}
        self.nodes = [r.node for r in job.ranks]
        self.steps = np.full(slots, -1, dtype=np.int64)
        self.total = np.full((slots, len(job.ranks)), np.nan, dtype=np.float32)
        self.compute = np.full((slots, len(job.ranks)), np.nan, dtype=np.float32)
        self.dirty = False

    @property
    def cells(self) -> int:
        return self.total.size


class StepTimes:
    """Per job, a bounded window of step times per rank; the fail-slow rule over it. Thread-safe."""

    def __init__(self, settings: FailSlowSettings, store, *, max_cells: int = MAX_CELLS, archive=None,
                 clock=time.time_ns, feed=None, route=None):
        """`archive`: takes the accepted samples' rows (service/archive.py take_tables), or None;
        `clock`: the service's time (ns), the time of a row whose step came without its end: when the
        report was taken; `feed`: feed(table name, rows) takes them for the online scorer, or None;
        `route`: route(rows, job) takes them for the shards' scorers (the jobs coordinator's), or None."""
        self.settings = settings
        self.store = store
        self.max_cells = max_cells
        self.archive = archive
        self.clock = clock
        self.feed = feed
        self.route = route
        self._windows: dict[str, _Window] = {}
        self._held: dict[tuple[str, str], FailSlow] = {}   # (node, job) -> in alarm
        self._lock = threading.Lock()
        self.samples = {"kept": 0, "old": 0, "repeated": 0}   # old: before the window; repeated: kept already
        self.refused_reports = 0

    def _slots(self) -> int:
        return 2 * self.settings.window   # room for ranks whose reports come a batch late

    # -- reports -------------------------------------------------------------------------------------
    def record(self, job_id: str, rank: int, node: str, samples) -> int:
        """Keep one rank's report: `samples` are (step, step_seconds, compute_seconds, end_ns), end_ns
        0 where the rank sent none. Returns how many were kept. Every field is checked before anything
        is kept; an error names the field."""
        try:
            return self._record(job_id, rank, node, samples)
        except ServiceError:
            with self._lock:
                self.refused_reports += 1
            raise

    def _record(self, job_id: str, rank: int, node: str, samples) -> int:
        check_id("job_id", job_id)
        check_node("node", node)
        samples = list(samples)
        if not samples:
            raise InvalidArgument(f"job {job_id!r} rank {rank}: steps is empty")
        if len(samples) > MAX_SAMPLES_PER_REPORT:
            raise InvalidArgument(f"job {job_id!r} rank {rank}: steps holds {len(samples)} step times; "
                                  f"at most {MAX_SAMPLES_PER_REPORT} per report")
        wall = time.time_ns()
        newest, oldest = wall + int(MAX_END_AHEAD_SECONDS * 1e9), wall - int(MAX_END_AGE_SECONDS * 1e9)
        for i, (step, total, compute, end) in enumerate(samples):
            if not 0 <= step <= MAX_STEP:
                raise InvalidArgument(f"job {job_id!r} rank {rank}: steps[{i}].step {step} out of range")
            if not (math.isfinite(total) and 0 < total <= MAX_STEP_SECONDS):
                raise InvalidArgument(f"job {job_id!r} rank {rank}: steps[{i}].step_seconds {total!r} must "
                                      f"be finite, in (0, {MAX_STEP_SECONDS:g}]")
            if not (math.isfinite(compute) and 0 <= compute <= total):
                raise InvalidArgument(f"job {job_id!r} rank {rank}: steps[{i}].compute_seconds {compute!r} "
                                      f"must be finite, in [0, step_seconds {total!r}]")
            if end and end > newest:
                raise InvalidArgument(f"job {job_id!r} rank {rank}: steps[{i}].end_ns {end} is "
                                      f"{(end - wall) / 1e9:.0f} s ahead of the service's clock; at most "
                                      f"{MAX_END_AHEAD_SECONDS:g} s (check the node's clock)")
            if end and end < oldest:
                raise InvalidArgument(f"job {job_id!r} rank {rank}: steps[{i}].end_ns {end} is "
                                      f"{(wall - end) / 1e9:.0f} s before the service's clock; at most "
                                      f"{MAX_END_AGE_SECONDS:g} s (check the node's clock)")
        job = self.store.find_job(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} is not registered")
        placed = {r.rank: r.node for r in job.ranks}
        if rank not in placed:
            raise InvalidArgument(f"job {job_id!r} has no rank {rank} (ranks 0..{max(placed)})")
        if placed[rank] != node:
            raise FailedPrecondition(f"job {job_id!r} rank {rank} is placed on node {placed[rank]!r}, not "
                                     f"{node!r} (a move not yet known to one side); not kept")
        taken = self.clock()
        with self._lock:
            w = self._windows.get(job_id)
            if w is None or w.generation != job.generation:
                in_use = sum(x.cells for j, x in self._windows.items() if j != job_id)
                if in_use + self._slots() * len(job.ranks) > self.max_cells:
                    raise ResourceExhausted(f"job {job_id!r}: step-time windows are full ({in_use} of "
                                            f"{self.max_cells} cells in use); not kept")
                w = self._windows[job_id] = _Window(job, self._slots())
            col = w.column[rank]
            kept = old = 0
            slots = len(w.steps)
            added = []
            for step, total, compute, end in samples:
                slot = step % slots
                if w.steps[slot] != step:
                    if w.steps[slot] > step:
                        old += 1
                        continue
                    w.steps[slot] = step
                    w.total[slot] = np.nan
                    w.compute[slot] = np.nan
                elif not np.isnan(w.total[slot, col]):
                    continue           # repeated
                w.total[slot, col] = total
                w.compute[slot, col] = compute
                added.append((step, total, compute, end or taken))
                kept += 1
            if kept:
                w.dirty = True
            self.samples["kept"] += kept
            self.samples["old"] += old
            self.samples["repeated"] += len(samples) - kept - old
        if added and (self.archive is not None or self.feed is not None or self.route is not None):
            rows = _rows(job_id, job.generation, rank, node, added)
            if self.archive is not None:
                self.archive.take_tables({"step_times": rows})
            if self.feed is not None:
                self.feed("step_times", rows)
            if self.route is not None:
                self.route(rows, job)
        return kept

    # -- the rule ------------------------------------------------------------------------------------
    def evaluate(self, jobs: list[Job]) -> dict[tuple[str, str], FailSlow]:
        """Judge the jobs with new reports; returns every (node, job) now held fail-slow. `jobs`: the
        registered jobs now (a window of a job gone, or of an older placement, is dropped)."""
        current = {j.job_id: j.generation for j in jobs}
        with self._lock:
            for job_id in [j for j, w in self._windows.items() if current.get(j) != w.generation]:
                del self._windows[job_id]
            for key in [k for k in self._held if k[1] not in self._windows]:
                del self._held[key]
            if not self.settings.enabled:
                self._held.clear()
                return {}
            for job_id, w in self._windows.items():
                if not w.dirty:
                    continue
                w.dirty = False
                before = {k for k in self._held if k[1] == job_id}
                for key in before:
                    del self._held[key]
                self._held.update(self._judge(job_id, w, before))
            return dict(self._held)

    def _judge(self, job_id: str, w: _Window, before: set[tuple[str, str]]) -> dict[tuple[str, str], FailSlow]:
        """The job's (node, job) held fail-slow now; `before`: those held until now (hysteresis)."""
        s = self.settings
        order = np.argsort(-w.steps)
        order = order[w.steps[order] >= 0]
        got = stepcompare.compare(w.total[order], w.compute[order], len(w.nodes), ratio=s.ratio,
                                  min_ranks=s.min_ranks, mad_k=s.mad_k, min_excess_seconds=s.min_excess_seconds)
        x, slow, rel, use_compute = got.x, got.slow, got.ratio, got.use_compute
        if not len(x):
            return {}
        seen = ~np.isnan(x)
        # each rank's last window judged steps (rows are newest first)
        in_window = seen & (np.cumsum(seen, axis=0) <= s.window)
        slow_steps = (slow & in_window).sum(axis=0)
        judged_steps = in_window.sum(axis=0)
        out: dict[tuple[str, str], FailSlow] = {}
        ranks = {col: rank for rank, col in w.column.items()}
        for col in np.flatnonzero(slow_steps > 0).tolist():
            node, rank = w.nodes[col], ranks[col]
            need = max(1, s.min_steps // 2) if (node, job_id) in before else s.min_steps
            if slow_steps[col] < need:
                continue
            rows = in_window[:, col]
            ratio = float(np.median(rel[rows, col]))
            measure = "compute" if use_compute[rows].mean() >= 0.5 else "step"
            verdict = FailSlow(job_id, node, rank, ratio, int(slow_steps[col]), int(judged_steps[col]), measure)
            best = out.get((node, job_id))
            if best is None or verdict.ratio > best.ratio:
                out[(node, job_id)] = verdict
        return out


def _rows(job_id: str, generation: int, rank: int, node: str, added: list[tuple]) -> pa.Table:
    """One rank's accepted samples, (step, step_seconds, compute_seconds, ts_ns), as `step_times` rows; a
    compute part of 0 is one not measured (jobs.proto)."""
    n = len(added)
    steps, totals, computes, ts = zip(*added)
    compute = np.array(computes, dtype=np.float64)
    columns = {
        "ts": pa.array(np.array(ts, dtype=np.int64)).cast(sch.TS),
        "node": pa.array([node] * n, sch.STR),
        "job": pa.array([job_id] * n, sch.STR),
        "generation": pa.array(np.full(n, generation, dtype=np.int64)),
        "rank": pa.array(np.full(n, rank, dtype=np.int32)),
        "step": pa.array(np.array(steps, dtype=np.int64)),
        "step_seconds": pa.array(np.array(totals, dtype=np.float64)),
        "compute_seconds": pa.array(compute, mask=compute == 0.0),
    }
    return pa.Table.from_arrays(list(columns.values()), schema=sch.schema("step_times"))


__all__ = ["StepTimes", "FailSlowSettings", "FailSlow", "MAX_SAMPLES_PER_REPORT", "MAX_END_AHEAD_SECONDS",
           "MAX_END_AGE_SECONDS"]
