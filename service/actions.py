"""Node actions where operators act: drain a node in Slurm, taint a Kubernetes node and set its
`ForeshockRisk` condition, under a cluster-wide circuit breaker. docs/actions.md is the reference.

The policy (service/policy.py) decides *when*: a node is due for an action on the same decision that
evacuates its jobs (a fatal alarm, or a risk alarm that has lasted `sustain_seconds`; never a node
inside a fabric incident). It hands the round's due nodes to `NodeActions.sync()`, which only updates
bookkeeping (the scoring thread never waits on Slurm or the Kubernetes API); a thread of its own runs
the calls, each with a deadline, and checks every `recheck_seconds` whether an operator has cleared a
node Foreshock took out.

Per node, one row in the state store (table `node_actions`, service/store.py), so the breaker's count
and what was done survive a restart:

    held ──(a slot frees)──► pending ──(every backend done)──► taken ──(operator clears it)──► released
      └─(alarm ends)─► dropped     └─(max_attempts, or the node is unknown there)─► failed

`pending` and `taken` hold a breaker slot; at most max(1, floor(max_fraction x fleet)) nodes do at once,
the fleet being `fleet_size` or every node the service knows. A node is acted on once per alarm (an
alarm that began after its row was released or failed acts again). Foreshock never undrains: a node it
took out comes back when an operator resumes it (Slurm) or removes the taint (Kubernetes).

The ranges of the settings are declared here (CHECKS), once: `ActionSettings` enforces them and
`foreshock serve` (service/command.py) checks its `[serve]` keys against them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from foreshock import config

log = logging.getLogger(__name__)

TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
CONDITION_TYPE = "ForeshockRisk"
# A label key as Kubernetes defines one: an optional DNS-subdomain prefix and a name of at most 63.
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# A node name reaches scontrol as one argument (no shell), but Slurm reads `a,b` and `gpu[1-64]` as
# lists of nodes: a name from telemetry must name one node and nothing else.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_BACKOFF_SECONDS = 3600.0
SLURM_REASON_PREFIX = "foreshock: "   # marks a drain as Foreshock's (present() looks for it)
UNSURE_RECHECK_NS = 3600 * 1_000_000_000   # how long a timed-out action is looked for
MAX_REMEMBERED_BAD_NAMES = 10_000          # refused node names logged once each, up to this many

CHECKS: dict[str, config.Check] = {
    "timeout_seconds": config.Check(lambda v: 0 < v <= 60, "must be in (0, 60] seconds"),
    "max_fraction": config.Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "fleet_size": config.at_least(0),
    "max_attempts": config.between(1, 20),
    "backoff_seconds": config.between(0.01, MAX_BACKOFF_SECONDS),
    "recheck_seconds": config.between(0.1, 86_400),
    "taint_effect": config.Check(lambda v: v in TAINT_EFFECTS, f"must be one of {', '.join(TAINT_EFFECTS)}"),
    "taint_key": config.Check(lambda v: bool(_LABEL_KEY.match(v)) and len(v) <= 317,
                              "must be a Kubernetes label key (prefix/name)"),
}


@dataclass(frozen=True)
class ActionSettings:
    slurm: bool = False                  # drain due nodes with scontrol
    scontrol: str = "scontrol"           # the scontrol binary
    slurm_conf: str = ""                 # SLURM_CONF for scontrol; "": Slurm's own default
    kubernetes: bool = False             # taint due nodes and set their ForeshockRisk condition
    kubeconfig: str = ""                 # "": the pod's service account (in-cluster)
    taint_key: str = "foreshock.io/failure-risk"
    taint_effect: str = "NoSchedule"     # not NoExecute by default: the migrator moves the ranks first
    timeout_seconds: float = 5.0         # the deadline of one call (scontrol run, or one API request)
    max_fraction: float = 0.05           # the breaker: this share of the fleet at most, at least one node
    fleet_size: int = 0                  # 0: every node the service knows (telemetry or topology)
    max_attempts: int = 5                # calls for one node before it is given up (failed)
    backoff_seconds: float = 10.0        # before the second attempt; doubles each time, at most an hour
    recheck_seconds: float = 60.0        # how often taken nodes are checked for an operator's release

    def __post_init__(self):
        for key, check in CHECKS.items():
            value = getattr(self, key)
            if isinstance(value, float) and not math.isfinite(value) or not check.ok(value):
                raise ValueError(f"actions {key} {value!r}: {check.allowed}")

    @property
    def enabled(self) -> bool:
        return self.slurm or self.kubernetes


CALLS = ("take", "check")        # take a node out; see whether an operator has brought it back
CALL_RESULTS = ("ok", "error", "timeout", "unknown_node")


@dataclass(frozen=True)
class CallResult:
    result: str          # one of CALL_RESULTS
    detail: str = ""
    status: int = 0      # the HTTP status of a Kubernetes API error

    @property
    def ok(self) -> bool:
        return self.result == "ok"

    @property
    def permanent(self) -> bool:
        """Trying again cannot help (the scheduler does not know the node)."""
        return self.result == "unknown_node"


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- Slurm ---------------------------------------------------------------------------------------------
class SlurmBackend:
    """scontrol, run with a deadline; the process group is killed when the deadline passes."""

    name = "slurm"

    def __init__(self, scontrol: str = "scontrol", slurm_conf: str = "", timeout: float = 5.0):
        # a drain that can never run is a configuration error, found at start rather than at the
        # first fatal Xid
        found = shutil.which(scontrol)
        if found is None:
            raise ValueError(f"slurm actions: scontrol {scontrol!r} is not an executable on PATH "
                             "(install Slurm's client, or set slurm_scontrol)")
        if slurm_conf and not os.path.isfile(slurm_conf):
            raise ValueError(f"slurm actions: slurm_conf {slurm_conf!r} is not a file")
        self.scontrol = found
        self.timeout = timeout
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf

    @staticmethod
    def check_name(node: str) -> str | None:
        if node.upper() == "ALL":   # scontrol's word for every node
            return f"node {node!r}: names every node to scontrol"
        return None if _SLURM_NAME.match(node) else \
            f"node {node!r}: not a single Slurm node name (letters, digits, '.', '_', '-')"

    def _run(self, args: list[str]) -> tuple[CallResult, str, str]:
        """(result, stdout, stderr)."""
        try:
            proc = subprocess.Popen([self.scontrol, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=self.env, start_new_session=True)
        except OSError as exc:
            return CallResult("error", f"{self.scontrol}: {exc.strerror or exc}"), "", ""
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            # scontrol waits out slurmctld's MessageTimeout and retries on its own; the deadline is ours
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return CallResult("timeout", f"slurmctld did not answer within {self.timeout:g} s"), "", ""
        if proc.returncode != 0:
            message = _clip(err.strip() or out.strip() or f"exit status {proc.returncode}", 300)
            result = "unknown_node" if "Invalid node name" in message else "error"
            return CallResult(result, message), out, err
        return CallResult("ok"), out, err

    def take(self, node: str, reason: str, fatal: bool = False) -> CallResult:
        # Slurm keeps the reason as one line; quotes are not special to an argv element
        return self._run(["update", f"NodeName={node}", "State=DRAIN",
                          f"Reason={SLURM_REASON_PREFIX}{_clip(reason, 200)}"])[0]

    def present(self, nodes: list[str]) -> dict[str, bool] | None:
        """Which of `nodes` are still drained (or draining) by Foreshock, its reason unchanged (an
        operator who drains one again for a reason of their own takes it over); None when scontrol
        could not tell."""
        result, out, err = self._run(["-o", "show", "node", ",".join(nodes)])
        # A node removed from slurm.conf makes scontrol exit 1 ("Node X not found") after printing
        # the others: the missing one has nothing of Foreshock's left, the others are read as usual.
        if not result.ok and not re.search(r"^Node \S+ not found", out + "\n" + err, re.M):
            log.warning("slurm: checking %d drained nodes: %s", len(nodes), result.detail)
            return None
        states = {}
        for line in out.splitlines():
            name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
            state = re.search(r"(?:^|\s)State=(\S+)", line)
            if name and state:
                states[name.group(1)] = "DRAIN" in state.group(1) and f" Reason={SLURM_REASON_PREFIX}" in line
        return {n: states.get(n, False) for n in nodes}

    def cleared(self, node: str, reason: str) -> None:
        """Nothing to say to Slurm once an operator has resumed the node."""


# -- Kubernetes ----------------------------------------------------------------------------------------
class KubernetesBackend:
    """The official client: a taint on the node (JSON patch, guarded by the node's resourceVersion) and
    the ForeshockRisk condition in its status (strategic merge patch, merged by condition type)."""

    name = "kubernetes"

    def __init__(self, *, kubeconfig: str = "", taint_key: str, taint_effect: str, timeout: float = 5.0,
                 clock=time.time):
        try:
            from kubernetes import client as k8s
            from kubernetes import config as k8s_config
        except ImportError as exc:
            raise ValueError("kubernetes actions need the kubernetes client: pip install 'foreshock[kubernetes]'"
                             f" ({exc})") from None
        self.k8s = k8s
        configuration = k8s.Configuration()
        try:
            if kubeconfig:
                k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
            else:
                k8s_config.load_incluster_config(client_configuration=configuration)
        except Exception as exc:   # the client raises ConfigException, or a YAML/OS error for a bad file
            where = kubeconfig or "the in-cluster service account (automountServiceAccountToken)"
            raise ValueError(f"kubernetes actions: cannot configure the client from {where}: {exc}") from None
        # urllib3 would otherwise retry a refused connection three times at once on each call
        configuration.retries = 0
        self.api = k8s.CoreV1Api(k8s.ApiClient(configuration))
        self.taint_key = taint_key
        self.taint_effect = taint_effect
        self.timeout = timeout
        self._clock = clock

    @staticmethod
    def check_name(node: str) -> str | None:
        return None if len(node) <= 253 and _K8S_NAME.match(node) else \
            f"node {node!r}: not a Kubernetes node name (a lower-case DNS subdomain)"

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return CallResult("ok"), fn(*args, _request_timeout=(self.timeout, self.timeout), **kwargs)
        except self.k8s.ApiException as exc:
            if exc.status == 404:
                return CallResult("unknown_node", f"{what}: the node does not exist"), None
            message = ""
            try:   # the API's Status object says what was wrong
                message = json.loads(exc.body or "{}").get("message", "")
            except (ValueError, AttributeError):
                pass
            detail = f"{what}: HTTP {exc.status} {exc.reason}" + (f": {message}" if message else "")
            return CallResult("error", _clip(detail, 300), exc.status), None
        except Exception as exc:  # urllib3: refused, reset, read timeout
            timed_out = "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower()
            return CallResult("timeout" if timed_out else "error", f"{what}: {_clip(str(exc), 200)}"), None

    def _condition(self, current, status: str, reason: str, message: str) -> dict:
        """The condition's patch; its lastTransitionTime moves only when its status does."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._clock()))
        condition = {"type": CONDITION_TYPE, "status": status, "reason": reason, "message": _clip(message, 1024),
                     "lastHeartbeatTime": now, "lastTransitionTime": now}
        for c in (getattr(current, "status", None) and current.status.conditions) or []:
            if c.type == CONDITION_TYPE and c.status == status and c.last_transition_time is not None:
                condition["lastTransitionTime"] = self.api.api_client.sanitize_for_serialization(c.last_transition_time)
        return {"status": {"conditions": [condition]}}

    def take(self, node: str, reason: str, fatal: bool = False) -> CallResult:
        for _ in range(2):    # once more only if the node changed between the read and the patch
            result, current = self._call("GET node", self.api.read_node, node)
            if not result.ok:
                return result
            # as the API spells them (timeAdded, not the model's time_added), None fields left out: the
            # other taints go back exactly as they were
            taints = [self.api.api_client.sanitize_for_serialization(t) for t in (current.spec.taints or [])]
            if any(t.get("key") == self.taint_key and t.get("effect") == self.taint_effect for t in taints):
                break
            ours = {"key": self.taint_key, "value": "true", "effect": self.taint_effect}
            body = [{"op": "test", "path": "/metadata/resourceVersion", "value": current.metadata.resource_version},
                    {"op": "add", "path": "/spec/taints", "value": taints + [ours]}]
            result, _ = self._call("PATCH node taint", self.api.patch_node, node, body,
                                   _content_type="application/json-patch+json")
            if result.ok:
                break
            # the API server answers a failed test op with 422 "Testing value ... failed"
            if result.status != 409 and not (result.status == 422 and "Testing value" in result.detail):
                return result
        else:
            return result
        result, _ = self._call("PATCH node status", self.api.patch_node_status, node,
                               self._condition(current, "True", "FatalEvent" if fatal else "RiskAboveThreshold",
                                               f"Foreshock: {reason}"),
                               _content_type="application/strategic-merge-patch+json")
        return result

    def present(self, nodes: list[str]) -> dict[str, bool] | None:
        out = {}
        for node in nodes:
            result, current = self._call("GET node", self.api.read_node, node)
            if result.permanent:
                out[node] = False
            elif not result.ok:
                log.warning("kubernetes: checking node %s: %s", node, result.detail)
                return None
            else:
                out[node] = any(t.key == self.taint_key for t in (current.spec.taints or []))
        return out

    def cleared(self, node: str, reason: str) -> None:
        """The taint is gone (an operator removed it): the condition says so too."""
        _, current = self._call("GET node", self.api.read_node, node)
        result, _ = self._call("PATCH node status", self.api.patch_node_status, node,
                               self._condition(current, "False", "TaintRemoved", reason),
                               _content_type="application/strategic-merge-patch+json")
        if not result.ok:
            log.warning("kubernetes: node %s: setting %s False: %s", node, CONDITION_TYPE, result.detail)


def backends_from(s: ActionSettings) -> list:
    out: list = []
    if s.slurm:
        out.append(SlurmBackend(s.scontrol, s.slurm_conf, s.timeout_seconds))
    if s.kubernetes:
        out.append(KubernetesBackend(kubeconfig=s.kubeconfig, taint_key=s.taint_key,
                                     taint_effect=s.taint_effect, timeout=s.timeout_seconds))
    return out


# -- the breaker and the bookkeeping ----------------------------------------------------------------
SLOT_STATES = ("pending", "taken")
STATES = ("held", "pending", "taken", "failed", "released")


@dataclass(frozen=True)
class NodeAction:
    node: str
    state: str
    reason: str
    fatal: bool
    alarm_since_ns: int
    requested_at_ns: int
    updated_at_ns: int
    attempts: int = 0
    next_try_ns: int = 0
    done: tuple[str, ...] = ()       # the backends that have acted on the node
    detail: str = ""                 # the last error
    unsure: bool = False             # given up after a deadline: the call may still land (a controller
    #                                  that was only slow reads its queued requests later), so rechecked


@dataclass(frozen=True)
class Due:
    """A node the policy wants out, and why (service/policy.py builds these)."""
    reason: str
    since_ns: int
    fatal: bool


@dataclass
class ActionStats:
    calls: Counter = field(default_factory=Counter)    # (backend, call, result) -> calls; call: take | check
    held: int = 0                                      # times a node was held back by the breaker
    rejected_names: int = 0                            # due nodes whose name no backend could take


class NodeActions:
    """The breaker, the rows, and the thread that makes the calls. Thread-safe."""

    def __init__(self, settings: ActionSettings, backends: list, store, nodes, decisions, *, clock=time.time_ns):
        self.settings = settings
        self.backends = list(backends)
        self.store = store
        self.nodes = nodes
        self.decisions = decisions
        self._clock = clock
        self._lock = threading.RLock()    # the metrics read the rows from the scrape's thread
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows: dict[str, NodeAction] = {a.node: a for a in store.node_actions()}
        # the held nodes, kept beside the rows: the policy's round asks ten times a second
        self._held: set[str] = {a.node for a in self.rows.values() if a.state == "held"}
        self.stats = ActionStats()
        self._next_recheck = 0.0
        self._bad_names: set[str] = set()
        restored = Counter(a.state for a in self.rows.values())
        if self.rows:
            log.info("node actions: from the state: %s", ", ".join(f"{n} {s}" for s, n in sorted(restored.items())))

    # -- the breaker -------------------------------------------------------------------------------
    def fleet(self) -> int:
        if self.settings.fleet_size:
            return self.settings.fleet_size
        with self._lock:
            acted = set(self.rows)
        return len(self.nodes.known_nodes() | acted)

    def limit(self) -> int:
        return max(1, math.floor(self.settings.max_fraction * self.fleet() + 1e-9))

    def in_slots(self) -> int:
        with self._lock:
            return sum(1 for a in self.rows.values() if a.state in SLOT_STATES)

    def counts(self) -> dict[str, int]:
        with self._lock:
            c = Counter(a.state for a in self.rows.values())
        return {s: c.get(s, 0) for s in STATES}

    # -- from the policy (the scoring thread): bookkeeping only ------------------------------------
    def sync(self, due: Mapping[str, Due], now_ns: int) -> None:
        """The nodes due for an action this round. New ones are admitted while the breaker has slots
        and held otherwise; held ones no longer due are dropped."""
        with self._lock:
            if not due and not self._held:
                return
            changed: list[NodeAction] = []
            dropped: list[str] = []
            for node, why in due.items():
                row = self.rows.get(node)
                if row is not None and (row.state in ("held", "pending", "taken") or why.since_ns <= row.updated_at_ns):
                    continue   # acted on (or given up) for this alarm already
                problem = self._name_problem(node)
                if problem:
                    if node not in self._bad_names:
                        if len(self._bad_names) >= MAX_REMEMBERED_BAD_NAMES:
                            self._bad_names.clear()   # bounded: a name may be logged again, once
                        self._bad_names.add(node)
                        self.stats.rejected_names += 1
                        log.error("node actions: %s; not acted on", problem)
                        self.decisions.record("node_action_failed", node=node, reason=problem, ts_ns=now_ns)
                    continue
                row = NodeAction(node, "held", why.reason, why.fatal, why.since_ns, now_ns, now_ns)
                self._put(row)
                changed.append(row)
            for node in [n for n in self._held if n not in due]:
                dropped.append(node)
                del self.rows[node]
                self._held.discard(node)
            # slots are freed by the thread (which admits then); here only new rows can be admitted
            admitted = self._admit(now_ns) if changed else []
            changed = list({a.node: self.rows[a.node] for a in changed + admitted if a.node in self.rows}.values())
            for row in changed:
                if row.state == "held":
                    self.stats.held += 1
                    msg = (f"circuit breaker: holding back {row.node} ({self.in_slots()} of at most "
                           f"{self.limit()} nodes already drained or tainted, fleet {self.fleet()}); "
                           f"{row.reason}")
                    log.warning("node actions: %s", msg)
                    self.decisions.record("node_action_held", node=row.node, reason=msg, ts_ns=now_ns)
            for node in dropped:
                log.info("node actions: %s no longer due; its held action is dropped", node)
            self._save(changed, dropped)
        if admitted:
            self._wake.set()

    def _put(self, row: NodeAction) -> None:
        """Caller holds the lock."""
        self.rows[row.node] = row
        if row.state == "held":
            self._held.add(row.node)
        else:
            self._held.discard(row.node)

    def _name_problem(self, node: str) -> str:
        return "; ".join(p for b in self.backends if (p := b.check_name(node)))

    def _admit(self, now_ns: int) -> list[NodeAction]:
        """Held rows into free slots, fatal ones first, then the oldest. Caller holds the lock."""
        free = self.limit() - self.in_slots()
        if free <= 0:
            return []
        held = sorted((self.rows[n] for n in self._held),
                      key=lambda a: (not a.fatal, a.requested_at_ns, a.node))
        out = []
        for row in held[:free]:
            row = replace(row, state="pending", updated_at_ns=now_ns, next_try_ns=0)
            self._put(row)
            out.append(row)
        return out

    def _save(self, rows: Iterable[NodeAction], dropped: Iterable[str] = ()) -> None:
        try:
            self.store.put_node_actions(list(rows), list(dropped))
        except Exception:   # the calls still happen; the row is written with the next change
            log.exception("node actions: saving to the state store")

    # -- the thread: the calls ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="foreshock-node-actions", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            # a call in flight ends by its deadline (two for a Kubernetes read and patch)
            self._thread.join(3 * self.settings.timeout_seconds + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.run_once()
            except Exception:   # a bug here must not end the thread: log, and go on after a pause
                log.exception("node actions: round failed")
                wait = self.settings.backoff_seconds
            self._wake.wait(wait)
            self._wake.clear()

    def run_once(self) -> float:
        """Attempt the pending nodes that are due, recheck the taken ones when it is time; returns how
        long to wait for the next thing to do."""
        now = self._clock()
        with self._lock:
            # the cap grows with the fleet (collectors reconnecting after a restart), and held rows
            # restored from the state wait for no new due node
            self._save(self._admit(now))
            todo = [a for a in self.rows.values() if a.state == "pending" and a.next_try_ns <= now]
        for row in sorted(todo, key=lambda a: (not a.fatal, a.requested_at_ns)):
            if self._stop.is_set():
                break
            self._attempt(row)
        if time.monotonic() >= self._next_recheck:
            self._next_recheck = time.monotonic() + self.settings.recheck_seconds
            self._recheck()
        now = self._clock()
        with self._lock:
            tries = [a.next_try_ns for a in self.rows.values() if a.state == "pending"]
        wait = min([self._next_recheck - time.monotonic()] + [(t - now) / 1e9 for t in tries])
        return min(max(wait, 0.0), 1.0)

    def _attempt(self, row: NodeAction) -> None:
        done = list(row.done)
        errors, permanent, timed_out = [], False, False
        for backend in self.backends:
            if backend.name in done:
                continue
            result = backend.take(row.node, row.reason, row.fatal)
            with self._lock:
                self.stats.calls[(backend.name, "take", result.result)] += 1
            if result.ok:
                done.append(backend.name)
            else:
                errors.append(f"{backend.name}: {result.detail}")
                permanent = permanent or result.permanent
                timed_out = timed_out or result.result == "timeout"
        now = self._clock()
        attempts = row.attempts + 1
        with self._lock:   # only this thread changes a pending row
            if not errors:
                row = replace(row, state="taken", attempts=attempts, done=tuple(done), updated_at_ns=now, detail="")
                log.warning("node actions: took %s out (%s): %s", row.node, ", ".join(done), row.reason)
                self.decisions.record("node_action_taken", node=row.node, reason=row.reason, ts_ns=now,
                                      backends=list(done))
            elif permanent or attempts >= self.settings.max_attempts:
                # a node partly out (one backend done) keeps its slot until an operator clears it
                state = "taken" if done else "failed"
                detail = "; ".join(errors)
                row = replace(row, state=state, attempts=attempts, done=tuple(done), updated_at_ns=now,
                              detail=detail, unsure=timed_out and state == "failed")
                log.error("node actions: gave up on %s after %d attempt(s): %s", row.node, attempts, detail)
                self.decisions.record("node_action_failed", node=row.node, reason=f"{row.reason}; {detail}",
                                      ts_ns=now, backends=list(done))
            else:
                delay = min(self.settings.backoff_seconds * 2 ** (attempts - 1), MAX_BACKOFF_SECONDS)
                row = replace(row, attempts=attempts, done=tuple(done), updated_at_ns=now, detail="; ".join(errors),
                              next_try_ns=now + int(delay * 1e9))
                log.warning("node actions: %s, attempt %d of %d failed (next in %.3g s): %s", row.node, attempts,
                            self.settings.max_attempts, delay, row.detail)
            self._put(row)
            changed = [row] + (self._admit(now) if row.state == "failed" else [])
            self._save(changed)

    def _recheck(self) -> None:
        """Taken nodes an operator has brought back (resumed, untainted) free their slots; a node given
        up after a deadline that the scheduler shows taken after all (the call landed late) is taken."""
        now = self._clock()
        with self._lock:
            taken = [a for a in self.rows.values() if a.state == "taken"]
            unsure = [a for a in self.rows.values()
                      if a.state == "failed" and a.unsure and now - a.updated_at_ns < UNSURE_RECHECK_NS]
        if not taken and not unsure:
            return
        seen_by: dict[str, dict[str, bool]] = {}
        for backend in self.backends:
            mine = sorted({a.node for a in taken if backend.name in a.done} | {a.node for a in unsure})
            if not mine:
                continue
            seen = backend.present(mine)
            with self._lock:
                self.stats.calls[(backend.name, "check", "ok" if seen is not None else "error")] += 1
            if seen is None:
                return       # cannot tell: every slot stays as it is until the next recheck
            seen_by[backend.name] = seen
        # released when every backend that acted was asked and none shows its mark; a backend turned
        # off since cannot be asked, so its nodes stay counted
        released = [a for a in taken if a.done and all(b in seen_by for b in a.done)
                    and not any(seen_by[b].get(a.node) for b in a.done)]
        landed = [(a, tuple(b for b in seen_by if seen_by[b].get(a.node))) for a in unsure]
        landed = [(a, done) for a, done in landed if done]
        for row in released:
            reason = f"an operator cleared what Foreshock did ({', '.join(row.done)}); its slot is free"
            for backend in self.backends:
                if backend.name in row.done:
                    backend.cleared(row.node, reason)
        now = self._clock()
        with self._lock:
            changed = []
            for row in released:
                if self.rows.get(row.node) is not row:
                    continue
                row = replace(row, state="released", updated_at_ns=now)
                self._put(row)
                changed.append(row)
                log.info("node actions: %s was brought back by an operator; its breaker slot is free", row.node)
                self.decisions.record("node_action_released", node=row.node, ts_ns=now,
                                      reason="an operator resumed or untainted the node")
            for row, done in landed:
                if self.rows.get(row.node) is not row:
                    continue
                row = replace(row, state="taken", done=done, unsure=False, updated_at_ns=now)
                self._put(row)
                changed.append(row)
                log.warning("node actions: %s is out after all (%s): a call that timed out landed late",
                            row.node, ", ".join(done))
                self.decisions.record("node_action_taken", node=row.node, ts_ns=now, backends=list(done),
                                      reason=f"{row.reason}; a call that timed out landed late")
            changed += self._admit(now)
            self._save(changed)
        if any(a.state == "pending" for a in changed):
            self._wake.set()

    def recheck_now(self) -> None:
        """Check the taken nodes at the thread's next turn (tests, and an operator's hint)."""
        self._next_recheck = 0.0
        self._wake.set()


__all__ = ["ActionSettings", "NodeActions", "Due", "SlurmBackend", "KubernetesBackend", "CHECKS",
           "CONDITION_TYPE", "TAINT_EFFECTS", "backends_from"]
