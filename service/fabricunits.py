"""The NVLink fabric's services judged: nvidia-fabricmanager and nvidia-imex, from their `systemd_unit` rows.

Input: the schema-v1 `systemd_unit` table (foreshock/schema.py), one row per installed unit at each poll
of a node's collector (collectors/systemd.py, every 10 s); which units there are, which of them wait for
a compute domain and which ActiveStates serve is foreshock/fabric.py's. Ingest hands each round's
checked rows over (`observe`: service/ingest.py; the scoring worker sends them back with its verdicts,
`unit_rows`), the policy judges once a round (`judge`, service/policy.py) and writes what changed to
the decision log, and the metrics read `snapshot` (service/metrics.py).

In a sharded control plane the shards judge and the jobs coordinator chooses spares: a shard forwards
each change (Coordinator.ForwardAlarms, a FABRIC_SERVICE event: proto/foreshock/v1/coordinator.proto),
and the coordinator's policy reads `ForwardedFindings` in place of `FabricServices`, the same readers
(`down`, `crash_looping`) fed by those events (service/coordinator.py).

The rules (docs/service.md, "The fabric's services"):
- A unit is *down* once every sample of it for at least `hold_seconds` (the samples' own times, the
  node's clock) said it was not serving. A restart's `activating` sample, or a failed start that
  systemd restarts within the hold, is no finding. An ActiveState systemd does not define (or none) is
  a unit not known to serve: it is taken as not serving, counted (`rows["unknown_state"]`) and logged.
- A unit is *crash-looping* once its `n_restarts` (systemd's NRestarts) grew by at least
  `crash_loop_restarts` within `crash_loop_window_seconds` (samples' times): a unit that systemd
  restarts over and over is sampled serving now and then, which starts the hold over each time. The
  finding clears once the count has not grown for the window. Growth is counted between two samples
  of the unit, at the later one; the first sample of a unit is only a baseline (when its restarts
  happened is not known). A count lower than the last is a reset (a start by hand, a reboot: systemd
  starts NRestarts at 0 again), a new baseline and no growth. A null count (systemd older than 235)
  leaves this judgement out for that sample. A value that is no count (negative, not an integer,
  beyond uint32) or one that grew faster than MAX_RESTARTS_PER_SECOND is counted
  (`restart_samples["absurd"]`) and logged, never growth; the latter becomes the baseline, so that a
  counter that jumped is compared with itself from then on (and its fall back is a reset).
- nvidia-fabricmanager is judged wherever its unit is installed and not masked (both findings).
- nvidia-imex is judged only while a compute domain uses the node (`judge`'s `domain_of`, the policy's
  answer); on an idle node its state and restarts are recorded and never a finding.
- A masked unit (`systemctl mask`: switched off for good by an administrator) is not judged.
- A unit of which no row came for FORGET_SECONDS is forgotten (uninstalled, the collector sends no row
  for it; or its collector stopped), its findings cleared.
- A unit name that is not a fabric service is ignored and counted; a sample older than the unit's
  latest is ignored and counted. At most MAX_UNITS units are kept; rows of more are dropped and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import pyarrow as pa

from foreshock import fabric

log = logging.getLogger(__name__)

HOLD_SECONDS = 60.0          # six 10-s polls: a restart (FM trains the NVLinks first) fits in it
MIN_HOLD_SECONDS = 10.0      # one poll interval: a single sample never makes a finding
MAX_HOLD_SECONDS = 3600.0
FORGET_SECONDS = 600.0       # no row of a unit this long: it was uninstalled, or its collector stopped
JUDGE_SECONDS = 1.0          # judged at most this often: the hold is ten times longer
MAX_UNITS = 200_000          # (node, unit) pairs kept: two units on 100,000 nodes
MAX_TEXT = 64                # sub_state and result as the decision log keeps them
UNKNOWN = "unknown"          # the state of a unit whose ActiveState is none systemd defines
ROW_RESULTS = ("taken", "old", "unknown_state", "unknown_unit", "not_installed", "overflow")
# Three automatic restarts in ten minutes: one is a recovery, two can be a crash and its retry, a third
# within minutes is a loop. systemd itself stops a unit that restarts faster than its start rate limit
# (StartLimitBurst=5 in StartLimitIntervalSec=10 s by default), which then stays failed: the down
# finding's case. The loops this finds are the slower ones, that look serving between crashes.
CRASH_LOOP_RESTARTS = 3
MIN_CRASH_LOOP_RESTARTS = 2          # 1 would make every restart a finding, which the hold is there to avoid
MAX_CRASH_LOOP_RESTARTS = 1000       # bounds what a unit keeps: one entry per sample whose count grew
CRASH_LOOP_WINDOW_SECONDS = 600.0
MIN_CRASH_LOOP_WINDOW_SECONDS = 60.0     # six polls: growth is seen once per poll, at its sample
MAX_CRASH_LOOP_WINDOW_SECONDS = 86_400.0
# Ten times the pace of systemd's default RestartSec (100 ms): a count growing faster is no count of restarts.
MAX_RESTARTS_PER_SECOND = 100.0
MAX_COUNT = (1 << 32) - 1            # NRestarts is systemd's unsigned int (schema: uint32)
# Samples that grew kept per unit, at least (the rule's number if larger): the decision log's count is
# exact unless more polls than this grew within the window (ten minutes of 10-s polls each growing fit).
GROWTH_KEPT = 64
RESTART_RESULTS = ("first", "same", "grew", "reset", "missing", "absurd")
DOWN, CRASH_LOOP = "down", "crash_loop"
FINDINGS = (DOWN, CRASH_LOOP)
# Findings a jobs coordinator holds from its shards: both findings of every unit FabricServices keeps.
MAX_FORWARDED = len(FINDINGS) * MAX_UNITS
# What the decision log calls a finding raised (True) and cleared (False).
DECISION_KINDS = {(DOWN, True): "fabric_service_down", (DOWN, False): "fabric_service_cleared",
                  (CRASH_LOOP, True): "fabric_service_crash_loop",
                  (CRASH_LOOP, False): "fabric_service_crash_loop_cleared"}
_COLUMNS = ["node", "unit", "ts", "load_state", "active_state", "sub_state", "result", "n_restarts"]

Row = tuple  # (node, unit, ts_ns, load_state, active_state, sub_state, result, n_restarts)


def check_hold(hold_seconds: float) -> float:
    """The hold's range, where it is declared (PolicySettings, `serve --fabric-service-hold-seconds`)."""
    if not MIN_HOLD_SECONDS <= hold_seconds <= MAX_HOLD_SECONDS:  # written so that NaN fails it too
        raise ValueError(f"fabric_service_hold_seconds {hold_seconds} must be in "
                         f"[{MIN_HOLD_SECONDS:g}, {MAX_HOLD_SECONDS:g}] seconds (the collector polls every 10 s)")
    return float(hold_seconds)


def check_crash_loop(restarts: int, window_seconds: float) -> tuple[int, float]:
    """The crash-loop rule's ranges, where they are declared (PolicySettings, `serve
    --fabric-service-crash-loop-restarts` and `--fabric-service-crash-loop-window-seconds`)."""
    if isinstance(restarts, bool) or not isinstance(restarts, int) or \
            not MIN_CRASH_LOOP_RESTARTS <= restarts <= MAX_CRASH_LOOP_RESTARTS:
        raise ValueError(f"fabric_service_crash_loop_restarts {restarts!r} must be an integer in "
                         f"[{MIN_CRASH_LOOP_RESTARTS}, {MAX_CRASH_LOOP_RESTARTS}]")
    if not MIN_CRASH_LOOP_WINDOW_SECONDS <= window_seconds <= MAX_CRASH_LOOP_WINDOW_SECONDS:
        raise ValueError(f"fabric_service_crash_loop_window_seconds {window_seconds} must be in "
                         f"[{MIN_CRASH_LOOP_WINDOW_SECONDS:g}, {MAX_CRASH_LOOP_WINDOW_SECONDS:g}] seconds "
                         f"(the collector polls every 10 s)")
    return restarts, float(window_seconds)


def unit_rows(table: pa.Table) -> list[Row]:
    """A checked `systemd_unit` table as the plain tuples `observe` takes (and the worker's pipe carries)."""
    t = table.select(_COLUMNS)
    ts = t.column("ts").cast(pa.int64()).to_pylist()
    cols = [t.column(c).to_pylist() for c in _COLUMNS]
    cols[2] = ts
    return list(zip(*cols))


@dataclass
class UnitState:
    node: str
    unit: str
    state: str                 # the ActiveState, or UNKNOWN
    sub_state: str
    result: str
    load_state: str
    n_restarts: int | None
    ts_ns: int                 # the latest sample's time (the node's clock)
    down_since_ns: int | None  # the first sample of the current run of samples not serving
    received_ns: int           # when its latest row was taken (the service's clock)
    judged: bool = False
    down: bool = False         # judged, and not serving for at least the hold: a finding
    domain: str = ""           # the compute domain using the node when last judged (IMEX)
    count: int | None = None   # the last n_restarts taken: what the next one is compared with
    count_ns: int = 0          # its sample's time
    growth: deque = field(default_factory=deque)  # (sample ts, restarts since the sample before), in the window
    grew_ns: int | None = None  # the latest sample whose count grew
    crash_looping: bool = False  # judged, and restarted crash_loop_restarts times within the window: a finding

    def restarts_since(self, since_ns: int) -> int:
        return sum(n for ts, n in self.growth if ts > since_ns)

    @property
    def serving(self) -> bool:
        return self.state in fabric.SERVING_STATES

    def describe(self) -> str:
        what = f"{self.unit} {self.state}"
        if self.sub_state:
            what += f" ({self.sub_state}"
            what += f", result {self.result})" if self.result else ")"
        return what


@dataclass(frozen=True)
class Change:
    """A finding (DOWN or CRASH_LOOP) raised or cleared by one `judge`: what the decision log records."""
    raised: bool
    unit: UnitState
    reason: str
    finding: str = DOWN
    details: dict = field(default_factory=dict)   # the finding's own fields for the decision log

    @property
    def kind(self) -> str:
        return DECISION_KINDS[(self.finding, self.raised)]


class FabricServices:
    def __init__(self, hold_seconds: float = HOLD_SECONDS, *, crash_loop_restarts: int = CRASH_LOOP_RESTARTS,
                 crash_loop_window_seconds: float = CRASH_LOOP_WINDOW_SECONDS, max_units: int = MAX_UNITS):
        self.hold_ns = int(check_hold(hold_seconds) * 1e9)
        self.loop_restarts, window = check_crash_loop(crash_loop_restarts, crash_loop_window_seconds)
        self.loop_window_ns = int(window * 1e9)
        self.growth_kept = max(self.loop_restarts, GROWTH_KEPT)
        self.max_units = max_units
        self._units: dict[tuple[str, str], UnitState] = {}
        self._lock = threading.Lock()
        self._judged_ns = 0
        self._said_unknown = 0.0
        self._said_absurd = 0.0
        self.rows: Counter = Counter()
        self.restart_samples: Counter = Counter()

    # -- rows in -------------------------------------------------------------------------------------
    def observe(self, rows: Iterable[Row], now_ns: int) -> None:
        unknown: list[str] = []
        absurd: list[str] = []
        with self._lock:
            # Oldest first: one round may hold several polls of a unit (a collector's backlog after a
            # reconnect), and the first sample of a run not serving is when it went down.
            for node, unit, ts_ns, load_state, active_state, sub_state, result, n_restarts in \
                    sorted(rows, key=lambda r: r[2]):
                if unit not in fabric.FABRIC_SERVICES:
                    self.rows["unknown_unit"] += 1
                    continue
                key = (node, unit)
                if load_state == "not-found":   # the collector sends none; a row of one is no unit here
                    self.rows["not_installed"] += 1
                    self._units.pop(key, None)
                    continue
                rec = self._units.get(key)
                if rec is not None and ts_ns <= rec.ts_ns:
                    self.rows["old"] += 1
                    continue
                state = active_state if active_state in fabric.SERVING_STATES or \
                    active_state in fabric.NOT_SERVING_STATES else UNKNOWN
                if state == UNKNOWN:
                    unknown.append(f"{node} {unit}: {str(active_state)[:MAX_TEXT]!r}")
                if rec is None:
                    if len(self._units) >= self.max_units:
                        self.rows["overflow"] += 1
                        continue
                    rec = self._units[key] = UnitState(node, unit, state, "", "", "", None, ts_ns, None, now_ns)
                serving = state in fabric.SERVING_STATES
                # The run of samples not serving starts at its first one (down_since_ns is None while serving).
                rec.down_since_ns = None if serving else (
                    rec.down_since_ns if rec.down_since_ns is not None else ts_ns)
                rec.state = state
                rec.sub_state = (sub_state or "")[:MAX_TEXT]
                rec.result = (result or "")[:MAX_TEXT]
                rec.load_state = (load_state or "")[:MAX_TEXT]
                rec.n_restarts = n_restarts
                rec.ts_ns = ts_ns
                rec.received_ns = now_ns
                self.rows["unknown_state" if state == UNKNOWN else "taken"] += 1
                result = self._count_restarts(rec, n_restarts, ts_ns)
                self.restart_samples[result] += 1
                if result == "absurd":
                    absurd.append(f"{node} {unit}: {str(n_restarts)[:MAX_TEXT]}")
        if unknown and time.monotonic() - self._said_unknown >= 60:
            self._said_unknown = time.monotonic()
            log.warning("systemd_unit rows with an ActiveState systemd does not define, taken as not serving "
                        "(%d; at most one line a minute): %s", len(unknown), "; ".join(unknown[:5]))
        if absurd and time.monotonic() - self._said_absurd >= 60:
            self._said_absurd = time.monotonic()
            log.warning("systemd_unit rows whose n_restarts is no count of restarts, or grew faster than %g a "
                        "second: not judged as restarts (%d; at most one line a minute): %s",
                        MAX_RESTARTS_PER_SECOND, len(absurd), "; ".join(absurd[:5]))

    def _count_restarts(self, rec: UnitState, n, ts_ns: int) -> str:
        """Take one sample's n_restarts into the unit's growth; returns its RESTART_RESULTS word."""
        if n is None:
            return "missing"
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_COUNT:
            rec.n_restarts = None
            return "absurd"
        last, last_ns = rec.count, rec.count_ns
        rec.count, rec.count_ns = n, ts_ns
        if last is None:
            return "first"
        if n == last:
            return "same"
        if n < last:
            return "reset"
        if n - last > MAX_RESTARTS_PER_SECOND * max((ts_ns - last_ns) / 1e9, 1.0):
            return "absurd"
        rec.growth.append((ts_ns, n - last))
        rec.grew_ns = ts_ns
        # Entries are at least 1 each: the rule's number of the latest ones decide it, older ones cannot.
        while len(rec.growth) > self.growth_kept:
            rec.growth.popleft()
        return "grew"

    # -- judging -------------------------------------------------------------------------------------
    def judge(self, now_ns: int, domain_of: Callable[[], Callable[[str], str]]) -> list[Change]:
        """Judge every unit kept (at most once a JUDGE_SECONDS) and return the findings raised and
        cleared. `domain_of()` gives the function naming the compute domain that uses a node ("" for
        none); it is asked only when there is an IMEX unit to judge."""
        if now_ns - self._judged_ns < JUDGE_SECONDS * 1e9:
            return []
        self._judged_ns = now_ns
        changes: list[Change] = []
        with self._lock:
            needs_domain = any(u in fabric.COMPUTE_DOMAIN_SERVICES for _, u in self._units)
        lookup = domain_of() if needs_domain else (lambda node: "")
        with self._lock:
            for key, rec in list(self._units.items()):
                if now_ns - rec.received_ns > FORGET_SECONDS * 1e9:
                    del self._units[key]
                    gone = (f"{rec.unit} on {rec.node}: no state reported for {FORGET_SECONDS:.0f} s "
                            f"(uninstalled, or its collector stopped)")
                    if rec.down:
                        changes.append(Change(False, rec, gone))
                    if rec.crash_looping:
                        changes.append(Change(False, rec, gone, CRASH_LOOP, self._loop_details(rec)))
                    continue
                was, was_looping = rec.down, rec.crash_looping
                rec.domain = lookup(rec.node) if rec.unit in fabric.COMPUTE_DOMAIN_SERVICES else ""
                rec.judged = rec.load_state != fabric.MASKED and (
                    rec.unit not in fabric.COMPUTE_DOMAIN_SERVICES or bool(rec.domain))
                rec.down = rec.judged and rec.down_since_ns is not None and \
                    rec.ts_ns - rec.down_since_ns >= self.hold_ns
                if rec.down and not was:
                    changes.append(Change(True, rec, self._why_down(rec)))
                elif was and not rec.down:
                    changes.append(Change(False, rec, self._why_cleared(rec)))
                window_start = rec.ts_ns - self.loop_window_ns
                while rec.growth and rec.growth[0][0] <= window_start:
                    rec.growth.popleft()
                # Raised at the rule's number of restarts, cleared only by a window without any: a loop
                # that slows down stays one until it has stopped.
                quiet = rec.grew_ns is None or rec.grew_ns <= window_start
                rec.crash_looping = rec.judged and not quiet and (
                    was_looping or rec.restarts_since(window_start) >= self.loop_restarts)
                if rec.crash_looping and not was_looping:
                    changes.append(Change(True, rec, self._why_looping(rec), CRASH_LOOP, self._loop_details(rec)))
                elif was_looping and not rec.crash_looping:
                    why = (f"{rec.unit} on {rec.node} has not restarted for {self.loop_window_ns / 1e9:.0f} s"
                           if rec.judged else self._why_cleared(rec))   # masked, or no compute domain now
                    changes.append(Change(False, rec, why, CRASH_LOOP, self._loop_details(rec)))
        return changes

    def _loop_details(self, rec: UnitState) -> dict:
        """since_ns: the first sample in the window whose count grew (None once it is quiet)."""
        return {"restarts_in_window": rec.restarts_since(rec.ts_ns - self.loop_window_ns),
                "window_seconds": self.loop_window_ns / 1e9, "last_restart_ns": rec.grew_ns,
                "since_ns": rec.growth[0][0] if rec.growth else None}

    def _why_looping(self, rec: UnitState) -> str:
        why = (f"{rec.unit} on {rec.node} restarted {rec.restarts_since(rec.ts_ns - self.loop_window_ns)} times "
               f"within {self.loop_window_ns / 1e9:.0f} s (NRestarts {rec.count}; now {rec.state})")
        if rec.unit == fabric.FABRIC_MANAGER:
            return why + (": each restart leaves the NVSwitch fabric unmanaged and fails new CUDA contexts "
                          "(refused as a spare)")
        return why + f", while {rec.domain} uses the node: each restart breaks its memory sharing with the domain"

    def _why_down(self, rec: UnitState) -> str:
        held = (rec.ts_ns - rec.down_since_ns) / 1e9
        why = f"{rec.describe()} on {rec.node} for {held:.0f} s"
        if rec.unit == fabric.FABRIC_MANAGER:
            return why + ": the node's NVSwitch fabric is unmanaged; new CUDA contexts fail there (refused as a spare)"
        return why + f", while {rec.domain} uses the node: its GPUs cannot share memory with the domain's other nodes"

    @staticmethod
    def _why_cleared(rec: UnitState) -> str:
        if rec.serving and rec.judged:
            return f"{rec.unit} on {rec.node} serves again ({rec.state})"
        if rec.load_state == fabric.MASKED:
            return f"{rec.unit} on {rec.node} is masked: not judged"
        return f"{rec.unit} on {rec.node}: no compute domain uses the node now (an idle node's IMEX is not judged)"

    # -- readers -------------------------------------------------------------------------------------
    @property
    def judged_ns(self) -> int:
        """When the last judgement ran (the policy's clock); 0: none yet."""
        return self._judged_ns

    def down(self, node: str, unit: str) -> bool:
        rec = self._units.get((node, unit))
        return rec is not None and rec.down

    def crash_looping(self, node: str, unit: str) -> bool:
        rec = self._units.get((node, unit))
        return rec is not None and rec.crash_looping

    def snapshot(self) -> list[UnitState]:
        with self._lock:
            return [replace(rec, growth=deque(rec.growth)) for rec in self._units.values()]

    def row_counts(self) -> dict[str, int]:
        with self._lock:
            return {r: self.rows.get(r, 0) for r in ROW_RESULTS}

    def restart_counts(self) -> dict[str, int]:
        with self._lock:
            return {r: self.restart_samples.get(r, 0) for r in RESTART_RESULTS}


@dataclass(frozen=True)
class Held:
    """A forwarded finding as the coordinator holds it: the shard that raised it, and when it judged so."""
    shard: str
    since_ns: int


class ForwardedFindings:
    """The findings the shards judged and forwarded, where the jobs coordinator chooses spares: the
    readers the policy asks of FabricServices, fed by `take` (service/coordinator.py) instead of rows.

    Held per (node, unit, finding) with the shard that raised it. A clear from another shard is ignored
    and counted (`ignored`): a node the shard map moves is judged afresh by its new shard, while the old
    one clears what it held only when it forgets the unit (FORGET_SECONDS without a row), which must not
    undo what the new shard found; a raise from another shard takes the finding over. At most
    `max_findings` are held; a raise beyond is dropped and counted (`overflow`). It judges nothing:
    `judge` hands the policy the changes taken since its last call, for the decision log (the
    coordinator runs the policy after every batch that holds such an event, so they do not pile up)."""

    def __init__(self, max_findings: int = MAX_FORWARDED):
        self.max_findings = max_findings
        self._held: dict[tuple[str, str, str], Held] = {}
        self._changes: list[Change] = []
        self._lock = threading.Lock()
        self._judged_ns = 0
        self.ignored = 0
        self.overflow = 0

    def take(self, shard: str, node: str, unit: str, finding: str, raised: bool, ts_ns: int, reason: str = "",
             *, record: bool = True) -> bool:
        """One finding a shard raised or cleared (unit and finding already checked: coordinator.check_events);
        returns whether what is held changed. record=False: no change for the decision log (a takeover's
        restore: the leader before it logged them)."""
        key = (node, unit, finding)
        with self._lock:
            held = self._held.get(key)
            if raised:
                if held is not None:
                    if held.shard != shard:
                        self._held[key] = Held(shard, held.since_ns)
                    return False
                if len(self._held) >= self.max_findings:
                    self.overflow += 1
                    log.warning("forwarded fabric service finding dropped: %d held already (%s %s on %s, shard %s)",
                                self.max_findings, unit, finding, node, shard)
                    return False
                self._held[key] = Held(shard, ts_ns)
            else:
                if held is None:
                    return False
                if held.shard != shard:
                    self.ignored += 1
                    log.info("%s %s on %s cleared by shard %s, but shard %s raised it (the node moved): kept",
                             unit, finding, node, shard, held.shard)
                    return False
                del self._held[key]
            if record:
                rec = UnitState(node, unit, "", "", "", "", None, ts_ns, None, ts_ns, judged=True,
                                down=(node, unit, DOWN) in self._held,
                                crash_looping=(node, unit, CRASH_LOOP) in self._held)
                why = reason or f"{unit} {finding.replace('_', ' ')} on {node} {'raised' if raised else 'cleared'}"
                self._changes.append(Change(raised, rec, f"{why} (shard {shard})", finding, {"shard": shard}))
            return True

    def restore(self, rows: Iterable[tuple]) -> None:
        """(node, unit, finding, shard, since_ns) rows, as the coordinator's state keeps them."""
        for node, unit, finding, shard, since_ns in rows:
            self.take(shard, node, unit, finding, True, since_ns, record=False)

    def held(self, node: str, unit: str, finding: str) -> Held | None:
        return self._held.get((node, unit, finding))

    def findings(self) -> list[tuple[str, str, str, Held]]:
        with self._lock:
            return sorted((*key, held) for key, held in self._held.items())

    # -- FabricServices' readers ---------------------------------------------------------------------
    def judge(self, now_ns: int, domain_of: Callable | None = None) -> list[Change]:
        with self._lock:
            self._judged_ns = now_ns
            changes, self._changes = self._changes, []
        return changes

    @property
    def judged_ns(self) -> int:
        return self._judged_ns

    def down(self, node: str, unit: str) -> bool:
        return (node, unit, DOWN) in self._held

    def crash_looping(self, node: str, unit: str) -> bool:
        return (node, unit, CRASH_LOOP) in self._held

    def snapshot(self) -> list[UnitState]:
        """Empty: each unit's series come from the shard that judges it, not again from the coordinator."""
        return []

    def row_counts(self) -> dict[str, int]:
        return dict.fromkeys(ROW_RESULTS, 0)

    def restart_counts(self) -> dict[str, int]:
        return dict.fromkeys(RESTART_RESULTS, 0)
