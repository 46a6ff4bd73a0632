"""Jobs and directives as domain operations: validation, the durable store, and watchers to notify.

`JobDirectory` is what the Jobs servicer calls (after translating protobuf into these types) and what
the policy issues directives through. Every operation validates its input first and raises a
`foreshock.service.errors` error naming the bad field; nothing is written unless all of it is valid.
Watchers subscribe per job; a directive is stored (committed) before any watcher hears of it, so what a
job has seen is always durable.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable

from foreshock.service.errors import InvalidArgument, NotFound, PermissionDenied
from foreshock.service.domain import (
    ACTIVE_STATES, AckPhase, AckRecord, Directive, DirectiveKind, DirectiveState, Fallback, Job, Rank)
from foreshock.service.store import StateStore

log = logging.getLogger(__name__)

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}$")
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")
MAX_RANKS = 131_072
MAX_GPUS_PER_RANK = 64
MAX_SPARES = 4096
MAX_REASON = 4096
MAX_STEP = 2**63 - 1


def check_id(what: str, value: str) -> str:
    if not isinstance(value, str) or not ID_RE.match(value):
        raise InvalidArgument(f"{what} {value!r} is not a valid id (1-128 characters of A-Za-z0-9._:@/+-)")
    return value


def check_node(what: str, value: str) -> str:
    if not isinstance(value, str) or not NODE_RE.match(value):
        raise InvalidArgument(f"{what} {value!r} is not a valid node name (1-253 characters of A-Za-z0-9._:-)")
    return value


def check_text(what: str, value: str, limit: int = MAX_REASON) -> str:
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {limit}")
    return value


Listener = Callable[[Directive], None]


class JobDirectory:
    """Registrations, step reports, directives and acknowledgements over a StateStore."""

    def __init__(self, store: StateStore, *, default_max_concurrent: int = 1, clock=time.time_ns,
                 on_change: Iterable[Callable[[str, Directive, str], None]] = ()):
        self.store = store
        self.default_max_concurrent = default_max_concurrent
        self._clock = clock
        self._lock = threading.Lock()
        self._listeners: dict[str, dict[int, Listener]] = {}
        self._next = 0
        self.on_change = list(on_change)   # (event, directive, detail) after each change is committed
        self.on_deregister: list[Callable[[Job], None]] = []   # the job as it was, once it has left
        self._held = threading.local()    # inside issuing(): announcements wait for the commit

    # -- watchers ------------------------------------------------------------------------------------
    def subscribe(self, job_id: str, listener: Listener) -> int:
        with self._lock:
            self._next += 1
            self._listeners.setdefault(job_id, {})[self._next] = listener
            return self._next

    def unsubscribe(self, job_id: str, token: int) -> None:
        with self._lock:
            subs = self._listeners.get(job_id, {})
            subs.pop(token, None)
            if not subs:
                self._listeners.pop(job_id, None)

    def watchers(self) -> dict[str, int]:
        with self._lock:
            return {job: len(subs) for job, subs in self._listeners.items()}

    @contextlib.contextmanager
    def issuing(self):
        """Directives issued inside are stored in one transaction (store.batch) and announced once
        it has committed: none reaches a job before it is durable, and the disk is waited for once."""
        if getattr(self._held, "events", None) is not None:
            yield   # already inside one
            return
        self._held.events = []
        try:
            with self.store.batch():
                yield
            events, self._held.events = self._held.events, None
            for args in events:
                self._publish(*args)
        finally:
            self._held.events = None

    def _publish(self, d: Directive, event: str, detail: str = "") -> None:
        held = getattr(self._held, "events", None)
        if held is not None:
            held.append((d, event, detail))
            return
        with self._lock:
            listeners = list(self._listeners.get(d.job_id, {}).values())
        for listener in listeners:
            try:
                listener(d)
            except Exception:  # a broken watcher must not stop the others
                log.exception("directive watcher of job %s failed", d.job_id)
        for hook in self.on_change:
            try:
                hook(event, d, detail)
            except Exception:
                log.exception("directive hook failed")

    # -- jobs ----------------------------------------------------------------------------------------
    def register(self, job_id: str, ranks: Iterable[tuple[int, str, Iterable[int]]], spares: Iterable[str],
                 max_concurrent: int = 0, fallback: int = 0, current_step: int = 0) -> Job:
        check_id("job_id", job_id)
        placed: list[Rank] = []
        seen: set[int] = set()
        for rank, node, gpus in ranks:
            if len(placed) >= MAX_RANKS:
                raise InvalidArgument(f"job {job_id!r}: more than {MAX_RANKS} ranks")
            if rank in seen:
                raise InvalidArgument(f"job {job_id!r}: rank {rank} is placed twice")
            seen.add(rank)
            check_node(f"job {job_id!r} rank {rank} node", node)
            gpus = tuple(int(g) for g in gpus)
            if len(gpus) > MAX_GPUS_PER_RANK or len(set(gpus)) != len(gpus) or any(g > 1023 for g in gpus):
                raise InvalidArgument(f"job {job_id!r} rank {rank}: gpus {list(gpus)[:8]} must be distinct "
                                      f"indices under 1024, at most {MAX_GPUS_PER_RANK}")
            placed.append(Rank(int(rank), node, gpus))
        if not placed:
            raise InvalidArgument(f"job {job_id!r}: ranks is empty; a job places at least one rank")
        spares = tuple(spares)
        if len(spares) > MAX_SPARES:
            raise InvalidArgument(f"job {job_id!r}: more than {MAX_SPARES} spare nodes")
        used = {r.node for r in placed}
        for s in spares:
            check_node(f"job {job_id!r} spare node", s)
            if s in used:
                raise InvalidArgument(f"job {job_id!r}: spare node {s!r} also hosts one of its ranks")
        if len(set(spares)) != len(spares):
            raise InvalidArgument(f"job {job_id!r}: spare_nodes lists a node twice")
        if not 0 <= max_concurrent <= 1024:
            raise InvalidArgument(f"job {job_id!r}: max_concurrent_evacuations {max_concurrent} not in 0..1024")
        try:
            fallback = Fallback(fallback)
        except ValueError:
            raise InvalidArgument(f"job {job_id!r}: fallback {fallback} is not a FallbackPolicy") from None
        if not 0 <= current_step <= MAX_STEP:
            raise InvalidArgument(f"job {job_id!r}: current_step {current_step} out of range")
        old = self.store.find_job(job_id)
        job = self.store.put_job(Job(job_id, tuple(sorted(placed, key=lambda r: r.rank)), spares,
                                     max_concurrent, fallback, current_step))
        if old is not None:  # directives cancelled because their node left the placement
            for d in self.store.directives(job_id):
                if d.state == DirectiveState.CANCELLED and d.updated_at_ns >= job.step_at_ns:
                    self._publish(d, "cancelled", "placement changed")
        return job

    def report_step(self, job_id: str, step: int, step_seconds: float) -> Job:
        check_id("job_id", job_id)
        if not 0 <= step <= MAX_STEP:
            raise InvalidArgument(f"job {job_id!r}: step {step} out of range")
        if not math.isfinite(step_seconds) or not 0 <= step_seconds <= 86_400:
            raise InvalidArgument(f"job {job_id!r}: step_seconds {step_seconds} must be finite, 0..86400")
        return self.store.report_step(job_id, step, step_seconds)

    def deregister(self, job_id: str) -> None:
        check_id("job_id", job_id)
        job = self.store.find_job(job_id)
        for d in self.store.delete_job(job_id):
            self._publish(d, "cancelled", "job deregistered")
        for hook in self.on_deregister if job is not None else ():
            try:
                hook(job)
            except Exception:
                log.exception("deregistration hook failed")

    def now(self) -> int:
        return self._clock()

    def job(self, job_id: str) -> Job:
        check_id("job_id", job_id)
        return self.store.job(job_id)

    # -- directives ----------------------------------------------------------------------------------
    def issue(self, d: Directive) -> tuple[Directive | None, bool]:
        """Store and announce a directive (unless the job already has an active one from that node:
        that one; or its placement changed since `d` was decided: None, store.insert_directive)."""
        stored, created = self.store.insert_directive(d)
        if created:
            self._publish(stored, "issued")
        return stored, created

    def active(self, job_id: str) -> list[Directive]:
        return self.store.directives(job_id, active_only=True)

    def list(self, job_id: str | None) -> list[Directive]:
        if job_id is not None:
            check_id("job_id", job_id)
        return self.store.directives(job_id)

    def ack(self, job_id: str, directive_id: str, rank: int, phase: int, reason: str,
            phase_seconds: float) -> Directive:
        check_id("job_id", job_id)
        check_id("directive_id", directive_id)
        check_text("reason", reason)
        try:
            phase = AckPhase(phase)
        except ValueError:
            raise InvalidArgument(f"directive {directive_id!r}: ack phase {phase} is not an AckPhase "
                                  "(ACCEPTED, STATE_TRANSFERRED, COMPLETED or FAILED)") from None
        if not math.isfinite(phase_seconds) or not 0 <= phase_seconds <= 86_400 * 7:
            raise InvalidArgument(f"directive {directive_id!r}: phase_seconds {phase_seconds} must be finite, >= 0")
        d = self.store.directive(directive_id)
        if d.job_id != job_id:
            raise PermissionDenied(f"directive {directive_id!r} belongs to another job, not {job_id!r}")
        job = self.store.find_job(job_id)
        if job is not None and rank not in {r.rank for r in job.ranks} and rank not in d.ranks:
            raise InvalidArgument(f"job {job_id!r} has no rank {rank}")
        d, changed = self.store.ack(AckRecord(directive_id, rank, phase, reason, phase_seconds, self._clock()))
        if changed:
            self._publish(d, "ack", phase.name.lower())
        return d

    def cancel(self, directive_id: str, reason: str) -> Directive:
        check_id("directive_id", directive_id)
        check_text("reason", reason)
        d, changed = self.store.cancel(directive_id, reason)
        if changed:
            self._publish(d, "cancelled", reason)
        return d

    def expire(self, now_ns: int) -> list[Directive]:
        late = self.store.expire(now_ns)
        for d in late:
            self._publish(d, "expired")
        return late

    def jobs_on(self, node: str) -> list[Job]:
        return [j for j in self.store.jobs() if node in j.nodes()]

    def snapshot_for_watch(self, job_id: str) -> list[Directive]:
        """What a (re)connecting watcher is sent first: the job's directives that are not finished."""
        check_id("job_id", job_id)
        if self.store.find_job(job_id) is None:
            raise NotFound(f"job {job_id!r} is not registered")
        return [d for d in self.store.directives(job_id) if d.state in ACTIVE_STATES]


def estimated_step(job: Job, now_ns: int) -> float:
    """The job's step now, extrapolated from its last report and step time."""
    if job.step_seconds <= 0:
        return float(job.step)
    return job.step + max(0.0, (now_ns - job.step_at_ns) / 1e9) / job.step_seconds


def switch_step(job: Job, now_ns: int, *, lead_seconds: float, min_steps_ahead: int) -> int:
    """The step boundary every rank switches at: far enough ahead that all ranks hear of it first."""
    ahead = min_steps_ahead
    if job.step_seconds > 0:
        ahead = max(ahead, math.ceil(lead_seconds / job.step_seconds))
    return int(math.floor(estimated_step(job, now_ns))) + ahead


def new_directive(job: Job, *, kind: DirectiveKind, ranks: tuple[int, ...], from_node: str, to_node: str,
                  at_step: int, now_ns: int, deadline_seconds: float, reason: str, risk: float,
                  signals=(), origin: str = "policy") -> Directive:
    # The deadline is on the wall clock, not the scoring clock (now_ns: the telemetry's time, which a
    # replay or the demo's simulation runs apart from it): the job's ranks read it on theirs.
    return Directive("", job.job_id, kind, ranks, from_node, to_node, at_step,
                     time.time_ns() + int(deadline_seconds * 1e9), reason, risk, tuple(signals), now_ns,
                     DirectiveState.PENDING, job.generation, now_ns, origin)


__all__ = ["JobDirectory", "estimated_step", "switch_step", "new_directive"]
