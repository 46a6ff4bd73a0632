"""The evacuation policy: from node risk and fatal events to directives, with every decision logged.

Run after each scoring round (`evaluate`) and on operator request (`drain`). The rules, in order
(docs/service.md explains each):
1. Alarm: a node enters alarm when its calibrated risk reaches `threshold` (the model manifest's
   threshold for the false-evacuation budget, overridable) or its features show hard evidence (an NVLink
   link down, a PCIe link below its width, an InfiniBand link down twice in 30 min: the model manifest's
   `hard_evidence`, whatever the risk and the threshold in force; a threshold at 1, where the fleet's score
   level caps it, is reached by no risk: foreshock/risk.py at_or_above), and leaves it only when the risk
   falls under `clear_below` (hysteresis) with no hard evidence left, or at once on a fatal event (Xid
   48/74/79..., GPU lost, link down on a fatal class), which holds for `fatal_hold_seconds`. A
   collateral Xid (foreshock/xid.py) first waits `xid_context_seconds` for its job's or NVLink domain's
   other nodes: on enough of them it is one job event and alarms none (service/xidcontext.py).
2. Persistence: a risk alarm acts once it has lasted `sustain_seconds` (0: the first round above);
   a fatal alarm acts at once.
3. Blast radius: when alarmed nodes make up a large share of a leaf switch, a site or an NVLink domain
   (`incident_fraction`, at least `incident_min_nodes`), the fault is the fabric's, not the nodes':
   it is reported as a fabric incident and no spares are spent on those nodes.
4. Per job: nothing if the job already has an active directive from that node (never issued twice);
   cool-down `cooldown_seconds` after the node's last directive (risk alarms only); at most
   `max_concurrent` active directives per job (the job's own limit, or the service default).
5. Spare: one of the job's spares that hosts no ranks and is no other directive's target, is not in
   alarm, has risk under `spare_max_risk`, no recent fatal event, is not stale, and is not under a
   suspect leaf switch (one with `leaf_suspect_nodes` or more alarmed nodes, the failing node's own
   leaf counted), and is inside the job's multi-node NVLink domain when all the job's nodes share one (an
   NVL72 rack: its ranks talk over NVLink across nodes); spares with fresh telemetry first, then other
   leaves, then the cleanest history (the node history score, `serve --history`), then lowest risk.
   With no spare,
   the job's fallback: SHRINK, or CHECKPOINT_EXIT (the default).
6. The switch step: the job's step extrapolated to now plus enough steps for `lead_seconds`, at least
   `min_steps_ahead`, so every rank hears of it before the boundary comes.
7. Node actions (with `actions`, service/actions.py): every node due under rules 1-3, whether or not
   a job runs there, is handed over to be drained (Slurm) or tainted (Kubernetes), under a breaker.
8. The fabric's services (service/fabricunits.py): nvidia-fabricmanager not serving for the hold on a
   node where it is installed, or nvidia-imex on a node a compute domain uses (a job, registered or the
   inventory's label, on two or more nodes of one NVLink domain: `compute_domain_of`), is
   logged as `fabric_service_down` / `fabric_service_cleared` and exported; one that systemd restarted
   `fabric_service_crash_loop_restarts` times within the window, as `fabric_service_crash_loop` /
   `fabric_service_crash_loop_cleared`; no alarm, no directive, no node action. A node whose Fabric
   Manager is down or crash-looping is refused as a spare (new CUDA contexts fail there). In a sharded
   control plane the shards judge and forward what changed (`on_fabric_change`, service/forwarder.py),
   and the jobs coordinator's policy reads their findings (`units`: a ForwardedFindings).
9. Fail-slow (service/steptimes.py): a node whose rank is consistently slower than its job's other
   ranks is its own alarm, for that job only, logged as `fail_slow` / `fail_slow_cleared`, and acted
   on like a risk alarm (rules 4 to 6: the same per-job limits and cool-down), its directives' cause
   FAIL_SLOW. A fabric incident does not hold it back: the rule compares ranks of one job, not nodes.
   It takes no node action (rule 7): the node is slow for that job, which says little of the others.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from foreshock import fabric
from foreshock.risk import at_or_above
from foreshock.service.actions import Due
from foreshock.service.decisions import DecisionLog
from foreshock.service.fabricunits import (CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW_SECONDS, HOLD_SECONDS, Change,
                                           FabricServices, ForwardedFindings, check_crash_loop, check_hold)
from foreshock.service.jobs import JobDirectory, new_directive, switch_step
from foreshock.service.nodes import NodeBook
from foreshock.service.steptimes import FailSlow, StepTimes
from foreshock.service.domain import ACTIVE_STATES, Directive, DirectiveKind, Fallback, Job
from foreshock.service.xidcontext import XidContext

log = logging.getLogger(__name__)


@dataclass
class PolicySettings:
    threshold: float = 0.5
    clear_below: float | None = None        # None: 0.8 * threshold
    sustain_seconds: float = 0.0
    cooldown_seconds: float = 600.0
    default_max_concurrent: int = 1
    spare_max_risk: float | None = None     # None: clear_below (a spare is a node that would leave alarm)
    leaf_suspect_nodes: int = 2
    incident_min_nodes: int = 3
    incident_fraction: float = 0.5
    lead_seconds: float = 10.0
    min_steps_ahead: int = 2
    deadline_seconds: float = 900.0
    stale_seconds: float = 30.0
    fatal_hold_seconds: float = 3600.0
    xid_context_seconds: float = 5.0        # a collateral Xid waits this long for its job's other nodes; 0: off
    xid_context_min_nodes: int = 3          # nodes of one job or NVLink domain that make a job event ...
    xid_context_fraction: float = 0.25      # ... or this share of them, whichever is fewer (at least 2)
    fabric_service_hold_seconds: float = HOLD_SECONDS   # a fabric service not serving this long is down
    fabric_service_crash_loop_restarts: int = CRASH_LOOP_RESTARTS   # restarted this often ...
    fabric_service_crash_loop_window_seconds: float = CRASH_LOOP_WINDOW_SECONDS   # ... within this: crash-looping

    def __post_init__(self):
        self.fabric_service_hold_seconds = check_hold(self.fabric_service_hold_seconds)
        self.fabric_service_crash_loop_restarts, self.fabric_service_crash_loop_window_seconds = check_crash_loop(
            self.fabric_service_crash_loop_restarts, self.fabric_service_crash_loop_window_seconds)
        XidContext(self.xid_context_seconds, self.xid_context_min_nodes, self.xid_context_fraction)  # range checks
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"policy threshold {self.threshold} must be in (0, 1]")
        if self.default_max_concurrent < 1:  # 0 or less would never let a directive out, not even for Xid 79
            raise ValueError(f"policy default_max_concurrent {self.default_max_concurrent} must be >= 1")
        for name in ("sustain_seconds", "cooldown_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"policy {name} {getattr(self, name)} must be >= 0")
        if self.clear_below is None:
            self.clear_below = 0.8 * self.threshold
        if not 0.0 <= self.clear_below <= self.threshold:
            raise ValueError(f"policy clear_below {self.clear_below} must be in [0, threshold]")
        if self.spare_max_risk is None:
            # not a fixed fraction of the threshold: when incidents are rare, a calibrated model's
            # healthy nodes score near it
            self.spare_max_risk = self.clear_below or self.threshold
        if not 0.0 < self.spare_max_risk <= 1.0:
            raise ValueError(f"policy spare_max_risk {self.spare_max_risk} must be in (0, 1]")


@dataclass
class Alarm:
    since_ns: int
    risk: float
    fatal: bool = False
    reason: str = ""
    evidence: bool = False      # raised by hard evidence (the reason, EVIDENCE_REASON..., says which)

    @property
    def cause(self) -> str:
        """What raised it: "fatal", "hard_evidence" or "risk" (the metrics' `cause` label)."""
        return "fatal" if self.fatal else "hard_evidence" if self.evidence else "risk"


# How an alarm raised by hard evidence is worded: a shard forwards the reason, and the jobs coordinator's
# policy tells such an alarm from a risk alarm by it (raise_alarm).
EVIDENCE_REASON = "hard evidence: "


class EvacuationPolicy:
    def __init__(self, settings: PolicySettings, nodes: NodeBook, jobs: JobDirectory, decisions: DecisionLog,
                 actions=None, step_times: StepTimes | None = None, units: ForwardedFindings | None = None):
        self.settings = settings
        self.actions = actions   # a NodeActions, or None: directives only
        self.step_times = step_times
        self.fail_slow: dict[tuple[str, str], FailSlow] = {}   # (node, job) held fail-slow
        self.nodes = nodes
        self.jobs = jobs
        self.decisions = decisions
        self.alarms: dict[str, Alarm] = {}
        # risk and hard-evidence alarms raised from this policy's own scores, by Alarm.cause (fatal ones and
        # a shard's forwarded ones are not counted): how often the fleet alarms, against the budget the
        # threshold was chosen for
        self.alarms_raised = {"risk": 0, "hard_evidence": 0}
        self.incidents: dict[tuple[str, str], set[str]] = {}
        self._said: dict[tuple[str, str], str] = {}   # (node, job) -> last decision logged, to log changes only
        self._fatal_seen: dict[str, int] = {}
        self._lock = threading.RLock()
        self.context = XidContext(settings.xid_context_seconds, settings.xid_context_min_nodes,
                                  settings.xid_context_fraction)
        # The fabric's services: judged here from their rows, or (the jobs coordinator) as the shards forwarded them.
        self.units = units if units is not None else FabricServices(
            settings.fabric_service_hold_seconds, crash_loop_restarts=settings.fabric_service_crash_loop_restarts,
            crash_loop_window_seconds=settings.fabric_service_crash_loop_window_seconds)
        # Called with each finding raised or cleared and the round's time (a shard's ShardReporter).
        self.on_fabric_change: list[Callable[[Change, int], None]] = []
        jobs.on_deregister.append(lambda job: self.context.remember_job(job.job_id, job.nodes(), jobs.now()))

    # -- Xids in context -----------------------------------------------------------------------------
    def _scopes(self, now_ns: int) -> tuple[dict[str, list], dict[tuple[str, str], int]]:
        """Each node's scopes (its jobs: registered, recently deregistered, the inventory's label; its
        NVLink domain) and each scope's size."""
        members: dict[tuple[str, str], set[str]] = defaultdict(set)
        for job in self.jobs.store.jobs():
            members[("job", job.job_id)] |= job.nodes()
        for job_id, nodes in self.context.gone_jobs(now_ns).items():
            members.setdefault(("job", job_id), set(nodes))
        for node, topo in self.nodes.topologies().items():
            if topo.job:
                members[("job", topo.job)].add(node)
            if topo.nvlink_domain:
                members[("nvlink_domain", topo.nvlink_domain)].add(node)
        scopes: dict[str, list] = defaultdict(list)
        for scope, nodes in members.items():
            for n in nodes:
                scopes[n].append(scope)
        return scopes, {scope: len(nodes) for scope, nodes in members.items()}

    def _context_round(self, now_ns: int) -> None:
        """Collateral Xids whose window has passed: alone, their node's fault; with their job's other
        nodes, one job event (service/xidcontext.py)."""
        ctx = self.context
        if not ctx.busy():
            return
        scopes, sizes = self._scopes(now_ns)
        faults, declared = ctx.decide(now_ns, lambda n: scopes.get(n, ()), lambda sc: sizes.get(sc, 0))
        for ev in declared:
            log.warning("Xid job event: %s", ev.describe())
        for fault in faults:
            self.nodes.record_fatal(fault)
        self._record_closed(now_ns)

    def close_context(self, now_ns: int) -> None:
        """The service stops: open job events are recorded as they stand, not lost with the process."""
        with self._lock:
            self.context.close_all()
            self._record_closed(now_ns)

    def _record_closed(self, now_ns: int) -> None:
        for ev in self.context.take_closed():
            kind, name = ev.scope
            self.decisions.record("xid_job_event", node="", job=name if kind == "job" else "", scope=kind,
                                  nodes=sorted(ev.nodes), reason=ev.describe(), ts_ns=now_ns, xid=ev.xid,
                                  sightings=ev.sightings, first_ns=ev.first_ns, last_ns=ev.last_ns,
                                  scope_name=name, scope_nodes=ev.size)

    # -- the fabric's services -----------------------------------------------------------------------
    def compute_domain_of(self) -> Callable[[str], str]:
        """The compute domain using each node now, named ("" for none): a job with ranks on two or more
        nodes of one multi-node NVLink domain uses it there (its ranks share GPU memory across those
        nodes, which IMEX provides), whether registered here or named by the inventory's `job` label."""
        topologies = self.nodes.topologies()
        placements = {("registered job", job.job_id): job.nodes() for job in self.jobs.store.jobs()}
        for node, topo in topologies.items():
            if topo.job:
                placements.setdefault(("job", topo.job), set()).add(node)
        using: dict[str, str] = {}
        for (what, job_id), nodes in sorted(placements.items()):
            by_domain: dict[str, list[str]] = defaultdict(list)
            for node in nodes:
                topo = topologies.get(node)
                if topo is not None and topo.nvlink_domain:
                    by_domain[topo.nvlink_domain].append(node)
            for domain, members in by_domain.items():
                if len(members) > 1:
                    for node in members:
                        using.setdefault(node, f"{what} {job_id} (NVLink domain {domain})")
        return lambda node: using.get(node, "")

    def _judge_units(self, now_ns: int) -> None:
        for change in self.units.judge(now_ns, self.compute_domain_of):
            u = change.unit
            fields = {**dict(unit=u.unit, active_state=u.state, sub_state=u.sub_state, result=u.result,
                             n_restarts=u.n_restarts, since_ns=u.down_since_ns, compute_domain=u.domain),
                      **change.details}
            if change.raised:
                log.warning("fabric service %s: %s", change.finding.replace("_", " "), change.reason)
            else:
                log.info("fabric service finding cleared: %s", change.reason)
            self.decisions.record(change.kind, node=u.node, reason=change.reason, ts_ns=now_ns, **fields)
            for listener in self.on_fabric_change:
                listener(change, now_ns)

    # -- alarms --------------------------------------------------------------------------------------
    @property
    def risk_alarms_raised(self) -> int:
        """Risk and hard-evidence alarms raised so far: what the false-evacuation budget counts."""
        return sum(self.alarms_raised.values())

    def _open_alarm(self, node: str, alarm: Alarm) -> None:
        """A risk or hard-evidence alarm raised by this policy's round: held, counted against the budget
        (alarms_raised, by its cause), logged."""
        self.alarms[node] = alarm
        self.alarms_raised[alarm.cause] += 1
        self.decisions.record("alarm", node=node, risk=alarm.risk, threshold=self.settings.threshold,
                              reason=alarm.reason, ts_ns=alarm.since_ns)

    def _update_alarms(self, now_ns: int, nodes: list[str] | None, probability: np.ndarray | None,
                       evidence: dict[str, str] | None = None) -> None:
        s = self.settings
        self._context_round(now_ns)
        evidence = evidence or {}
        if nodes is not None and probability is not None and len(nodes):
            p = np.asarray(probability, dtype=np.float64)
            hot = np.flatnonzero(at_or_above(p, s.threshold))
            for i in hot.tolist():
                node = nodes[i]
                alarm = self.alarms.get(node)
                if alarm is None:
                    self._open_alarm(node, Alarm(now_ns, float(p[i]),
                                                 reason=f"risk {p[i]:.3g} at or above threshold {s.threshold:.3g}"))
                else:
                    alarm.risk = max(alarm.risk, float(p[i])) if alarm.fatal else float(p[i])
            index = {n: i for n, i in zip(nodes, range(len(nodes)))} if self.alarms or evidence else {}
            for node, why in sorted(evidence.items()):
                i = index.get(node)
                if i is None or node in self.alarms:
                    continue
                self._open_alarm(node, Alarm(now_ns, float(p[i]), reason=EVIDENCE_REASON + why, evidence=True))
            for node, alarm in list(self.alarms.items()):
                i = index.get(node)
                if alarm.fatal or i is None:
                    continue
                alarm.risk = float(p[i])
                if p[i] < s.clear_below and node not in evidence:
                    del self.alarms[node]
                    self.decisions.record("cleared", node=node, risk=float(p[i]), threshold=s.threshold,
                                          reason=f"risk {p[i]:.2f} fell under {s.clear_below:.2f}", ts_ns=now_ns)
                    for key in [k for k in self._said if k[0] == node]:
                        del self._said[key]
        for node, ev in list(self.nodes.fatal.items()):
            if now_ns - ev.ts_ns > s.fatal_hold_seconds * 1e9:
                continue
            if self._fatal_seen.get(node) == ev.ts_ns:
                continue
            self._fatal_seen[node] = ev.ts_ns
            risk = self.nodes.probability(node) or 0.0
            self.alarms[node] = Alarm(now_ns, risk, fatal=True, reason=f"fatal {ev.description}")
            self.decisions.record("alarm", node=node, risk=risk, threshold=s.threshold,
                                  reason=f"fatal {ev.description}", ts_ns=now_ns)
        for node, alarm in list(self.alarms.items()):
            if alarm.fatal and now_ns - alarm.since_ns > s.fatal_hold_seconds * 1e9:
                del self.alarms[node]

    # -- alarms a shard decided (the jobs coordinator, service/coordinator.py) ----------------------
    @property
    def lock(self) -> threading.RLock:
        """Held by each round; a caller that changes alarms and then evaluates holds it across both."""
        return self._lock

    def raise_alarm(self, node: str, since_ns: int, risk: float, reason: str, *, log_it: bool = True) -> None:
        """A risk alarm that a shard's policy decided (its scores, its hysteresis, its hard evidence: a
        reason that starts with EVIDENCE_REASON): held until cleared."""
        with self._lock:
            alarm = self.alarms.get(node)
            if alarm is not None:
                alarm.risk = max(alarm.risk, risk) if alarm.fatal else risk
                return
            self.alarms[node] = Alarm(since_ns, risk, reason=reason, evidence=reason.startswith(EVIDENCE_REASON))
            if log_it:
                self.decisions.record("alarm", node=node, risk=risk, threshold=self.settings.threshold,
                                      reason=reason, ts_ns=since_ns)

    def clear_alarm(self, node: str, risk: float, now_ns: int, reason: str) -> None:
        with self._lock:
            alarm = self.alarms.get(node)
            if alarm is None or alarm.fatal:
                return
            del self.alarms[node]
            self.decisions.record("cleared", node=node, risk=risk, threshold=self.settings.threshold,
                                  reason=reason, ts_ns=now_ns)
            for key in [k for k in self._said if k[0] == node]:
                del self._said[key]

    def fatal_acted(self, node: str, ts_ns: int) -> None:
        """The fatal event at `ts_ns` was decided on before (by the instance this one took over from)."""
        with self._lock:
            self._fatal_seen[node] = ts_ns

    # -- fail-slow -----------------------------------------------------------------------------------
    def _update_fail_slow(self, now_ns: int) -> dict[tuple[str, str], FailSlow]:
        if self.step_times is None:
            return {}
        held = self.step_times.evaluate(self.jobs.store.jobs())
        for key in sorted(held.keys() - self.fail_slow.keys()):
            v = held[key]
            self.decisions.record("fail_slow", node=v.node, job=v.job_id, ranks=[v.rank], ts_ns=now_ns,
                                  reason=v.reason(self.step_times.settings), ratio=round(v.ratio, 4),
                                  slow_steps=v.slow_steps, judged_steps=v.judged_steps, measure=v.measure)
            log.warning("fail-slow: node %s in job %s (%s)", v.node, v.job_id, v.reason(self.step_times.settings))
        for key in sorted(self.fail_slow.keys() - held.keys()):
            node, job = key
            self.decisions.record("fail_slow_cleared", node=node, job=job, ts_ns=now_ns,
                                  reason="no rank on the node is consistently slower than the job's others "
                                         "now (or the job's placement changed)")
            self._said.pop(key, None)
        self.fail_slow = held
        return held

    # -- blast radius --------------------------------------------------------------------------------
    def _update_incidents(self, now_ns: int) -> set[str]:
        """Fabric incidents (leaf switch, site or NVLink domain) among alarmed nodes; returns the nodes they cover."""
        s = self.settings
        groups: dict[tuple[str, str], set[str]] = defaultdict(set)
        for node in self.alarms:
            topo = self.nodes.topo(node)
            if topo.leaf_switch:
                groups[("leaf_switch", topo.leaf_switch)].add(node)
            if topo.site:
                groups[("site", topo.site)].add(node)
            if topo.nvlink_domain:
                groups[("nvlink_domain", topo.nvlink_domain)].add(node)
        current: dict[tuple[str, str], set[str]] = {}
        for (scope, name), members in groups.items():
            size = len(self.nodes.nodes_under(scope, name))
            if len(members) >= s.incident_min_nodes and len(members) >= s.incident_fraction * max(size, 1):
                current[(scope, name)] = members
        for key, members in current.items():
            if key not in self.incidents:
                scope, name = key
                self.decisions.record(
                    "fabric_incident", node=name, reason=f"{len(members)} of {len(self.nodes.nodes_under(*key))} "
                    f"nodes under {scope} {name} in alarm: a fabric fault, not node faults; no spares spent",
                    scope=scope, nodes=sorted(members), ts_ns=now_ns)
                log.warning("fabric incident: %s %s (%d nodes in alarm)", scope, name, len(members))
        for key in set(self.incidents) - set(current):
            self.decisions.record("fabric_incident_cleared", node=key[1], scope=key[0],
                                  reason=f"{key[0]} {key[1]} no longer has most of its nodes in alarm",
                                  nodes=sorted(self.incidents[key]), ts_ns=now_ns)
        self.incidents = current
        covered: set[str] = set()
        for members in current.values():
            covered |= members
        return covered

    def suspect_leaves(self) -> set[str]:
        counts: dict[str, int] = defaultdict(int)
        for node in self.alarms:
            leaf = self.nodes.topo(node).leaf_switch
            if leaf:
                counts[leaf] += 1
        return {leaf for leaf, n in counts.items() if n >= self.settings.leaf_suspect_nodes}

    # -- spares --------------------------------------------------------------------------------------
    def job_nvlink_domain(self, job: Job) -> str:
        """The multi-node NVLink domain every node of the job is in ("" when they are not all in one):
        such a job's ranks talk over NVLink across nodes, and a spare outside the domain cannot."""
        domains = {self.nodes.topo(node).nvlink_domain for node in job.nodes()}
        return domains.pop() if len(job.nodes()) > 1 and len(domains) == 1 else ""

    def choose_spare(self, job: Job, from_node: str, now_ns: int, busy: set[str]) -> tuple[str | None, str]:
        s = self.settings
        suspect = self.suspect_leaves()
        from_leaf = self.nodes.topo(from_node).leaf_switch
        domain = self.job_nvlink_domain(job)
        ranked, refused = [], []
        for spare in job.spares:
            topo = self.nodes.topo(spare)
            seen = self.nodes.last_seen_ns.get(spare)
            risk = self.nodes.probability(spare)
            fatal = self.nodes.fatal.get(spare)
            why = None
            if domain and topo.nvlink_domain != domain:
                why = f"outside the job's NVLink domain {domain}"
            elif spare in busy:
                why = "busy"
            elif spare in self.alarms:
                why = "in alarm"
            elif risk is not None and risk >= s.spare_max_risk:
                why = f"risk {risk:.3g}"
            elif fatal is not None and now_ns - fatal.ts_ns < s.fatal_hold_seconds * 1e9:
                why = "recent fatal event"
            elif self.units.down(spare, fabric.FABRIC_MANAGER):
                why = "nvidia-fabricmanager down (new CUDA contexts fail)"
            elif self.units.crash_looping(spare, fabric.FABRIC_MANAGER):
                why = "nvidia-fabricmanager crash-looping (new CUDA contexts fail while it restarts)"
            elif seen is not None and now_ns - seen > s.stale_seconds * 1e9:
                why = "telemetry stale"
            elif topo.leaf_switch and topo.leaf_switch in suspect:
                why = f"under suspect leaf {topo.leaf_switch}"
            if why:
                refused.append(f"{spare}: {why}")
                continue
            same_leaf = bool(from_leaf) and topo.leaf_switch == from_leaf
            history = self.nodes.history_risk(spare)
            ranked.append(((seen is None, same_leaf, history if history is not None else 0.0,
                            risk if risk is not None else 0.5, spare), spare))
        if not ranked:
            return None, "no usable spare" + (f" ({'; '.join(refused[:8])})" if refused else " (the job lists none)")
        ranked.sort()
        return ranked[0][1], ""

    def _busy_nodes(self) -> set[str]:
        busy: set[str] = set()
        for job in self.jobs.store.jobs():
            busy |= job.nodes()
        for d in self.jobs.store.directives(active_only=True):
            if d.to_node:
                busy.add(d.to_node)
        return busy

    # -- acting --------------------------------------------------------------------------------------
    def _say(self, node: str, job: str, kind: str, **fields) -> None:
        if self._said.get((node, job)) == kind:
            return
        self._said[(node, job)] = kind
        self.decisions.record(kind, node=node, job=job, **fields)

    def _act(self, job: Job, node: str, now_ns: int, *, risk: float, reason: str, signals, origin: str,
             enforce_limits: bool, fatal: bool, active: list[Directive], last_directive: dict[str, int],
             busy: set[str]) -> Directive | None:
        s = self.settings
        ranks = job.ranks_on(node)
        if not ranks:
            return None
        mine = [d for d in active if d.job_id == job.job_id]
        existing = [d for d in mine if d.from_node == node]
        if existing:
            return existing[0] if origin == "drain" else None
        if enforce_limits:
            last = last_directive.get(node)
            if not fatal and last is not None and now_ns - last < s.cooldown_seconds * 1e9:
                self._say(node, job.job_id, "cooldown", risk=risk, threshold=s.threshold, ts_ns=now_ns,
                          reason=f"{reason}; node had a directive {(now_ns - last) / 1e9:.0f} s ago "
                                 f"(cool-down {s.cooldown_seconds:.0f} s)")
                return None
            limit = job.max_concurrent or s.default_max_concurrent
            if len(mine) >= limit:
                self._say(node, job.job_id, "deferred_max_concurrent", risk=risk, threshold=s.threshold,
                          ts_ns=now_ns, reason=f"{reason}; job has {len(mine)} active evacuations (limit {limit})")
                return None
        spare, why_not = self.choose_spare(job, node, now_ns, busy)
        if spare:
            kind = DirectiveKind.EVACUATE
            why = reason
        else:
            kind = DirectiveKind.SHRINK if job.fallback == Fallback.SHRINK else DirectiveKind.CHECKPOINT_EXIT
            why = f"{reason}; {why_not}: {kind.name.lower()}"
        at_step = switch_step(job, now_ns, lead_seconds=s.lead_seconds, min_steps_ahead=s.min_steps_ahead)
        d = new_directive(job, kind=kind, ranks=ranks, from_node=node, to_node=spare or "", at_step=at_step,
                          now_ns=now_ns, deadline_seconds=s.deadline_seconds, reason=why, risk=risk,
                          signals=signals, origin=origin)
        stored, created = self.jobs.issue(d)
        if created:
            active.append(stored)
            if spare:
                busy.add(spare)
            self._said[(node, job.job_id)] = kind.name.lower()
            self.decisions.record(kind.name.lower(), node=node, job=job.job_id, directive_id=stored.directive_id,
                                  risk=risk, threshold=s.threshold, reason=why, to_node=spare or "",
                                  at_step=at_step, ranks=list(ranks), ts_ns=now_ns,
                                  signals=[sig.name for sig in signals][:5])
        return stored

    def _why(self, alarm: Alarm) -> str:
        if alarm.fatal or alarm.evidence:
            return alarm.reason
        return f"risk {alarm.risk:.3g} above threshold {self.settings.threshold:.3g}"

    def evaluate(self, now_ns: int, nodes: list[str] | None = None,
                 probability: np.ndarray | None = None, evidence: dict[str, str] | None = None) -> list[Directive]:
        """One policy round after a scoring round; returns the directives it issued. `evidence`: node ->
        what its hard evidence shows (ScoreResult.evidence): those nodes alarm whatever their risk."""
        with self._lock:
            self._judge_units(now_ns)
            self._update_alarms(now_ns, nodes, probability, evidence)
            covered = self._update_incidents(now_ns)
            due = [(n, a) for n, a in self.alarms.items()
                   if n not in covered and (a.fatal or now_ns - a.since_ns >= self.settings.sustain_seconds * 1e9)]
            for n in covered:
                for job in self.jobs.jobs_on(n):
                    self._say(n, job.job_id, "held_fabric_incident", ts_ns=now_ns,
                              reason="node is inside a fabric incident; spares are kept")
            if self.actions is not None:
                self.actions.sync({n: Due(self._why(a), a.since_ns, a.fatal) for n, a in due}, now_ns)
            slow = self._update_fail_slow(now_ns)
            if not due and not slow:
                return []
            jobs = self.jobs.store.jobs()
            active = self.jobs.store.directives(active_only=True)
            last = self.jobs.store.last_directive_time()
            busy = self._busy_nodes()
            issued = []
            with self.jobs.issuing():   # one commit for the round's directives, then announced
                for node, alarm in sorted(due, key=lambda x: (not x[1].fatal, -x[1].risk, x[0])):
                    risk_rec = self.nodes.risk.get(node)
                    signals = risk_rec.signals if risk_rec else ()
                    for job in jobs:
                        if node not in job.nodes():
                            continue
                        reason = self._why(alarm)
                        d = self._act(job, node, now_ns, risk=alarm.risk, reason=reason, signals=signals,
                                      origin="fatal" if alarm.fatal else "risk", enforce_limits=True,
                                      fatal=alarm.fatal, active=active, last_directive=last, busy=busy)
                        if d is not None:
                            issued.append(d)
                by_id = {job.job_id: job for job in jobs}
                for (node, job_id), verdict in sorted(slow.items(), key=lambda x: (-x[1].ratio, x[0])):
                    job = by_id.get(job_id)
                    if job is None or node not in job.nodes():
                        continue
                    d = self._act(job, node, now_ns, risk=self.nodes.probability(node) or 0.0,
                                  reason=verdict.reason(self.step_times.settings), signals=(), origin="fail_slow",
                                  enforce_limits=True, fatal=False, active=active, last_directive=last, busy=busy)
                    if d is not None:
                        issued.append(d)
            return issued

    def drain(self, node: str, reason: str, now_ns: int) -> list[Directive]:
        """Operator: move every job's ranks off `node` now (limits do not apply; existing ones are returned)."""
        with self._lock:
            jobs = self.jobs.jobs_on(node)
            active = self.jobs.store.directives(active_only=True)
            busy = self._busy_nodes()
            out = []
            risk = self.nodes.probability(node) or 0.0
            why = f"operator drain: {reason}" if reason else "operator drain"
            self.decisions.record("drain", node=node, reason=why, risk=risk, ts_ns=now_ns,
                                  nodes=[j.job_id for j in jobs])
            for job in jobs:
                d = self._act(job, node, now_ns, risk=risk, reason=why, signals=(), origin="drain",
                              enforce_limits=False, fatal=True, active=active, last_directive={}, busy=busy)
                if d is not None:
                    out.append(d)
            return out


__all__ = ["EvacuationPolicy", "PolicySettings", "Alarm", "ACTIVE_STATES"]
