"""The jobs coordinator (`foreshock serve --coordinator`): leadership by a file lock, and the shards' events
applied to the per-job policy.

Past one instance the service shards by leaf switch (docs/scaling.md); the jobs, the directive store and
the per-job policy stay in one place, the coordinator, the one writer of directives. Shards forward what
their policy sees over Coordinator.ForwardAlarms (proto/foreshock/v1/coordinator.proto; the shard's side
is service/forwarder.py):

- `LeaderLock`: leadership is an exclusive `flock` on a file of the volume the leader and its standby
  both mount, beside the SQLite state they share. The kernel (or the file server) drops the lock when the
  holder dies, so a standby blocked on it takes over without a protocol of ours to get wrong; only the
  holder opens the state.
- `Coordinator.receive`: one batch of a shard's events, applied once. An event's id is (shard, epoch,
  sequence); the last applied per shard is kept in the state (store.py `shard_progress`), so a batch the
  shard sends again after a reconnect (to this instance or to the standby that took over) applies
  nothing twice. The events, each node's state as they leave it (`shard_nodes`) and the directives the
  policy issues on them are one transaction; the ack the servicer sends after it means all of it is
  durable. `restore` reads the node states back when an instance takes over, and runs the policy: a
  leader killed between its commit and its ack loses nothing, and one killed before its commit loses
  nothing either (the shard has not been acked, so it sends the events again).
- FABRIC_SERVICE events: a shard's judge raised or cleared a finding on a fabric service (service/
  fabricunits.py). They go to the policy's `units`, a ForwardedFindings, whose `down` and
  `crash_looping` the spare choice asks as one instance asks its own judge, and to the state
  (`shard_fabric_findings`, one row per finding held) in the batch's transaction; `restore` reads them
  back. They move no alarm and no risk.
- A shard's new instance (a newer epoch: a restart, a rolling upgrade) judges afresh and sends what its
  policy changes from then on, never a clear of what its previous instance raised. So the first batch
  of a newer epoch starts a reconfirmation (`reconfirm_seconds`): the risk alarms the previous instance
  left on the shard's nodes and the fabric findings it raised stay held while the new one has time to
  raise them again (its first rounds; a finding's hold), and those it has not raised, cleared or
  replaced by then are cleared, with the reason in the decision log
  (`foreshock_coordinator_reconfirm_cleared_total{kind}`). Fatal events are facts, not judgements, and
  stay. The pending set is in the state (`shard_reconfirmations`, a row a shard), written in the
  transaction of the batch that starts it or takes something off it and deleted in the one that ends
  it; `restore` reads it back, so an instance that takes over ends it when due and clears what its
  predecessor would have.
- `PeerTotalsBook`: the job and site peer totals each shard sends per closed feature step, summed for
  the other shards: each ack carries a shard the others' sums of the newest step all of them have sent
  (docs/scaling.md, "Peer features across shards"). Memory only, the last MAX_TOTALS_STEPS steps per
  shard: totals are a few steps' worth of use, and a takeover starts them over (the shards' scorers use
  their own nodes' meanwhile).
- `step_times` (a steptimefeed.StepTimeRouter): the jobs' accepted step times, for the shards whose nodes
  run them, on the acks (service/steptimefeed.py); `shard_of(node)`: the shard that last forwarded an
  event about the node, by which it routes. The coordinator has no other way to know a node's shard
  (it holds no shard map, and the map places by leaf switch, which a job's placement does not name), so
  the rows of a node not heard of yet are held, bounded in rows and age, and each batch's nodes are
  handed to `step_times.placed` once applied, which releases them to the node's shard. Memory only,
  bounded, best effort.
- A shard that scores with a model other than the one expected (`expected_model_version`, or the first
  one seen) is counted and logged, not refused: during a rolling model update shards differ for a while.
"""

from __future__ import annotations

import enum
import fcntl
import json
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from foreshock import fabric
from foreshock.service.domain import SignalRecord
from foreshock.service.errors import FailedPrecondition, InvalidArgument
from foreshock.service.fabricunits import FINDINGS, ForwardedFindings
from foreshock.service.jobs import check_id, check_node, check_text
from foreshock.service.nodes import FatalEvent, Topology
from foreshock.service.steptimefeed import BUFFER_ROWS, HOLD_ROWS, HOLD_SECONDS, MAX_HOLD_SECONDS, StepTimeRouter

log = logging.getLogger(__name__)

MAX_EVENTS = 1024            # events in one ForwardRequest (coordinator.proto)
MAX_SIGNALS = 16             # signals kept per event
MAX_TEXT = 1024              # a description or reason, characters
MAX_UINT63 = (1 << 63) - 1   # epochs and sequences are kept in SQLite's signed 64-bit INTEGER
MAX_TOTALS_STEPS = 4         # steps of peer totals in one request, and kept per shard (the scorers use the last 1-2)
MAX_TOTALS_GROUPS = 65_536   # job and site groups of one request, over its steps
# A shard's new instance restores its scorer from the checkpoint and raises an alarm again within its
# first rounds. A fabric finding takes longer: a down unit its hold (fabric_service_hold_seconds, 60 s
# by default), a crash loop up to its window (600 s by default) after the first sample, which is only a
# baseline of the restart count. Twice the default window covers both with a collector's restart; a
# deployment with a longer hold or window on its shards sets this above them.
RECONFIRM_SECONDS = 1200.0
MIN_RECONFIRM_SECONDS, MAX_RECONFIRM_SECONDS = 1.0, 86_400.0


class EventKind(enum.IntEnum):
    """coordinator.proto's ShardEventKind, by number (tests/test_service_coordinator.py checks it)."""
    ALARM = 1
    CLEARED = 2
    FATAL = 3
    RISK = 4
    FABRIC_SERVICE = 5


@dataclass(frozen=True)
class ShardEvent:
    sequence: int
    kind: EventKind
    node: str
    risk: float = 0.0
    signals: tuple[SignalRecord, ...] = ()
    ts_ns: int = 0
    fatal_kind: str = ""
    description: str = ""
    topology: Topology = Topology()
    unit: str = ""          # FABRIC_SERVICE: the unit, its finding, and whether it holds now
    finding: str = ""
    raised: bool = False


@dataclass(frozen=True)
class CoordinatorSettings:
    lease_file: str                      # the lock file on the volume the leader and its standby share
    expected_model_version: str = ""     # "": the first shard's model is the one expected
    lock_poll_seconds: float = 0.5       # how often a standby tries the lock (and sees a stop)
    reconfirm_seconds: float = RECONFIRM_SECONDS   # a shard's new instance has this long to raise again
    step_time_buffer_rows: int = BUFFER_ROWS       # step_times rows waiting for each shard's next ack
    step_time_hold_rows: int = HOLD_ROWS           # ... held for nodes whose shard is not known yet, in all,
    step_time_hold_seconds: float = HOLD_SECONDS   # ... each at most this long (0: none held)

    def __post_init__(self):
        if not self.lease_file:
            raise ValueError("coordinator lease_file is empty: give --lease-file PATH on the shared volume")
        if not (isinstance(self.lock_poll_seconds, (int, float)) and 0.01 <= self.lock_poll_seconds <= 60):
            raise ValueError(f"coordinator lock_poll_seconds {self.lock_poll_seconds!r} must be in [0.01, 60]")
        if not (isinstance(self.reconfirm_seconds, (int, float))
                and MIN_RECONFIRM_SECONDS <= self.reconfirm_seconds <= MAX_RECONFIRM_SECONDS):
            raise ValueError(f"coordinator_reconfirm_seconds {self.reconfirm_seconds!r} must be in "
                             f"[{MIN_RECONFIRM_SECONDS:g}, {MAX_RECONFIRM_SECONDS:g}]")
        # at least one report's rows (service/steptimes.py MAX_SAMPLES_PER_REPORT)
        if not (isinstance(self.step_time_buffer_rows, int) and 1024 <= self.step_time_buffer_rows <= 100_000_000):
            raise ValueError(f"coordinator step_time_buffer_rows {self.step_time_buffer_rows!r} must be an "
                             "integer in [1024, 100000000]")
        if not (isinstance(self.step_time_hold_rows, int) and 1024 <= self.step_time_hold_rows <= 100_000_000):
            raise ValueError(f"coordinator step_time_hold_rows {self.step_time_hold_rows!r} must be an "
                             "integer in [1024, 100000000]")
        # longer than MAX_HOLD_SECONDS, a held row would reach its shard's scorer late (steptimefeed.py)
        if not (isinstance(self.step_time_hold_seconds, (int, float))
                and 0 <= self.step_time_hold_seconds <= MAX_HOLD_SECONDS):
            raise ValueError(f"coordinator step_time_hold_seconds {self.step_time_hold_seconds!r} must be in "
                             f"[0, {MAX_HOLD_SECONDS:g}]")


class LeaderLock:
    """An exclusive flock on `path`, held for the life of the process that takes it.

    flock, not fcntl's POSIX record locks: those belong to the process and any close of the file by it
    drops them, flock's to the open file, so two instances in one process (tests) exclude each other
    too. On NFS, Linux carries flock as a whole-file POSIX lock, which NLM (v3) or the protocol (v4)
    releases when the holder's lease runs out: the takeover then waits that long.
    """

    def __init__(self, path: str | Path, identity: str = ""):
        self.path = Path(path)
        self.identity = identity
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, stop: threading.Event, poll_seconds: float) -> bool:
        """Block until the lock is ours (True) or `stop` is set (False)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise FailedPrecondition(f"lease file {self.path}: {exc.strerror}") from None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if stop.wait(poll_seconds):
                    os.close(fd)
                    return False
        self._fd = fd
        # Who leads, for the standby's UNAVAILABLE message and for people; the lock, not this, decides.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.identity} pid {os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        return True

    def holder(self) -> str:
        """What the holder wrote (best effort: "" when unreadable or not yet written)."""
        try:
            return self.path.read_text(errors="replace").strip()[:200]
        except OSError:
            return ""

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def check_events(shard: str, epoch: int, events: list[ShardEvent]) -> None:
    """Refuse a batch that is not one shard's well-formed events, naming what is wrong."""
    check_id("shard", shard)
    if not 0 < epoch <= MAX_UINT63:
        raise InvalidArgument(f"shard {shard!r}: epoch {epoch} must be in [1, 2^63)")
    if len(events) > MAX_EVENTS:
        raise InvalidArgument(f"shard {shard!r}: {len(events)} events in one request; at most {MAX_EVENTS}")
    last = 0
    for e in events:
        if not last < e.sequence <= MAX_UINT63:
            raise InvalidArgument(f"shard {shard!r}: event sequence {e.sequence} does not follow {last}")
        last = e.sequence
        check_node(f"shard {shard!r} event {e.sequence} node", e.node)
        if not (math.isfinite(e.risk) and 0.0 <= e.risk <= 1.0):
            raise InvalidArgument(f"shard {shard!r} event {e.sequence}: risk {e.risk} must be in [0, 1]")
        if len(e.signals) > MAX_SIGNALS:
            raise InvalidArgument(f"shard {shard!r} event {e.sequence}: {len(e.signals)} signals; at most {MAX_SIGNALS}")
        check_text(f"shard {shard!r} event {e.sequence} description", e.description, MAX_TEXT)
        for name in ("leaf_switch", "site", "nvlink_domain"):
            check_text(f"shard {shard!r} event {e.sequence} {name}", getattr(e.topology, name), 253)
        if e.kind == EventKind.FABRIC_SERVICE:
            if e.unit not in fabric.FABRIC_SERVICES:
                raise InvalidArgument(f"shard {shard!r} event {e.sequence}: unit {e.unit[:MAX_TEXT]!r} is not a fabric "
                                      f"service (one of {', '.join(sorted(fabric.FABRIC_SERVICES))})")
            if e.finding not in FINDINGS:
                raise InvalidArgument(f"shard {shard!r} event {e.sequence}: finding {e.finding[:MAX_TEXT]!r} is not "
                                      f"one of {', '.join(FINDINGS)}")


def check_step_totals(shard: str, steps: list[tuple[int, list[tuple[str, str, list[float]]]]]):
    """A request's peer totals [(step, [(group, name, values)])] -> {step: {(group, name): row}}, or
    InvalidArgument naming the shard, the step and the group at fault."""
    from foreshock.predictor import features as ft

    if len(steps) > MAX_TOTALS_STEPS:
        raise InvalidArgument(f"shard {shard!r}: totals of {len(steps)} steps in one request; at most {MAX_TOTALS_STEPS}")
    if sum(len(groups) for _, groups in steps) > MAX_TOTALS_GROUPS:
        raise InvalidArgument(f"shard {shard!r}: more than {MAX_TOTALS_GROUPS} groups of totals in one request")
    out: dict[int, dict[tuple[str, str], object]] = {}
    for step, groups in steps:
        if not 0 < step <= MAX_UINT63:
            raise InvalidArgument(f"shard {shard!r}: totals step {step} must be in [1, 2^63)")
        if step in out:
            raise InvalidArgument(f"shard {shard!r}: totals of step {step} twice in one request")
        rows = out[step] = {}
        for group, name, values in groups:
            if group not in ft.CROSS_SHARD_GROUPS:
                raise InvalidArgument(f"shard {shard!r} totals of step {step}: group {group!r} is not one of "
                                      f"{ft.CROSS_SHARD_GROUPS}")
            check_text(f"shard {shard!r} totals of step {step} {group} name", name, 253)
            if not name or (group, name) in rows:
                raise InvalidArgument(f"shard {shard!r} totals of step {step}: {group} {name!r} empty or twice")
            try:
                rows[(group, name)] = ft.check_totals_row(values, f"shard {shard!r} totals of step {step}, {group} {name!r}")
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
    return out


class PeerTotalsBook:
    """Each shard's job and site totals by step (the last MAX_TOTALS_STEPS), and what each has been given."""

    def __init__(self):
        self._lock = threading.Lock()
        self._steps: dict[str, dict[int, dict[tuple[str, str], object]]] = {}
        self._given: dict[str, int] = {}     # shard -> the newest step whose others' sums it was sent
        self.steps_received: dict[str, int] = {}
        self.sums_sent: dict[str, int] = {}

    def put(self, shard: str, checked: dict[int, dict[tuple[str, str], object]]) -> None:
        """A shard's totals, as check_step_totals returned them."""
        if not checked:
            return
        with self._lock:
            mine = self._steps.setdefault(shard, {})
            mine.update(checked)
            for step in sorted(mine)[:-MAX_TOTALS_STEPS]:
                del mine[step]
            self.steps_received[shard] = self.steps_received.get(shard, 0) + len(checked)
            # A shard that stopped sending would hold every other shard's sums back at its last step:
            # past the window it no longer counts as one of the others.
            newest = max(max(d) for d in self._steps.values() if d)
            for other in [o for o, d in self._steps.items() if not d or max(d) <= newest - MAX_TOTALS_STEPS]:
                log.info("coordinator: shard %s sent no peer totals for %d steps; summed without it",
                         other, MAX_TOTALS_STEPS)
                del self._steps[other]
                self._given.pop(other, None)

    def others(self, shard: str):
        """(step, {group: {name: row}}): the other shards' totals summed at the newest step every one of
        them has sent and `shard` was not given yet; None when there is none."""
        with self._lock:
            others = [d for o, d in self._steps.items() if o != shard]
            if not others:
                return None
            common = set.intersection(*(set(d) for d in others))
            fresh = [s for s in common if s > self._given.get(shard, 0)]
            if not fresh:
                return None
            step = max(fresh)
            sums: dict[str, dict[str, object]] = {}
            for d in others:
                for (group, name), row in d[step].items():
                    got = sums.setdefault(group, {})
                    got[name] = row + got[name] if name in got else row.copy()
            self._given[shard] = step
            self.sums_sent[shard] = self.sums_sent.get(shard, 0) + 1
            return step, sums


@dataclass
class _NodeState:
    """A node as the shards' events left it: one shard_nodes row."""
    node: str
    shard: str
    risk: float = 0.0
    scored_at_ns: int = 0
    alarm: bool = False
    alarm_since_ns: int = 0
    reason: str = ""
    signals: tuple[SignalRecord, ...] = ()
    fatal_ts_ns: int = 0
    fatal_kind: str = ""
    fatal_description: str = ""
    fatal_recorded_ns: int = 0
    topology: Topology = Topology()

    def row(self) -> tuple:
        t = self.topology
        return (self.node, self.shard, self.risk, self.scored_at_ns, int(self.alarm), self.alarm_since_ns,
                self.reason, json.dumps([s.__dict__ for s in self.signals]), self.fatal_ts_ns, self.fatal_kind,
                self.fatal_description, self.fatal_recorded_ns, t.leaf_switch, t.site, t.nvlink_domain)

    @classmethod
    def from_row(cls, r) -> "_NodeState":
        (node, shard, risk, scored, alarm, since, reason, signals, fts, fkind, fdesc, frec, leaf, site, dom) = r
        return cls(node, shard, risk, scored, bool(alarm), since, reason,
                   tuple(SignalRecord(**s) for s in json.loads(signals)), fts, fkind, fdesc, frec,
                   Topology(site=site, leaf_switch=leaf, nvlink_domain=dom))


@dataclass
class _Reconfirm:
    """What a shard's previous instance left held, waiting for its instance of `epoch` to say it again."""
    epoch: int
    until_ns: int
    alarms: set[str]                          # nodes in risk alarm
    findings: set[tuple[str, str, str]]       # (node, unit, finding)
    # Whether the state's row is this set: false until a commit has written it, so a batch whose commit
    # failed leaves it for the next one to write, and a batch that leaves it unchanged writes nothing.
    stored: bool = False

    def said_again(self, key: str | tuple[str, str, str]) -> None:
        """The new instance raised or cleared the alarm on node `key`, or the finding `key`: its own now."""
        held = self.alarms if isinstance(key, str) else self.findings
        if key in held:
            held.discard(key)
            self.stored = False

    def row(self) -> tuple:
        """store.py record_shard_events' `reconfirm`."""
        return self.epoch, self.until_ns, json.dumps(sorted(self.alarms)), json.dumps(sorted(self.findings))

    @classmethod
    def from_row(cls, r) -> tuple[str, "_Reconfirm"]:
        shard, epoch, until_ns, alarms, findings = r
        return shard, cls(epoch, until_ns, set(json.loads(alarms)), {tuple(f) for f in json.loads(findings)},
                          stored=True)


class Coordinator:
    """The shards' events into the node book and the policy, once each, durably."""

    def __init__(self, settings: CoordinatorSettings, store, jobs, nodes, policy, clock):
        if not isinstance(policy.units, ForwardedFindings):
            raise TypeError("the coordinator's policy reads the shards' fabric findings: build it with "
                            "units=ForwardedFindings()")
        self.findings: ForwardedFindings = policy.units
        self.settings = settings
        self.store = store
        self.jobs = jobs
        self.nodes = nodes
        self.policy = policy
        self.clock = clock
        self._lock = threading.Lock()        # one batch at a time, whichever shard's stream sent it
        self._progress: dict[str, tuple[int, int, str]] = {}
        self._state: dict[str, _NodeState] = {}
        self.expected_model = settings.expected_model_version
        self.mismatch: dict[str, bool] = {}  # shard -> scores with another model than expected
        self.events_applied: dict[str, int] = {}
        self.events_duplicate: dict[str, int] = {}
        self.peer_totals = PeerTotalsBook()
        self.step_times = StepTimeRouter(self.shard_of, buffer_rows=settings.step_time_buffer_rows,
                                         hold_rows=settings.step_time_hold_rows,
                                         hold_seconds=settings.step_time_hold_seconds)
        self._reconfirm: dict[str, _Reconfirm] = {}
        self.reconfirm_cleared = {"alarm": 0, "fabric_finding": 0}

    # -- takeover ------------------------------------------------------------------------------------
    def restore(self) -> int:
        """Read back what the shards' events left (an instance that takes over) and act on it: the
        policy issues what a leader killed after its commit decided (the store's one-active-directive
        index keeps it from issuing one twice), and the pending reconfirmations end when due, as they
        would have there. Returns the nodes restored."""
        with self.policy.lock, self._lock:
            self._progress = self.store.shard_progress()
            acted = self.store.last_directive_time()
            for row in self.store.shard_nodes():
                st = _NodeState.from_row(row)
                self._state[st.node] = st
                self._to_book(st)
                if st.alarm:
                    self.policy.raise_alarm(st.node, st.alarm_since_ns, st.risk, st.reason, log_it=False)
                if st.fatal_ts_ns and acted.get(st.node, -1) >= st.fatal_recorded_ns:
                    self.policy.fatal_acted(st.node, st.fatal_ts_ns)   # decided on before the takeover
            self.findings.restore(self.store.shard_fabric_findings())
            self._reconfirm = dict(_Reconfirm.from_row(r) for r in self.store.shard_reconfirmations())
            now = self.clock()
            self.policy.evaluate(now)
        if self._state:
            log.info("coordinator: restored %d nodes' state from %d shards", len(self._state), len(self._progress))
        if self._reconfirm:
            log.info("coordinator: restored the pending reconfirmations of shards %s",
                     ", ".join(sorted(self._reconfirm)))
        return len(self._state)

    def _to_book(self, st: _NodeState) -> None:
        self.nodes.set_topology(st.node, st.topology)
        if st.scored_at_ns:
            self.nodes.update_risk([st.node], _array(st.risk), [st.signals], st.scored_at_ns)
        if st.fatal_ts_ns:
            self.nodes.record_fatal(FatalEvent(st.node, st.fatal_ts_ns, st.fatal_kind, st.fatal_description,
                                               st.fatal_recorded_ns))

    # -- the shards' events --------------------------------------------------------------------------
    def receive(self, shard: str, epoch: int, model_version: str, events: list[ShardEvent]) -> int:
        """Apply a shard's batch (the events not applied before) and return the sequence up to which
        everything of this epoch is durable: what the shard may forget."""
        check_events(shard, epoch, events)
        check_text(f"shard {shard!r} model_version", model_version, 256)
        self._check_model(shard, model_version)
        # The policy's lock first, as a scoring round takes it, then the store's (inside issuing()).
        with self.policy.lock, self._lock:
            done_epoch, done_seq, _ = self._progress.get(shard, (0, 0, ""))
            if epoch < done_epoch:
                raise FailedPrecondition(f"shard {shard!r}: epoch {epoch} is older than {done_epoch}, which a "
                                         "newer instance of the shard forwards under; this one is stale")
            now = self.clock()
            new_epoch = epoch > done_epoch
            if new_epoch:
                done_seq = 0
                if done_epoch:
                    self._start_reconfirm(shard, epoch, now)
            fresh = [e for e in events if e.sequence > done_seq]
            self.events_duplicate[shard] = self.events_duplicate.get(shard, 0) + len(events) - len(fresh)
            pending = self._reconfirm.get(shard)
            due = pending is not None and now >= pending.until_ns
            if not fresh and not due:
                return done_seq
            sequence = fresh[-1].sequence if fresh else done_seq
            changed: dict[str, _NodeState] = {}
            findings: set[tuple[str, str, str]] = set()
            with self.jobs.issuing():   # the events, the node rows, the findings and the directives: one commit
                for e in fresh:
                    if e.kind == EventKind.FABRIC_SERVICE:
                        self.findings.take(shard, e.node, e.unit, e.finding, e.raised, e.ts_ns or now, e.description)
                        findings.add((e.node, e.unit, e.finding))
                        if pending is not None:
                            pending.said_again((e.node, e.unit, e.finding))
                    else:
                        changed[e.node] = self._apply(shard, e, now)
                        if pending is not None and e.kind in (EventKind.ALARM, EventKind.CLEARED):
                            pending.said_again(e.node)
                cleared = self._end_reconfirm(shard, pending, now, changed, findings) if due else False
                # A new epoch with nothing held: the previous epoch's row, if its reconfirmation was still
                # pending, is moot (a newer one with something held replaces it).
                self._record(shard, epoch, sequence, model_version, changed, findings, now,
                             None if due else pending, ended=due or (new_epoch and pending is None))
                # Risk summaries move no alarm; the next round sees the spares' new risks.
                if cleared or any(e.kind != EventKind.RISK for e in fresh):
                    self.policy.evaluate(now)
            if due:
                self._reconfirm.pop(shard, None)   # only once committed: a failed commit tries it again
            elif pending is not None:
                pending.stored = True
            self._progress[shard] = (epoch, sequence, model_version)
            self.events_applied[shard] = self.events_applied.get(shard, 0) + len(fresh)
            # after the commit, so that the ack of this batch carries the step times held for its nodes
            self.step_times.placed(shard, changed)
            return sequence

    def _record(self, shard: str, epoch: int, sequence: int, model_version: str, changed: dict[str, _NodeState],
                findings: set[tuple[str, str, str]], now_ns: int, pending: _Reconfirm | None = None,
                ended: bool = False) -> None:
        held = {key: self.findings.held(*key) for key in findings}
        self.store.record_shard_events(
            shard, epoch, sequence, model_version, [st.row() for st in changed.values()], now_ns,
            findings=[(*key, h.shard, h.since_ns) for key, h in held.items() if h is not None],
            cleared=[key for key, h in held.items() if h is None],
            reconfirm=pending.row() if pending is not None and not pending.stored else None, reconfirm_ended=ended)

    def end_due_reconfirmations(self, now_ns: int) -> int:
        """End the reconfirmations due by `now_ns` of shards that have sent nothing since (a shard's own
        batches end its own): the service's rounds call it once a second. Returns how many ended."""
        with self.policy.lock, self._lock:
            due = sorted(s for s, p in self._reconfirm.items() if now_ns >= p.until_ns)
            for shard in due:
                pending = self._reconfirm[shard]
                epoch, sequence, model_version = self._progress.get(shard, (pending.epoch, 0, ""))
                changed: dict[str, _NodeState] = {}
                findings: set[tuple[str, str, str]] = set()
                with self.jobs.issuing():
                    cleared = self._end_reconfirm(shard, pending, now_ns, changed, findings)
                    self._record(shard, epoch, sequence, model_version, changed, findings, now_ns, ended=True)
                    if cleared:
                        self.policy.evaluate(now_ns)
                del self._reconfirm[shard]
            return len(due)

    def _start_reconfirm(self, shard: str, epoch: int, now_ns: int) -> None:
        """A newer instance of `shard` forwards: what its previous one left held waits to be said again."""
        pending = self._reconfirm.get(shard)
        if pending is not None and pending.epoch == epoch:
            return   # its first batch had nothing new: the reconfirmation runs from that batch
        alarms = {n for n, st in self._state.items() if st.shard == shard and st.alarm}
        found = {(node, unit, finding) for node, unit, finding, h in self.findings.findings() if h.shard == shard}
        if not alarms and not found:
            self._reconfirm.pop(shard, None)
            return
        self._reconfirm[shard] = _Reconfirm(epoch, now_ns + int(self.settings.reconfirm_seconds * 1e9),
                                            alarms, found)
        log.info("shard %s forwards under a new epoch: %d risk alarms and %d fabric findings its previous "
                 "instance left are cleared unless it raises them again within %g s", shard, len(alarms),
                 len(found), self.settings.reconfirm_seconds)

    def _end_reconfirm(self, shard: str, pending: _Reconfirm, now_ns: int, changed: dict[str, _NodeState],
                       findings: set[tuple[str, str, str]]) -> bool:
        """Clear what `shard`'s new instance has not raised again, into the caller's transaction (`changed`
        and `findings` are what it writes); returns whether anything was cleared here. What an earlier
        try cleared in memory before its commit failed is written again: the rows follow the pending set,
        not only what changes now."""
        why = (f"not raised again by shard {shard}'s new instance within "
               f"{self.settings.reconfirm_seconds:g} s of its first events")
        cleared = False
        for node in sorted(pending.alarms):
            st = self._state.get(node)
            if st is None or st.shard != shard:
                continue   # its leaf moved: another shard judges it now
            if st.alarm:
                st.alarm, st.alarm_since_ns, st.reason = False, 0, ""
                self.policy.clear_alarm(node, st.risk, now_ns, f"risk alarm {why}")
                self.reconfirm_cleared["alarm"] += 1
                cleared = True
            changed[node] = st
        for node, unit, finding in sorted(pending.findings):
            held = self.findings.held(node, unit, finding)
            if held is not None and held.shard != shard:
                continue   # another shard raised it since: it is that shard's now
            if held is not None and self.findings.take(shard, node, unit, finding, False, now_ns,
                                                       f"{unit} {finding.replace('_', ' ')} on {node} {why}"):
                self.reconfirm_cleared["fabric_finding"] += 1
                cleared = True
            findings.add((node, unit, finding))
        if cleared:
            log.warning("shard %s: what its previous instance left and its new one did not raise again within "
                        "%g s is cleared (foreshock_coordinator_reconfirm_cleared_total)", shard,
                        self.settings.reconfirm_seconds)
        return cleared

    def _apply(self, shard: str, e: ShardEvent, now_ns: int) -> _NodeState:
        st = self._state.get(e.node)
        if st is None:
            st = self._state[e.node] = _NodeState(e.node, shard)
        st.shard = shard   # a node moves with its leaf when the shard map changes
        st.topology = e.topology
        self.nodes.set_topology(e.node, e.topology)
        st.risk = e.risk
        st.scored_at_ns = max(st.scored_at_ns, e.ts_ns, 1)
        if e.signals or e.kind != EventKind.RISK:
            st.signals = e.signals
        self.nodes.update_risk([e.node], _array(e.risk), [st.signals], st.scored_at_ns)
        if e.kind == EventKind.RISK:
            self.nodes.seen(e.node, e.ts_ns)
        elif e.kind == EventKind.ALARM:
            if not st.alarm:
                st.alarm, st.alarm_since_ns = True, e.ts_ns or now_ns
            st.reason = e.description or f"risk {e.risk:.3g} at or above the shard's threshold"
            self.policy.raise_alarm(e.node, st.alarm_since_ns, e.risk, f"{st.reason} (shard {shard})")
        elif e.kind == EventKind.CLEARED:
            st.alarm, st.alarm_since_ns, st.reason = False, 0, ""
            self.policy.clear_alarm(e.node, e.risk, now_ns, f"risk {e.risk:.2f}: cleared by shard {shard}")
        elif e.kind == EventKind.FATAL:
            st.fatal_ts_ns, st.fatal_kind = e.ts_ns or now_ns, e.fatal_kind or "fatal"
            st.fatal_description = e.description or st.fatal_kind
            st.fatal_recorded_ns = now_ns
            self.nodes.record_fatal(FatalEvent(e.node, st.fatal_ts_ns, st.fatal_kind, st.fatal_description, now_ns))
        return st

    def _check_model(self, shard: str, version: str) -> None:
        if not self.expected_model:
            self.expected_model = version
            log.info("coordinator: expecting model %s (the first shard's, %s)", version, shard)
        differs = version != self.expected_model
        if differs != self.mismatch.get(shard, False):
            if differs:
                log.warning("shard %s scores with model %s, not %s as expected: its risks are taken as they "
                            "are (foreshock_coordinator_shard_model_mismatch)", shard, version, self.expected_model)
            elif shard in self.mismatch:
                log.info("shard %s scores with the expected model %s again", shard, version)
        self.mismatch[shard] = differs

    def shard_of(self, node: str) -> str | None:
        """The shard that last forwarded an event about `node`, or None. Read without the lock, by the
        Jobs API's step-time routing, which must not wait on a batch's commit: a node that moves shards is
        routed by one or the other."""
        st = self._state.get(node)
        return st.shard if st is not None else None

    def shards(self) -> dict[str, tuple[int, int, str]]:
        with self._lock:
            return dict(self._progress)


def _array(value: float):
    import numpy as np
    return np.asarray([value], dtype=np.float64)


__all__ = ["Coordinator", "CoordinatorSettings", "LeaderLock", "ShardEvent", "EventKind", "check_events",
           "check_step_totals", "PeerTotalsBook", "MAX_EVENTS", "MAX_TOTALS_STEPS", "MAX_TOTALS_GROUPS"]
