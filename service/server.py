"""The control plane, built by a function: `build_server(Settings) -> ControlPlane`, then start()/stop().

    plane = build_server(Settings(state_dir=tmp, insecure=True))   # loopback only, every role allowed
    port = plane.start()                                            # listen on port 0 works
    ...
    plane.stop(grace=1.0)

It builds the domain objects (store, job directory, node book, ingest, round scheduler, policy, decision
log, archive, metrics), each given at construction what it calls, and the asyncio gRPC server (Telemetry, Risk, Jobs, health checking, reflection) that
runs on its own event-loop thread, so callers (tests, `foreshock serve`, the migrator's tests) use it
from plain synchronous code. docs/service.md lists the settings and the API.

Two roles past one instance (docs/scaling.md): with `coordinator` settings it is the jobs coordinator,
which builds all of that only once it holds the lease (service/coordinator.py LeaderLock) and serves as
the standby until then; with `forward` settings it is a scoring shard whose rounds go to the
coordinator (service/forwarder.py) and whose Jobs API refuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from foreshock.config import parse_listen
from foreshock.net import is_loopback
from foreshock.predictor import fleetlevel
from foreshock.service import store as store_mod
from foreshock.service.actions import ActionSettings, NodeActions, backends_from
from foreshock.service.archive import Archive, ArchiveError, ArchiveSettings
from foreshock.service.archive_process import ArchiveProcess
from foreshock.service.auth import (
    Authenticator, AuthInterceptor, Principal, server_credentials)
from foreshock.service.coordinator import Coordinator, CoordinatorSettings, LeaderLock
from foreshock.service.decisions import DecisionLog
from foreshock.service.fabricunits import ForwardedFindings
from foreshock.service.forwarder import AlarmForwarder, ForwardSettings, ShardReporter
from foreshock.service.ingest import Ingest, IngestLimits
from foreshock.service.jobs import JobDirectory
from foreshock.service.metrics import build_registry, serve_http, standby_registry
from foreshock.service.nodes import NodeBook, Topology
from foreshock.service.policy import EvacuationPolicy, PolicySettings
from foreshock.service.rounds import InProcessPipeline, RoundScheduler
from foreshock.service.scoring import ModelError, NullScorer, PredictorScorer, default_model_path
from foreshock.service.shardmap import ShardGate, ShardMap, ShardMapError, ShardMapFile, changes, labels_of, shard_check
from foreshock.service.servicers import (
    CoordinatorServicer, JobsServicer, RiskServicer, TelemetryServicer, UndecodableRequests, shard_jobs_handler,
    standby_handler)
from foreshock.service.steps import CloseHold
from foreshock.service.steptimes import FailSlowSettings, StepTimes
from foreshock.service.worker import ScoringWorker, WorkerPipeline
from foreshock.v1 import coordinator_pb2, coordinator_pb2_grpc, jobs_pb2, jobs_pb2_grpc, risk_pb2, risk_pb2_grpc
from foreshock.v1 import telemetry_pb2, telemetry_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    telemetry_pb2.DESCRIPTOR.services_by_name["Telemetry"].full_name,
    risk_pb2.DESCRIPTOR.services_by_name["Risk"].full_name,
    jobs_pb2.DESCRIPTOR.services_by_name["Jobs"].full_name,
)
COORDINATOR_SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


class SettingsError(ValueError):
    """Settings that cannot make a safe server; the message names the setting."""


@dataclass
class Settings:
    state_dir: str | Path
    listen: str = "127.0.0.1:0"
    metrics_listen: str = ""                 # HOST:PORT for /metrics; "" = no HTTP server
    model_path: str | None = None            # None: the shipped default model (if there is none: no scoring)
    scorer: Any = None                       # a Scorer to use instead of loading a model (tests, benchmarks)
    insecure: bool = False                   # plaintext, loopback only, every caller gets every role
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""                  # set: mutual TLS, a client certificate is required
    tokens: dict[str, Principal] = field(default_factory=dict)
    threshold: float | None = None           # None: from the model manifest
    false_evacuation_budget: float | None = None  # per 1,000 node-days; picks the manifest's threshold
    policy: dict[str, Any] = field(default_factory=dict)   # PolicySettings overrides
    fail_slow: dict[str, Any] = field(default_factory=dict)   # FailSlowSettings overrides (service/steptimes.py)
    ingest: IngestLimits = field(default_factory=IngestLimits)
    score_interval: float = 0.1
    max_backlog: int = 50_000
    max_message_bytes: int = 16 << 20
    topology: dict[str, Topology] = field(default_factory=dict)
    decision_flush_seconds: float = 5.0
    fsync: bool = True
    scoring_clock: Any = None                # ns since the epoch for scoring rounds; None: time.time_ns.
    #                                          Tests replaying telemetry faster than real time set it.
    scorer_grace_seconds: float = 2.0        # how long the online scorer waits for a step's late rows
    scoring_process: bool = False            # a model's bulk decode, value checks and scoring in a worker
    #                                          process (service/worker.py; `foreshock serve` turns it on,
    #                                          it costs a few seconds at start); False: all in this process
    worker_timeout: float = 60.0             # a worker silent this long on one request is killed and restarted
    close_hold_seconds: float = 0.5          # telemetry streams wait at most this long while a step's
    #                                          closing round runs (service/steps.py CloseHold); 0: never
    history_dir: str = ""                    # a dataset with an incidents table: the node history score
    #                                          (predictor/history.py), fitted at start and then every
    #                                          history_interval_seconds, exported and used to rank spares
    history_interval_seconds: float = 3600.0
    actions: ActionSettings = field(default_factory=ActionSettings)   # drain / taint nodes (off by default;
    #                                          service/actions.py, docs/actions.md)
    archive: ArchiveSettings | None = None   # write everything taken in, the decisions and the incidents
    #                                          to a Parquet dataset (service/archive.py); None: no archive
    shard: str = ""                          # this instance's shard: it takes the telemetry of the nodes the
    shard_map: ShardMap | ShardMapFile | None = None   # shard map places here only (service/shardmap.py);
    #                                          "": all. A ShardMapFile is followed: its new versions are
    #                                          taken while serving (request_shard_map_reload: at once)
    shard_map_check_seconds: float = 2.0     # how often a followed shard map file's mtime is looked at
    scorer_checkpoint_seconds: float = 300.0   # how often the online scorer's state (baselines, day-long
    #                                          counts, counter positions) is written to state_dir, so a
    #                                          restart does not start every node's 3-day baseline over
    coordinator: CoordinatorSettings | None = None   # the jobs coordinator (service/coordinator.py): no
    #                                          telemetry; Jobs and the shards' alarms while it holds the lease
    forward: ForwardSettings | None = None   # a scoring shard: alarms to the coordinator (service/forwarder.py)
    #                                          instead of directives here

    @classmethod
    def insecure_loopback(cls, state_dir, **overrides) -> "Settings":
        """Plaintext on 127.0.0.1, port 0, every role allowed: tests and the demo only."""
        overrides.setdefault("listen", "127.0.0.1:0")
        return cls(state_dir=state_dir, insecure=True, **overrides)


SCORER_STATE_FILE = "scorer-state.npz"   # in state_dir: the online scorer's checkpoint
SCORE_LEVEL_FILE = "score-level.npz"     # in state_dir: the hours of scores the threshold in force reads


class ControlPlane:
    """The running service. Build with build_server(); start() returns the bound gRPC port."""

    def __init__(self, settings: Settings):
        self.settings = s = settings
        self._validate(s)
        # A map that does not fit the topology given stops the service here, naming the offenders; a
        # followed file's later versions are held to the same, and refused while they do not fit.
        self.shard_map_file = s.shard_map if isinstance(s.shard_map, ShardMapFile) else None
        self._shard_map_wake = threading.Event()
        self._shard_map_thread: threading.Thread | None = None
        try:
            check = shard_check(s.shard, inventory={node: labels_of(t) for node, t in s.topology.items()})
            if self.shard_map_file is not None:
                self.shard_map_file.add_check(check)
                self.shard_gate = ShardGate(self.shard_map_file.current(), s.shard)
            elif s.shard:
                check(s.shard_map)
                self.shard_gate = ShardGate(s.shard_map, s.shard)
            else:
                self.shard_gate = None
        except ShardMapError as exc:
            raise SettingsError(str(exc)) from None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self._health = None
        self._http = None
        self._stopped = False
        self._last_expiry_ns = 0
        self._history_stop = threading.Event()
        self._history_thread: threading.Thread | None = None
        self.authenticator = Authenticator(s.tokens, insecure=s.insecure)
        self.coordinator: Coordinator | None = None
        self.forwarder: AlarmForwarder | None = None
        self.reporter: ShardReporter | None = None
        self._built = False
        self._leading = False
        if s.coordinator is not None:
            # The state is opened by the lease's holder only (start()): a standby that read it early
            # would act on a copy the leader has moved on from.
            self.lease = LeaderLock(s.coordinator.lease_file)
            self._lease_stop = threading.Event()
            self._lease_thread: threading.Thread | None = None
            return
        self._build()

    def _build(self) -> None:
        """Every domain object, the state opened: at construction, or when a coordinator takes the lease."""
        s = self.settings
        # Checked before anything is opened: a drain or taint that can never run stops the service here.
        try:
            action_backends = backends_from(s.actions) if s.actions.enabled else []
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        # Scored before anything is opened, so a bad fault log stops the service before it serves.
        history_scores = self._history_scores(s.history_dir, (s.scoring_clock or time.time_ns)()) \
            if s.history_dir else None
        # An archive that cannot be written stops the service before it serves, naming it.
        try:
            self.archive = None if s.archive is None else \
                (ArchiveProcess if s.archive.process else Archive)(s.archive)
        except ArchiveError as exc:
            raise SettingsError(str(exc)) from None
        self.state_dir = Path(s.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.scorer = self._scorer(s)
        self._owns_scorer = s.scorer is None   # one given in the settings is its giver's to close
        threshold = s.threshold
        # the budget the threshold in force was chosen for; None when set by hand or by no model
        self.evacuation_budget: float | None = None
        from_manifest = False
        if threshold is None:
            threshold = self.scorer.threshold(s.false_evacuation_budget)
            from_manifest = threshold is not None
            if threshold is not None:
                budget = s.false_evacuation_budget
                if budget is None:
                    budget = (getattr(self.scorer, "manifest", None) or {}).get("budget")
                self.evacuation_budget = None if budget is None else float(budget)
        if threshold is None:
            threshold = 0.5
            if not isinstance(self.scorer, NullScorer):
                log.warning("the model manifest names no threshold; using %.2f", threshold)
        try:
            policy_settings = PolicySettings(threshold=threshold, **s.policy)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"policy settings: {exc}") from None
        # A threshold the manifest gives follows the fleet's score level when the manifest has a
        # reference (predictor/fleetlevel.py); one set by hand stays as set.
        self.manifest_threshold = threshold
        try:
            reference = fleetlevel.reference_of(getattr(self.scorer, "manifest", None) or {}) \
                if from_manifest else None
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        self.score_level = fleetlevel.FleetLevel(reference) if reference is not None else None
        self.score_level_path = self.state_dir / SCORE_LEVEL_FILE
        if self.score_level is not None:
            try:
                restored = self.score_level.restore(self.score_level_path, self.scorer.model_version)
            except ValueError as exc:   # the level is rebuilt within the hour: not worth a refused start
                log.warning("%s: the fleet's score level starts afresh", exc)
            else:
                if restored:
                    log.info("score level: %s", restored)
        try:
            fail_slow_settings = FailSlowSettings(**s.fail_slow)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"fail_slow settings: {exc}") from None
        self.store = store_mod.StateStore(self.state_dir / "state.sqlite3")
        # One clock for scoring rounds, job step reports, acks and drains: the policy compares a job's
        # last step report with the round's now_ns when it picks the switch step.
        self.clock = s.scoring_clock or time.time_ns
        self.decisions = DecisionLog(self.state_dir / "decisions", flush_seconds=s.decision_flush_seconds,
                                     model_version=self.scorer.model_version, fsync=s.fsync,
                                     archive=self.archive)
        recovered = self.decisions.catch_up(self.store.directives())
        if recovered:
            log.warning("decision log: %d directives the state holds had no row (a kill within a flush "
                        "period); written from the state", recovered)
        self.jobs = JobDirectory(self.store, default_max_concurrent=policy_settings.default_max_concurrent,
                                 clock=self.clock, on_change=[self._log_change])
        self.nodes = NodeBook()
        for node, topo in s.topology.items():
            self.nodes.set_topology(node, topo)
        self.actions = NodeActions(s.actions, action_backends, self.store, self.nodes, self.decisions,
                                   clock=self.clock) if action_backends else None
        self.step_times = StepTimes(fail_slow_settings, self.store, archive=self.archive, clock=self.clock)
        # The jobs coordinator takes no telemetry: the fabric's services are judged by the shards, which forward it.
        self.policy = EvacuationPolicy(policy_settings, self.nodes, self.jobs, self.decisions, actions=self.actions,
                                       step_times=self.step_times,
                                       units=ForwardedFindings() if s.coordinator is not None else None)
        # The online scorer's checkpoint: whoever runs the scorer restores it at start and writes it
        # every scorer_checkpoint_seconds and at a stop (the worker process, or this process).
        self.scorer_state_path = self.state_dir / SCORER_STATE_FILE
        self.hold = CloseHold(s.close_hold_seconds)
        # Ingest feeds the round scheduler, and its rounds call back into Ingest (the value checks, the
        # worker's verdicts): the scheduler is built first and reaches Ingest through this owner.
        if s.scoring_process and isinstance(self.scorer, PredictorScorer):
            pipeline = WorkerPipeline(ScoringWorker(
                self.scorer.model_path, grace_seconds=s.scorer_grace_seconds, limits=s.ingest,
                timeout=s.worker_timeout, state_path=str(self.scorer_state_path),
                checkpoint_seconds=s.scorer_checkpoint_seconds, share_totals=s.forward is not None))
        else:
            pipeline = InProcessPipeline(self.scorer, prepare=self._take_round)
            if isinstance(self.scorer, PredictorScorer):
                restored = self.scorer.restore_state(self.scorer_state_path)
                if restored:
                    log.info("scorer: %s", restored)
        self.scoring = RoundScheduler(self.scorer, pipeline, interval=s.score_interval, max_backlog=s.max_backlog,
                                      on_round=self._after_round, prepare=self._take_round,
                                      on_verdicts=self._apply_verdicts, hold=self.hold, gate=self.policy.context,
                                      clock=self.clock)
        # Telemetry taken before a restart is not taken again when its collector re-sends it.
        self.ingest = Ingest(self.nodes, self.scoring.enqueue, limits=s.ingest, wake=self.scoring.wake,
                             steps=self.scoring.steps, context=self.policy.context, archive=self.archive,
                             last_sequences=store_mod.load_sequences(self.store),
                             units=self.policy.units if s.coordinator is None else None)
        self.sequences_saved_at = 0.0
        if s.coordinator is None and s.forward is None:
            self.step_times.feed = self.scoring.take_checked
        if s.coordinator is not None:
            self.coordinator = Coordinator(s.coordinator, self.store, self.jobs, self.nodes, self.policy, self.clock)
            self.coordinator.restore()
            # The coordinator scores nothing: the rows go to the shards that run each job, every rank's
            # (the comparison needs them all), on their streams' acks (service/steptimefeed.py).
            self.step_times.route = self.coordinator.step_times.route
        if s.forward is not None:
            try:
                # the coordinator's step times go to this shard's scorer as an unsharded Jobs API's do
                self.forwarder = AlarmForwarder(s.forward, model_version=self.scorer.model_version,
                                                on_step_times=self.scoring.take_checked)
            except (ValueError, OSError) as exc:
                raise SettingsError(f"coordinator_address: {exc}") from None
            self.reporter = ShardReporter(self.forwarder, self.nodes, self.policy,
                                          summary_seconds=s.forward.summary_seconds)
            self.scoring.totals = self.forwarder
        self.registry, self._round_hist = build_registry(self)
        if history_scores is not None:
            self.nodes.set_history(*history_scores)
        self._built = True

    @staticmethod
    def _history_scores(history_dir: str, now_ns: int) -> tuple[dict[str, float], float]:
        """The node history score of every node in the fault log, and the default, as of now."""
        import pandas as pd

        from foreshock.predictor import history

        try:
            scores, default, _, _ = history.score_dataset(history_dir, pd.Timestamp(now_ns, tz="UTC"))
        except (history.HistoryError, OSError) as exc:
            raise SettingsError(f"history {history_dir!r}: {exc}") from None
        log.info("node history score: %d nodes with past faults, %.3f for a node without", len(scores), default)
        return scores, default

    def _history_loop(self) -> None:
        while not self._history_stop.wait(self.settings.history_interval_seconds):
            try:
                self.nodes.set_history(*self._history_scores(self.settings.history_dir, self.clock()))
            except SettingsError as exc:  # the last scores stay in force
                log.error("refreshing the node history score: %s", exc)

    # -- construction ----------------------------------------------------------------------------
    @staticmethod
    def _validate(s: Settings) -> None:
        if not s.history_interval_seconds > 0:
            raise SettingsError(f"history_interval_seconds must be > 0, got {s.history_interval_seconds}")
        for name, value in (("listen", s.listen), ("metrics_listen", s.metrics_listen)):
            try:
                if value:
                    parse_listen(value)
            except ValueError as exc:
                raise SettingsError(f"{name} {exc}") from None
        if s.insecure:
            if not is_loopback(s.listen):
                raise SettingsError(f"listen {s.listen!r}: insecure mode is for loopback addresses only "
                                    "(127.0.0.1, ::1, localhost); give --tls-cert/--tls-key")
            if s.tls_cert or s.tls_client_ca:
                raise SettingsError("insecure mode and TLS settings are exclusive")
            if s.metrics_listen and not is_loopback(s.metrics_listen):
                raise SettingsError(f"metrics_listen {s.metrics_listen!r}: insecure mode is for loopback addresses "
                                    "only, and an empty host binds every interface; give 127.0.0.1:PORT")
        else:
            if not (s.tls_cert and s.tls_key):
                raise SettingsError("TLS needs tls_cert and tls_key (or run insecure on loopback for a demo)")
            if not (s.tokens or s.tls_client_ca):
                raise SettingsError("no credentials: give tokens or a client CA (mutual TLS), "
                                    "or every call would be refused")
        if bool(s.shard) != (s.shard_map is not None):
            raise SettingsError("shard and shard_map go together: a shard is named in a map "
                                f"(shard {s.shard!r}, shard_map {'given' if s.shard_map else 'none'})")
        if s.coordinator is not None and s.forward is not None:
            raise SettingsError("coordinator and coordinator_address are exclusive: the coordinator forwards "
                                "to no one")
        if s.coordinator is not None and s.shard:
            raise SettingsError("coordinator and shard are exclusive: the coordinator takes no telemetry")
        if s.forward is not None and s.shard and s.forward.shard != s.shard:
            # The coordinator would file this shard's events under another shard's name.
            raise SettingsError(f"forward shard {s.forward.shard!r} is not this instance's shard {s.shard!r}")
        if not 0.05 <= s.shard_map_check_seconds <= 3_600:
            raise SettingsError(f"shard_map_check_seconds {s.shard_map_check_seconds} must be in [0.05, 3600] seconds")
        if not 1 <= s.scorer_checkpoint_seconds <= 86_400:
            raise SettingsError(f"scorer_checkpoint_seconds {s.scorer_checkpoint_seconds} must be in [1, 86400] seconds")
        if not 0 < s.score_interval <= 60:  # written so that NaN fails it too
            raise SettingsError(f"score_interval {s.score_interval} must be in (0, 60] seconds")
        if not 0 <= s.close_hold_seconds <= CloseHold.MAX_SECONDS:
            raise SettingsError(f"close_hold_seconds {s.close_hold_seconds} must be in "
                                f"[0, {CloseHold.MAX_SECONDS:g}] seconds")

    @staticmethod
    def _scorer(s: Settings):
        if s.scorer is not None:
            return s.scorer
        if s.coordinator is not None:   # the shards score; the coordinator acts on what they forward
            return NullScorer()
        if s.model_path:
            return PredictorScorer(s.model_path, grace_seconds=s.scorer_grace_seconds, share_totals=s.forward is not None)
        path = default_model_path()
        if path is None or not Path(path).exists():
            log.warning("no model given and no shipped default model found (%s): telemetry is validated "
                        "but not scored; the Jobs API and DrainNode work", path)
            return NullScorer()
        try:
            return PredictorScorer(path, grace_seconds=s.scorer_grace_seconds, share_totals=s.forward is not None)
        except ModelError as exc:
            log.warning("the default model does not load (%s): running without scoring", exc)
            return NullScorer()

    # -- scoring rounds ----------------------------------------------------------------------------
    def _take_round(self, items: list) -> dict:
        return self.ingest.take_round(items)

    def _apply_verdicts(self, items: list, reply: dict | None) -> None:
        self.ingest.apply_verdicts(items, reply)

    def _follow_score_level(self, result, now_ns: int) -> None:
        """The round's scores into the fleet's score level; the policy's threshold becomes the one in
        force for the round's hour (fleetlevel.governed of the manifest's threshold), logged when it moves."""
        if self.score_level.observe(now_ns, result.nodes, result.probability):
            self._save_score_level()
        threshold = self.score_level.threshold(self.manifest_threshold)
        if threshold != self.policy.settings.threshold:
            log.info("evacuation threshold %.4g -> %.4g: the fleet's score level %.3g (reference %.3g)",
                     self.policy.settings.threshold, threshold, self.score_level.level, self.score_level.reference)
            self.policy.settings = PolicySettings(threshold=threshold, **self.settings.policy)

    def _save_score_level(self) -> None:
        try:
            self.score_level.save(self.score_level_path, self.scorer.model_version)
        except OSError as exc:   # a restart would rebuild the level within the hour: the rounds go on
            log.warning("score level not saved to %s: %s", self.score_level_path, exc)

    def _after_round(self, result, now_ns: int, why: str, elapsed: float) -> None:
        t0 = time.perf_counter()
        departed = {}
        if self.shard_gate is not None:
            departed = self.shard_gate.take_departed()
            if departed:
                self._release_departed(departed, now_ns)
            if result.fresh and self.shard_gate.gone:
                result = self._served(result, self.shard_gate.gone)
        if result.fresh and len(result.nodes):
            signals = result.signals if result.signals else [[] for _ in result.nodes]
            self.nodes.update_risk(result.nodes, result.probability, signals, now_ns)
        if result.fresh:
            if self.score_level is not None:
                self._follow_score_level(result, now_ns)
            self.policy.evaluate(now_ns, result.nodes, result.probability, result.evidence)
        else:
            self.policy.evaluate(now_ns)   # fatal events only: the scores have not moved
        if self.reporter is not None:
            self.reporter.after_round(now_ns)   # before the forgetting: a moved node's CLEARED has its risk
        if departed:
            self.nodes.forget(departed)
        if now_ns - self._last_expiry_ns >= 1_000_000_000:
            self._last_expiry_ns = now_ns
            self.jobs.expire(now_ns)
            if self.coordinator is not None:
                self.coordinator.end_due_reconfirmations(now_ns)
        self._round_hist.observe(elapsed + time.perf_counter() - t0)
        if result.fresh and len(result.nodes) and self.scoring.watched:
            self.scoring.publish([self.nodes.risk[n] for n in result.nodes if n in self.nodes.risk])
        self.decisions.maybe_flush()
        if time.monotonic() - self.sequences_saved_at >= 1.0:
            self.save_sequences(now_ns)
        if result.fresh and self._scores_here:
            self.scorer.checkpoint(self.scorer_state_path, self.settings.scorer_checkpoint_seconds)

    # -- the shard map ---------------------------------------------------------------------------------
    @staticmethod
    def _served(result, gone):
        """The round's scores without the nodes a new shard map moved away: the scorer keeps every node
        it has seen, and another shard scores these now."""
        keep = [i for i, n in enumerate(result.nodes) if n not in gone]
        if len(keep) == len(result.nodes):
            return result
        return dataclasses.replace(result, nodes=[result.nodes[i] for i in keep], probability=result.probability[keep],
                                   signals=[result.signals[i] for i in keep] if result.signals else result.signals,
                                   evidence={n: why for n, why in result.evidence.items() if n not in gone})

    def _release_departed(self, departed: dict[str, str], now_ns: int) -> None:
        """Nodes the shard map moved away: their risk alarms end here (logged, and forwarded as cleared),
        as nothing here will score them again; a fatal alarm holds its time out."""
        shards = {s.name: s.address for s in self.shard_gate.map.shards}
        with self.policy.lock:
            for node, owner in sorted(departed.items()):
                where = (f"shard {owner}" + (f" at {shards[owner]}" if owner in shards else "")) if owner else "no shard"
                self.policy.clear_alarm(node, self.nodes.probability(node) or 0.0, now_ns,
                                        f"the shard map moved the node to {where}")

    def follow_shard_map(self) -> bool:
        """Take the followed shard map file's new version, if there is one that passes (the file's
        checks); returns whether one was taken. The shard-map thread calls it; so may a test."""
        if self.shard_map_file is None:
            return False
        fresh = self.shard_map_file.current()
        gate = self.shard_gate
        old = gate.map
        if fresh is old:
            return False
        moved = gate.take(fresh)
        by_shard: dict[str, int] = {}
        for owner in moved.values():
            by_shard[owner or "no shard"] = by_shard.get(owner or "no shard", 0) + 1
        log.warning("shard map %s: took the new map %s (was %s); shard %s: %s; %d nodes moved away%s%s",
                    self.shard_map_file.path, fresh.digest, old.digest, gate.name, changes(old, fresh, gate.name),
                    len(moved), (" (" + ", ".join(f"{n} to {o}" for o, n in sorted(by_shard.items())) + ": their "
                                 "next batch is redirected, their state here forgotten)") if moved else "",
                    (", e.g. " + ", ".join(sorted(moved)[:10])) if moved else "")
        return True

    def request_shard_map_reload(self) -> None:
        """Read the followed shard map file again now, whatever its mtime (SIGHUP; safe from a signal
        handler)."""
        if self.shard_map_file is not None:
            self.shard_map_file.request_reload()
            self._shard_map_wake.set()

    def _shard_map_loop(self) -> None:
        while not self._stopped:
            self._shard_map_wake.wait(self.settings.shard_map_check_seconds)
            self._shard_map_wake.clear()
            if self._stopped:
                return
            try:
                self.follow_shard_map()
            except Exception:  # noqa: BLE001 - the map in force stays; the next look tries again
                log.exception("shard map %s: taking the new version", self.shard_map_file.path)

    def save_sequences(self, now_ns: int) -> None:
        """Save each collector's last checked batch sequence to the state store now (the round loop
        does it at most once a second, and stop() once more; `sequences_saved_at` says when, on the
        monotonic clock). A sequence that is no uint64 is refused alone, with a log line; a store
        error is logged and the next round tries again."""
        self.sequences_saved_at = time.monotonic()
        taken = self.ingest.taken_sequences()
        try:
            refused = store_mod.save_sequences(self.store, taken, now_ns)
        except Exception:
            log.exception("saving the telemetry sequences")
            return
        for collector in refused:
            log.warning("collector %s: sequence %s is no uint64, not saved (the other collectors' are)",
                        collector, taken[collector])

    def _log_change(self, event: str, d, detail: str) -> None:
        if event == "issued":
            return  # the policy logs issues itself, with the reasons
        self.decisions.record(event if event != "ack" else f"ack_{detail}", node=d.from_node, job=d.job_id,
                              directive_id=d.directive_id, reason=d.reason, to_node=d.to_node,
                              state=d.state.name.lower())

    def store_counts(self):
        return store_mod.counts(self.store)

    def registered_jobs(self) -> int:
        return store_mod.job_count(self.store)

    # -- lifecycle ---------------------------------------------------------------------------------
    def _grpc_server(self):
        s = self.settings
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # No BDP probing: each stream's HTTP/2 window stays at the default, so a service that falls
            # behind holds back its collectors (flow control) instead of buffering gigabytes for them.
            ("grpc.http2.bdp_probe", 0),
            # gRPC's default lets a second server bind the same address and takes half the connections
            # to it: a second service there (a stale one, a shard given another's port) is refused instead
            ("grpc.so_reuseport", 0),
        ]
        # Credentials are checked before the request's bytes are looked at: the decode check runs inside.
        return grpc.aio.server(interceptors=[AuthInterceptor(self.authenticator), UndecodableRequests()],
                               options=options)

    def _bind(self, server, listen: str) -> int:
        s = self.settings
        try:
            if s.insecure:
                port = server.add_insecure_port(listen)
            else:
                port = server.add_secure_port(listen, server_credentials(s.tls_cert, s.tls_key,
                                                                         s.tls_client_ca or None))
        except RuntimeError:
            port = 0
        if not port:
            raise SettingsError(f"listen {listen!r}: could not bind (another process listens there, or the "
                                "address is not this host's)")
        return port

    def _served_names(self) -> tuple[str, ...]:
        if self.settings.coordinator is not None:   # the jobs coordinator takes no telemetry
            return SERVICE_NAMES[1:] + (COORDINATOR_SERVICE,)
        if self.settings.forward is not None:       # a shard serves no Jobs API
            return SERVICE_NAMES[:2]
        return SERVICE_NAMES

    async def _serve(self, listen: str | None = None) -> int:
        server = self._grpc_server()
        if self.settings.coordinator is None:
            telemetry_pb2_grpc.add_TelemetryServicer_to_server(TelemetryServicer(self), server)
        else:
            coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(self), server)
        risk_pb2_grpc.add_RiskServicer_to_server(RiskServicer(self), server)
        if self.settings.forward is None:
            jobs_pb2_grpc.add_JobsServicer_to_server(JobsServicer(self), server)
        else:   # one writer of directives: the coordinator
            server.add_generic_rpc_handlers([shard_jobs_handler(self.settings.forward.shard,
                                                                ",".join(self.settings.forward.addresses))])
        names = self._served_names()
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(names + (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                                     reflection.SERVICE_NAME), server)
        port = self._bind(server, listen or self.settings.listen)
        await server.start()
        self.hold.bind(asyncio.get_running_loop())
        for name in ("",) + names:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        return port

    async def _serve_standby(self) -> int:
        """A coordinator waiting for the lease: UNAVAILABLE to every call, NOT_SERVING to health checks
        (a Kubernetes readiness probe keeps the Service's traffic on the leader)."""
        server = self._grpc_server()
        server.add_generic_rpc_handlers([standby_handler(self.lease.holder)])
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        port = self._bind(server, self.settings.listen)
        await server.start()
        for name in ("",) + self._served_names():
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server = server
        return port

    async def _become_leader(self) -> int:
        """The standby's server gives the port over to the leader's (the same address, so clients that
        retried there find the leader)."""
        await self._server.stop(0)
        host = self.settings.listen.rpartition(":")[0]
        return await self._serve(f"{host}:{self.port}")

    def _start_loop(self, serve) -> int:
        """The gRPC event loop's thread, serving what `serve` (a coroutine function) starts; its port."""
        ready = threading.Event()
        outcome: dict[str, Any] = {}

        def run():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                outcome["port"] = loop.run_until_complete(serve())
            except BaseException as exc:  # reported to start()'s caller
                outcome["error"] = exc
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()

        self._thread = threading.Thread(target=run, name="foreshock-grpc", daemon=True)
        self._thread.start()
        ready.wait(30)
        if "error" in outcome:
            self._thread.join(5)
            self._thread = None
            raise outcome["error"]
        return outcome["port"]

    @property
    def leading(self) -> bool:
        """This instance serves (a coordinator: holds the lease and has opened the state)."""
        return self._leading

    def start(self) -> int:
        """Start serving; returns the bound gRPC port. A coordinator serves as the standby until it holds
        the lease, then takes over on the same port (`leading` says which)."""
        if self._thread is not None:
            raise RuntimeError("control plane already started")
        if not self._built:
            self.port = self._start_loop(self._serve_standby)
            self._start_http()
            log.info("coordinator standby on %s (port %d): waiting for the lease %s (%s)", self.settings.listen,
                     self.port, self.settings.coordinator.lease_file, self.lease.holder() or "no holder yet")
            self._lease_thread = threading.Thread(target=self._await_lease, name="foreshock-lease", daemon=True)
            self._lease_thread.start()
            return self.port
        if self.archive is not None:
            self.archive.start()
        worker = self.scoring.worker
        if worker is not None:
            # loading and checking the model takes seconds: say so, or the service looks hung
            log.info("scoring worker: loading the model before listening")
            t0 = time.monotonic()
            worker.start()
            worker.wait_ready()
            log.info("scoring worker: ready in %.1f s", time.monotonic() - t0)
        try:
            self.port = self._start_loop(self._serve)
        except BaseException:
            if worker is not None:
                worker.stop()
            raise
        self._start_rest()
        self._leading = True
        return self.port

    def _await_lease(self) -> None:
        self.lease.identity = f"{self.settings.listen.rpartition(':')[0]}:{self.port} on {socket.gethostname()}"
        if not self.lease.acquire(self._lease_stop, self.settings.coordinator.lock_poll_seconds):
            return
        log.warning("coordinator: took the lease %s; opening the state and serving the Jobs API",
                    self.settings.coordinator.lease_file)
        try:
            self._build()
            asyncio.run_coroutine_threadsafe(self._become_leader(), self._loop).result(30)
        except Exception:
            # Half a leader is worse than none: the lease goes with the process, to the standby.
            log.exception("coordinator: could not take over; exiting so that the standby can")
            logging.shutdown()
            os._exit(3)
        self._start_rest()
        self._leading = True

    def _start_rest(self) -> None:
        self.scoring.start()
        if self.forwarder is not None:
            self.forwarder.start()
        if self.actions is not None:
            self.actions.start()
            log.info("node actions: %s; breaker at most %d nodes (%.3g of a fleet of %d)",
                     ", ".join(b.name for b in self.actions.backends), self.actions.limit(),
                     self.settings.actions.max_fraction, self.actions.fleet())
        if self.settings.history_dir:
            self._history_thread = threading.Thread(target=self._history_loop, name="foreshock-history", daemon=True)
            self._history_thread.start()
        if self.shard_map_file is not None:
            self._shard_map_thread = threading.Thread(target=self._shard_map_loop, name="foreshock-shard-map",
                                                      daemon=True)
            self._shard_map_thread.start()
        self._start_http()
        mode = "INSECURE (plaintext, loopback only, no credentials checked)" if self.settings.insecure else \
            ("mutual TLS" if self.settings.tls_client_ca else "TLS")
        role = "jobs coordinator (leader), " if self.coordinator is not None else \
            (f"forwarding to {','.join(self.settings.forward.addresses)}"
             + ("" if self.shard_gate else f" as shard {self.settings.forward.shard}") + ", "
             if self.forwarder is not None else "")
        log.info("foreshock control plane on %s (port %d), %s%s; model %s; threshold %.3f; state %s%s%s",
                 self.settings.listen, self.port, role, mode, self.scorer.model_version,
                 self.policy.settings.threshold, self.state_dir,
                 f"; archive {self.settings.archive.uri}" if self.archive is not None else "",
                 f"; shard {self.settings.shard} of {self.shard_gate.map.source}"
                 + (" (followed)" if self.shard_map_file is not None else "") if self.shard_gate else "")
        if self.settings.insecure:
            log.warning("running INSECURE on loopback: every caller has every role (demo and tests only)")

    def _start_http(self) -> None:
        """/metrics and /readyz, once: a coordinator's standby starts it, and keeps it when it leads."""
        if self._http is not None or not self.settings.metrics_listen:
            return
        standby = standby_registry() if self.settings.coordinator is not None else None
        self._http = serve_http(self.settings.metrics_listen,
                                lambda: self.registry if self._leading else (standby or self.registry),
                                lambda: self._leading)
        self.metrics_port = self._http.server_port

    def _stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    @property
    def _scores_here(self) -> bool:
        """This process runs the online scorer (no worker process), so it owns the checkpoint."""
        return isinstance(self.scorer, PredictorScorer) and self.scoring.worker is None

    @property
    def address(self) -> str:
        host = self.settings.listen.rpartition(":")[0] or "127.0.0.1"
        return f"{host}:{self.port}"

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving: in-flight calls get `grace` seconds; state is flushed and closed."""
        if self._stopped:
            return
        self._stopped = True
        if self.settings.coordinator is not None:
            self._lease_stop.set()   # a standby stops waiting; a takeover under way finishes first
            if self._lease_thread is not None:
                self._lease_thread.join(60)
        loop = self._loop
        if loop is not None and self._server is not None and not loop.is_closed():
            async def shutdown():
                if self._health is not None:
                    await self._health.enter_graceful_shutdown()
                await self._server.stop(grace)
            try:
                asyncio.run_coroutine_threadsafe(shutdown(), loop).result(grace + 10)
            except Exception:
                log.exception("stopping the gRPC server")
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(grace + 10)
        if not self._built:   # a standby that never led: it opened nothing
            self._stop_http()
            return
        self._history_stop.set()
        if self._history_thread is not None:
            self._history_thread.join(5)
        self._shard_map_wake.set()
        if self._shard_map_thread is not None:
            self._shard_map_thread.join(5)
        # nothing new arrives now: what collectors were acknowledged for is taken (and archived) first
        if not self.scoring.drain_backlog(5.0):
            log.warning("stopping with %d telemetry batches not yet taken", self.scoring.backlog())
        self.scoring.stop()
        if self.forwarder is not None:   # the last round's events, given a moment to be acked
            self.forwarder.stop(flush_seconds=min(grace, 2.0))
        self.policy.close_context(self.clock())
        if self.actions is not None:
            self.actions.stop()
        if self._scores_here:
            self.scorer.checkpoint(self.scorer_state_path, self.settings.scorer_checkpoint_seconds, force=True)
        if self.score_level is not None:
            self._save_score_level()
        if self._owns_scorer:
            self.scorer.close()
        self.save_sequences(self.clock())
        self._stop_http()
        self.decisions.close()
        if self.archive is not None:
            self.archive.close()   # after the decision log, whose last rows it takes
        self.store.close()
        if self.settings.coordinator is not None:
            self.lease.release()   # after the state is closed: the standby opens it next

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def build_server(settings: Settings) -> ControlPlane:
    """Build (not start) the control plane from its settings."""
    return ControlPlane(settings)


__all__ = ["Settings", "ControlPlane", "build_server", "SettingsError"]
