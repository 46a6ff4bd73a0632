"""Xids read in context: the same Xid on many nodes of one job or NVLink domain within seconds is one job
event, not a hardware fault on each node; and conditions one Xid opens until another cancels it.

Job events. An Xid the catalogue marks `collateral` (foreshock/xid.py: 45, 43, 13, ... at a job's
teardown; 74, 79, 109, 144-150, 155, which a failure of what the GPUs share also puts on healthy ones)
is a *sighting* here (`observe`, from service/ingest.py) instead of a fatal event at once. The policy
asks `decide` every round (service/policy.py):

* sightings of one Xid code on at least `need(size)` distinct nodes of one scope (a job registered with
  the control plane or deregistered from it in the last JOB_MEMORY_SECONDS, the inventory's job label,
  the inventory's NVLink domain), each within `window_seconds` of
  the next by their kernel times, are one job event: recorded once (the decision log's `xid_job_event`
  row, a log line, `foreshock_xid_job_events_total`), and no node of it is alarmed;
* a sighting that is still alone when `window_seconds` have passed since the policy first saw it is a
  fault of its node after all: `decide` returns its FatalEvent and the node is alarmed as before. A
  node in no job and no NVLink domain of two nodes or more has nobody to share a job event with: its
  sighting is a fault in the round that first sees it.

So a collateral fatal Xid alone on one node acts `window_seconds` later than any other fatal Xid; that
is the price of not draining a whole job's nodes at its teardown (docs/service.md, "Xids in context").
Xids that are never collateral (48, 64, 95, ...) and lost GPUs that NVML measures never wait. A job's
placement is remembered for JOB_MEMORY_SECONDS after it deregisters, since a job that ends deregisters
before its nodes' teardown Xids arrive.

`need(size)`: at least 2 nodes (one node alone is never a job event), and `min_nodes` or
`fraction` of the scope's nodes, whichever is fewer.

Conditions. An Xid that another cancels (`xid.outstanding_until`: 163, power smoothing disengaged, until
162 re-engages it) is outstanding on its GPU from its last occurrence until a cancelling Xid at a later
time; `outstanding()` lists them (the metric foreshock_xid_outstanding). Times, not arrival order, decide:
a folded count of 163 that arrives after the 162 but whose last line came before it does not reopen it.

Every collection here is bounded (MAX_PENDING sightings, MAX_RECENT decided ones, MAX_JOBS remembered
placements, MAX_CONDITIONS conditions); what does not fit is forgotten oldest first, except a pending
sighting, which then acts at once as its node's fault (counted in `overflow`).
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from foreshock import xid as xidcat
from foreshock.service.nodes import FatalEvent

JOB_MEMORY_SECONDS = 600.0     # a deregistered job's placement still names its nodes' teardown Xids
MAX_PENDING = 100_000          # sightings waiting for their window: past it the oldest acts at once
MAX_RECENT = 100_000           # decided sightings kept for late members of their group
MAX_JOBS = 10_000              # deregistered placements remembered
MAX_CONDITIONS = 100_000       # outstanding conditions (163 until 162)
MAX_WINDOW_SECONDS = 60.0

Scope = tuple[str, str]        # ("job" | "nvlink_domain", name)


@dataclass
class Sighting:
    node: str
    ts_ns: int                 # the kernel's time of the Xid
    xid: int
    event: FatalEvent | None   # what the node's alarm says if it is a fault after all; None: not fatal
    seq: int = 0
    seen_ns: int | None = None  # the policy clock when a round first saw it
    claimed: bool = False       # part of a job event: never counted towards another


@dataclass
class JobEvent:
    scope: Scope
    xid: int
    size: int                            # nodes in the scope
    nodes: set[str] = field(default_factory=set)
    first_ns: int = 0
    last_ns: int = 0
    sightings: int = 0
    touched_ns: int = 0                  # policy clock of the last member: closes a window after it

    def describe(self) -> str:
        kind, name = self.scope
        what = "job" if kind == "job" else "NVLink domain"
        return (f"Xid {self.xid} on {len(self.nodes)} of {self.size or '?'} nodes of {what} {name} within "
                f"{(self.last_ns - self.first_ns) / 1e9:.1f} s: one {what} event (its end, a crash or what the "
                f"nodes share), not a fault of each node; none is alarmed")


def need(size: int, min_nodes: int, fraction: float) -> int:
    """Distinct nodes that make a job event in a scope of `size` nodes (0: unknown)."""
    share = math.ceil(fraction * size) if size > 0 else min_nodes
    return max(2, min(min_nodes, share))


class XidContext:
    """Sightings of collateral Xids and outstanding conditions (the module docstring); thread-safe: ingest
    observes, the policy decides, the metrics read."""

    def __init__(self, window_seconds: float = 5.0, min_nodes: int = 3, fraction: float = 0.25):
        if not 0 <= window_seconds <= MAX_WINDOW_SECONDS:
            raise ValueError(f"policy xid_context_seconds {window_seconds} must be in [0, {MAX_WINDOW_SECONDS:g}]")
        if not 2 <= min_nodes <= 100_000:
            raise ValueError(f"policy xid_context_min_nodes {min_nodes} must be in [2, 100000]")
        if not 0 < fraction <= 1:
            raise ValueError(f"policy xid_context_fraction {fraction} must be in (0, 1]")
        self.window_ns = int(window_seconds * 1e9)
        self.min_nodes = min_nodes
        self.fraction = fraction
        self._lock = threading.Lock()
        self._pending: collections.OrderedDict[int, Sighting] = collections.OrderedDict()
        self._recent: collections.deque[tuple[int, Sighting]] = collections.deque(maxlen=MAX_RECENT)
        self._events: dict[tuple[Scope, int], JobEvent] = {}
        self._jobs_gone: collections.OrderedDict[str, tuple[frozenset[str], int]] = collections.OrderedDict()
        self._seq = 0
        self._decided = 0          # every sighting with seq <= this has been decided
        # (node, device, code) -> its last occurrence (ns) while outstanding; -> the latest cancel (ns)
        self._open: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self._cancelled: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self.job_events = collections.Counter()   # xid -> job events declared
        self.suppressed = 0        # sightings that were part of a job event: no alarm
        self.released = 0          # sightings that acted as their node's fault
        self.overflow = 0          # sightings decided early because MAX_PENDING was reached
        self.closed: list[JobEvent] = []   # closed since the last take_closed()

    # -- sightings -----------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.window_ns > 0

    def observe(self, sighting: Sighting) -> FatalEvent | None:
        """Take a collateral Xid; returns a fatal event to record at once: this one's when the context
        is off, or the oldest pending one's when MAX_PENDING is reached (it cannot wait any longer)."""
        with self._lock:
            if not self.enabled:
                return sighting.event
            self._seq += 1
            sighting.seq = self._seq
            self._pending[sighting.seq] = sighting
            if len(self._pending) > MAX_PENDING:
                _, oldest = self._pending.popitem(last=False)
                self.overflow += 1
                self._after_decided()
                self._recent.append((0, oldest))
                if oldest.event is not None:
                    self.released += 1
                    return oldest.event
            return None

    def mark(self) -> int:
        """The sightings observed so far (for settled())."""
        return self._seq

    def settled(self, mark: int) -> bool:
        """Every sighting observed up to `mark` has been decided."""
        return self._decided >= mark

    def next_deadline_ns(self) -> int | None:
        """The policy clock at which the oldest pending sighting is decided (None: none pending, or not
        yet seen by a round: the next round sees it)."""
        with self._lock:
            if not self._pending:
                return None
            first = next(iter(self._pending.values()))
            return None if first.seen_ns is None else first.seen_ns + self.window_ns

    def pending(self) -> int:
        return len(self._pending)

    def _after_decided(self) -> None:
        self._decided = (next(iter(self._pending)) - 1) if self._pending else self._seq

    def remember_job(self, job_id: str, nodes: Iterable[str], now_ns: int) -> None:
        """A job that leaves: its placement still scopes its nodes' Xids for JOB_MEMORY_SECONDS."""
        with self._lock:
            self._jobs_gone[job_id] = (frozenset(nodes), now_ns)
            self._jobs_gone.move_to_end(job_id)
            while len(self._jobs_gone) > MAX_JOBS:
                self._jobs_gone.popitem(last=False)

    def gone_jobs(self, now_ns: int) -> dict[str, frozenset[str]]:
        with self._lock:
            for job in [j for j, (_, t) in self._jobs_gone.items() if now_ns - t > JOB_MEMORY_SECONDS * 1e9]:
                del self._jobs_gone[job]
            return {j: nodes for j, (nodes, _) in self._jobs_gone.items()}

    def busy(self) -> bool:
        return bool(self._pending or self._events)

    def decide(self, now_ns: int, scopes_of: Callable[[str], Iterable[Scope]],
               size_of: Callable[[Scope], int]) -> tuple[list[FatalEvent], list[JobEvent]]:
        """One policy round: the faults to alarm now, and the job events declared in this round."""
        with self._lock:
            if not self._pending and not self._events:
                return [], []
            for s in self._pending.values():
                if s.seen_ns is None:
                    s.seen_ns = now_ns
            groups: dict[tuple[Scope, int], list[Sighting]] = collections.defaultdict(list)
            for s in list(self._pending.values()) + [s for _, s in self._recent]:
                for scope in scopes_of(s.node):
                    groups[(scope, s.xid)].append(s)
            declared: list[JobEvent] = []
            members: set[int] = set()
            for key, group in groups.items():
                ev = self._events.get(key)
                if ev is not None:
                    joining = self._clusters(group, ev)
                else:   # one open event per scope and code: the first chain that is big enough
                    size = size_of(key[0])
                    want = need(size, self.min_nodes, self.fraction)
                    free = [s for s in group if not s.claimed]
                    joining = [c for c in self._clusters(free, None) if len({s.node for s in c}) >= want][:1]
                    if not joining:
                        continue
                    ev = JobEvent(key[0], key[1], size, first_ns=joining[0][0].ts_ns, last_ns=joining[0][-1].ts_ns)
                    self._events[key] = ev
                    self.job_events[key[1]] += 1
                    declared.append(ev)
                for cluster in joining:
                    nodes = {s.node for s in cluster}
                    fresh = [s for s in cluster if s.seq in self._pending]
                    if fresh:
                        ev.touched_ns = now_ns
                    ev.nodes |= nodes
                    ev.first_ns = min(ev.first_ns, min(s.ts_ns for s in cluster))
                    ev.last_ns = max(ev.last_ns, max(s.ts_ns for s in cluster))
                    ev.sightings += len(fresh)
                    members.update(s.seq for s in fresh)
                    for s in cluster:
                        s.claimed = True
            faults: list[FatalEvent] = []
            for seq in list(self._pending):
                s = self._pending[seq]
                if seq in members:
                    del self._pending[seq]
                    self.suppressed += 1
                    self._recent.append((now_ns, s))
                elif now_ns >= s.seen_ns + self.window_ns or not any(
                        size_of(scope) >= 2 for scope in scopes_of(s.node)):   # no one to share an event with
                    del self._pending[seq]
                    self._recent.append((now_ns, s))
                    if s.event is not None:
                        self.released += 1
                        faults.append(s.event)
            self._after_decided()
            horizon = now_ns - 2 * self.window_ns
            while self._recent and self._recent[0][0] < horizon:
                self._recent.popleft()
            for key in [k for k, ev in self._events.items() if now_ns >= ev.touched_ns + self.window_ns]:
                self.closed.append(self._events.pop(key))
            del self.closed[:-1000]
            return faults, declared

    def _clusters(self, group: list[Sighting], ev: JobEvent | None) -> list[list[Sighting]]:
        """Sightings chained by kernel times at most a window apart; with an open event, the chain
        that reaches into its span."""
        group = sorted(group, key=lambda s: s.ts_ns)
        out: list[list[Sighting]] = []
        for s in group:
            if out and s.ts_ns - out[-1][-1].ts_ns <= self.window_ns:
                out[-1].append(s)
            else:
                out.append([s])
        if ev is None:
            return out
        lo, hi = ev.first_ns - self.window_ns, ev.last_ns + self.window_ns
        return [c for c in out if c[0].ts_ns <= hi and c[-1].ts_ns >= lo]

    def close_all(self) -> None:
        """The service stops: every open job event is closed as it stands (take_closed records it)."""
        with self._lock:
            self.closed.extend(self._events.values())
            self._events.clear()

    def take_closed(self) -> list[JobEvent]:
        with self._lock:
            out, self.closed = self.closed, []
            return out

    # -- conditions (163 until 162) --------------------------------------------------------------------
    def xid_seen(self, node: str, device: object, code: int, first_ns: int, last_ns: int) -> str | None:
        """Note an Xid's occurrence for the conditions; returns what changed, in words, or None."""
        said = None
        with self._lock:
            for cancelled in xidcat.lookup(code).cancels:
                key = (node, device, cancelled)
                prior = self._cancelled.get(key, -1)
                self._cancelled[key] = max(prior, last_ns)
                self._cancelled.move_to_end(key)
                opened = self._open.get(key)
                if opened is not None and opened <= last_ns:
                    del self._open[key]
                    said = f"Xid {code} on {node} ({device}) cancels the outstanding Xid {cancelled}"
            if xidcat.outstanding_until(code):
                key = (node, device, code)
                if last_ns > self._cancelled.get(key, -1) and last_ns > self._open.get(key, -1):
                    if key not in self._open:
                        said = (f"Xid {code} ({xidcat.lookup(code).name}) on {node} ({device}) outstanding until "
                                f"Xid {'/'.join(map(str, xidcat.outstanding_until(code)))}")
                    self._open[key] = last_ns
                    self._open.move_to_end(key)
            while len(self._open) > MAX_CONDITIONS:
                self._open.popitem(last=False)
            while len(self._cancelled) > MAX_CONDITIONS:
                self._cancelled.popitem(last=False)
        return said

    def outstanding(self) -> list[tuple[str, str, int, int]]:
        """(node, device, xid, since ns) of every condition not yet cancelled."""
        with self._lock:
            return [(n, str(d), c, t) for (n, d, c), t in self._open.items()]


__all__ = ["XidContext", "Sighting", "JobEvent", "need", "JOB_MEMORY_SECONDS"]
