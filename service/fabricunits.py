"""The NVLink fabric's services judged: nvidia-fabricmanager and nvidia-imex, from their `systemd_unit` rows.

Input: the schema-v1 `systemd_unit` table (foreshock/schema.py), one row per installed unit at each poll
of a node's collector (collectors/systemd.py, every 10 s); which units there are, which of them wait for
a compute domain and which ActiveStates serve is foreshock/fabric.py's. Ingest hands each round's
checked rows over (`observe`: service/ingest.py; the scoring worker sends them back with its verdicts,
`unit_rows`), the policy judges once a round (`judge`, service/policy.py) and writes what changed to
the decision log, and the metrics read `snapshot` (service/metrics.py).

The rules (docs/service.md, "The fabric's services"):
- A unit is *down* once every sample of it for at least `hold_seconds` (the samples' own times, the
  node's clock) said it was not serving. A restart's `activating` sample, or a failed start that
  systemd restarts within the hold, is no finding. An ActiveState systemd does not define (or none) is
  a unit not known to serve: it is taken as not serving, counted (`rows["unknown_state"]`) and logged.
- nvidia-fabricmanager is judged wherever its unit is installed and not masked.
- nvidia-imex is judged only while a compute domain uses the node (`judge`'s `domain_of`, the policy's
  answer); on an idle node its state is recorded and never a finding.
- A masked unit (`systemctl mask`: switched off for good by an administrator) is not judged.
- A unit of which no row came for FORGET_SECONDS is forgotten (uninstalled, the collector sends no row
  for it; or its collector stopped), its finding cleared.
- A unit name that is not a fabric service is ignored and counted; a sample older than the unit's
  latest is ignored and counted. At most MAX_UNITS units are kept; rows of more are dropped and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

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
_COLUMNS = ["node", "unit", "ts", "load_state", "active_state", "sub_state", "result", "n_restarts"]

Row = tuple  # (node, unit, ts_ns, load_state, active_state, sub_state, result, n_restarts)


def check_hold(hold_seconds: float) -> float:
    """The hold's range, where it is declared (PolicySettings, `serve --fabric-service-hold-seconds`)."""
    if not MIN_HOLD_SECONDS <= hold_seconds <= MAX_HOLD_SECONDS:  # written so that NaN fails it too
        raise ValueError(f"fabric_service_hold_seconds {hold_seconds} must be in "
                         f"[{MIN_HOLD_SECONDS:g}, {MAX_HOLD_SECONDS:g}] seconds (the collector polls every 10 s)")
    return float(hold_seconds)


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
    """A finding raised or cleared by one `judge`: what the decision log records."""
    raised: bool
    unit: UnitState
    reason: str


class FabricServices:
    def __init__(self, hold_seconds: float = HOLD_SECONDS, *, max_units: int = MAX_UNITS):
        self.hold_ns = int(check_hold(hold_seconds) * 1e9)
        self.max_units = max_units
        self._units: dict[tuple[str, str], UnitState] = {}
        self._lock = threading.Lock()
        self._judged_ns = 0
        self._said_unknown = 0.0
        self.rows: Counter = Counter()

    # -- rows in -------------------------------------------------------------------------------------
    def observe(self, rows: Iterable[Row], now_ns: int) -> None:
        unknown: list[str] = []
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
        if unknown and time.monotonic() - self._said_unknown >= 60:
            self._said_unknown = time.monotonic()
            log.warning("systemd_unit rows with an ActiveState systemd does not define, taken as not serving "
                        "(%d; at most one line a minute): %s", len(unknown), "; ".join(unknown[:5]))

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
                    if rec.down:
                        changes.append(Change(False, rec, f"{rec.unit} on {rec.node}: no state reported for "
                                              f"{FORGET_SECONDS:.0f} s (uninstalled, or its collector stopped)"))
                    continue
                was = rec.down
                rec.domain = lookup(rec.node) if rec.unit in fabric.COMPUTE_DOMAIN_SERVICES else ""
                rec.judged = rec.load_state != fabric.MASKED and (
                    rec.unit not in fabric.COMPUTE_DOMAIN_SERVICES or bool(rec.domain))
                rec.down = rec.judged and rec.down_since_ns is not None and \
                    rec.ts_ns - rec.down_since_ns >= self.hold_ns
                if rec.down and not was:
                    changes.append(Change(True, rec, self._why_down(rec)))
                elif was and not rec.down:
                    changes.append(Change(False, rec, self._why_cleared(rec)))
        return changes

    def _why_down(self, rec: UnitState) -> str:
        held = (rec.ts_ns - rec.down_since_ns) / 1e9
        why = f"{rec.describe()} on {rec.node} for {held:.0f} s"
        if rec.unit == fabric.FABRIC_MANAGER:
            return why + ": the node's NVSwitch fabric is unmanaged; new CUDA contexts fail there (refused as a spare)"
        return why + f", while {rec.domain} uses the node: its GPUs cannot share memory with the domain's other nodes"

    @staticmethod
    def _why_cleared(rec: UnitState) -> str:
        if rec.serving:
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

    def snapshot(self) -> list[UnitState]:
        with self._lock:
            return [UnitState(**vars(rec)) for rec in self._units.values()]

    def row_counts(self) -> dict[str, int]:
        with self._lock:
            return {r: self.rows.get(r, 0) for r in ROW_RESULTS}
