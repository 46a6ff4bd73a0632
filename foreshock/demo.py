"""`foreshock demo`: the whole promise in one run, on loopback, on a laptop-sized machine with no GPU.

It starts a live simulated cluster (foreshock.simulator.LiveCluster, 64 nodes by default), one real
Collector per node (the `simulated` source over that node's model) streaming through the real
StreamingUplink to a real control plane (foreshock.service.build_server, with the shipped default
model, plaintext on 127.0.0.1 only: it says so), and a real PyTorch training job (4 ranks + 1 warm
spare on gloo, CPU) that embeds the migrator. Then it injects three things:

1. a fault with precursors on a node that hosts a rank: the job must be moved off before it dies;
2. a fault without precursors on another node: honestly reported as not predicted;
3. a benign disturbance (corrected ECC errors that rise for an hour and subside) on a job node: it must
   not evacuate.

The simulated clock starts at a fixed time (`SIM_START`) and the faults land at fixed sweeps after a fixed
history (`history_minutes`), so a seed gives the same telemetry on every run and every machine: the simulator's
noise is keyed by absolute time, and a start taken from the wall clock gave each run other noise. The
history is swept first, faster than real time; the job starts once it is in, and the scenario's first
sweep waits for the job's first step.

When a failing node still hosts a rank at its failure time, the demo kills that rank's process, as
the hardware would, and the job counts as restarted. The run ends by itself, prints a summary (also
written as JSON with --json), writes an HTML report with the timeline and plots, stops everything it
started, and exits non-zero if the job was not saved.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from foreshock import config
from foreshock import risk as risk_scale

log = logging.getLogger("foreshock.demo")

DEFAULTS: dict[str, Any] = {
    "nodes": 64,
    "seed": 7,
    "time_scale": 60.0,        # simulated seconds per wall second: telemetry, scoring and policy run on it
    "interval": 1.0,           # collector sweep interval, wall seconds (60 simulated seconds: one model step)
    "out": "out/demo",
    "json": "",
    "html": "",
    "live": True,
    # Simulated minutes of telemetry swept before the scenario starts, at `history_speedup` times the
    # sweep rate: the online features' baselines need hours of a node's history, as a service that has
    # run for days has, or a precursor's first half hour becomes its own baseline. The shipped model reads
    # most error signals only against that baseline (docs/predictor.md, Relative counts), so the demo
    # gives every node six hours.
    "history_minutes": 360.0,
    "history_speedup": 8.0,
    # the scenario, in simulated minutes after the history
    "precursor_at_minutes": 30.0,
    "precursor_lead_minutes": 120.0,
    "benign_at_minutes": 35.0,
    "benign_minutes": 60.0,
    "abrupt_at_minutes": 70.0,
    "steps": 100000,           # an upper bound: the demo asks the job to stop once the faults are over
    "step_sleep_seconds": 0.12,
    "params": 20000,
    # A bound for a run that hangs, not a pace: the run ends by itself once the faults have played out
    # (about 4 minutes on an idle 2-core machine). The history is swept as fast as the machine allows,
    # so a loaded machine stretches the run: beside another test worker, the history alone took twice
    # as long and the run passed 300 s.
    "time_limit_seconds": 600.0,
    # The operating point: the manifest's threshold for this many false evacuations per 1,000 node-days.
    # The shipped model on four held-out random worlds at budget 2: 46 % of precursor incidents caught, 1.3
    # false evacuations per 1,000 node-days (models/default/REPRODUCE.md).
    "budget": 2.0,
}
CHECKS = {
    "nodes": config.Check(lambda n: n >= 40, "must be >= 40 (4 leaf switches of ranks, a spare, a bystander)"),
    "seed": config.at_least(0),
    "time_scale": config.above(0),
    "interval": config.above(0),
    "history_speedup": config.at_least(1),
    **{key: config.at_least(0) for key in ("history_minutes", "precursor_at_minutes", "precursor_lead_minutes", "benign_at_minutes",
                                            "benign_minutes", "abrupt_at_minutes", "step_sleep_seconds")},
    "steps": config.at_least(1),
    "params": config.at_least(1),
    "time_limit_seconds": config.above(0),
    "budget": config.above(0),
}

JOB_ID = "demo-llm"
# The simulated clock's start: fixed, so that a seed's telemetry (keyed by absolute time in the simulator)
# is the same on every run. It lies in the past, so the service's ingest accepts the samples as old ones.
SIM_START = "2026-06-01T06:00:00+00:00"


@dataclass
class Fault:
    label: str
    kind: str                  # precursor | no_precursor | benign
    node: str
    mode: str
    component: int
    injected_at: float = 0.0   # wall seconds since the epoch
    fails_at: float | None = None
    first_alert: float | None = None
    first_directive: float | None = None
    hosted_rank: bool = False
    killed_rank: str = ""
    peak_risk: float = 0.0
    risk: list[tuple[float, float]] = field(default_factory=list)


class Demo:
    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.out = Path(cfg["out"])
        self.t0 = time.time()
        self.scale = float(cfg["time_scale"])
        # The service checks sample times against its own wall clock, as it would in production: the
        # simulated clock must stay behind it, and the ingest's age limit is widened to reach back to it.
        self.sim0_ns = int(datetime.fromisoformat(SIM_START).timestamp() * 1e9)
        if self.sim0_ns / 1e9 + float(cfg["history_minutes"]) * 60 + self.scale * float(cfg["time_limit_seconds"]) > self.t0:
            raise ValueError(f"time_limit_seconds {cfg['time_limit_seconds']} at time_scale {self.scale:g}: the "
                             f"simulated clock (from {SIM_START}) would overtake the wall clock")
        self.job_clock0 = None  # simulated seconds when the job started training
        # Samples are stamped at exact multiples of the sweep step and faults injected at planned sweep
        # indices, so a seed gives the same telemetry whatever the wall-clock jitter of this machine.
        self.step_ns = int(float(cfg["interval"]) * self.scale * 1e9)
        self.history_sweeps = round(float(cfg["history_minutes"]) * 60e9 / self.step_ns)
        self.sweep_index = 0
        self._swept: tuple[int, float] | None = None   # (sample time, wall time) of the last sweep
        self.pending: list[tuple[int, Fault]] = []
        self.events: list[tuple[float, str]] = []
        self.faults: list[Fault] = []
        self.riskiest: list[Any] = []
        self.directives: list[Any] = []
        self.detached: set[str] = set()   # nodes the job was evacuated from (LiveCluster.detach)
        self.job_step = 0
        self.job_loss = None
        self.job_restarts = 0
        self.time_limit_reached = False
        self.threshold = 0.5
        self.horizon_minutes = 30.0
        self._stop = threading.Event()
        self._history_swept = threading.Event()   # the sweeper's, once the history is in
        self._job_training = threading.Event()    # the run's, once the job has made a step
        self.job_codes: dict[str, Any] = {}

    # -- helpers ---------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.events.append((time.time(), text))
        if not self.cfg["live"]:  # the live view shows the events itself
            log.info(text)
            print(f"[{time.time() - self.t0:6.1f}s] {text}", flush=True)

    def sim_ns(self) -> int:
        """The simulated clock (scoring, failures, the timeline): `scale` times the wall clock, but
        never more than one sweep past the last sweep taken. On a loaded machine the sweeps fall
        behind the wall clock and the clock waits for them, so a node fails, and its steps close, when
        the telemetry says so: a lead measured on it does not shrink with the machine's load."""
        swept = self._swept
        if swept is None:
            return self.sim0_ns
        ts, wall = swept
        return ts + min(self.step_ns, int((time.time() - wall) * self.scale * 1e9))

    def sim(self) -> float:
        return self.sim_ns() / 1e9

    def rel(self, t: float | None) -> float | None:
        """Simulated minutes since the job started training."""
        return None if t is None or self.job_clock0 is None else round((t - self.job_clock0) / 60.0, 1)

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from foreshock.collectors.collector import Collector
        from foreshock.collectors.simulated import SimulatedSource
        from foreshock.collectors.uplink import StreamingUplink
        from foreshock.dataset import DatasetWriter
        from foreshock.service.ingest import IngestLimits
        from foreshock.service.server import Settings, build_server
        from foreshock.simulator.live import LiveCluster
        from foreshock.simulator.topology import Topology

        cfg = self.cfg
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        topo = Topology(nodes=int(cfg["nodes"]), nodes_per_leaf=16, job_nodes=min(32, int(cfg["nodes"])))
        # Random faults off: the demo's faults are the three it injects, so its outcome is its own.
        cluster = LiveCluster(topo, seed=int(cfg["seed"]), speed=1.0, rate_scale=0.0, start_ns=self.sim0_ns,
                              interval_s=float(cfg["interval"]) * self.scale)
        self.cluster = cluster
        names = cluster.nodes
        per_leaf = 16
        ranks = [names[(i * per_leaf + 1) % len(names)] for i in range(4)]
        spare = names[min(len(names) - 1, 2 * per_leaf + 9)]
        abrupt_node = names[min(len(names) - 1, 3 * per_leaf + 5)]
        self.placement = {"ranks": ranks, "spare": spare}

        # Policy times are simulated seconds, except lead_seconds, which the service divides by the job's
        # (wall-clock) step time to choose how many steps ahead the switch is.
        past = self.t0 - self.sim0_ns / 1e9 + 86_400.0
        settings = Settings.insecure_loopback(self.out / "state", metrics_listen="127.0.0.1:0",
                                              ingest=IngestLimits(max_past_seconds=past),
                                              scoring_clock=self.sim_ns,
                                              false_evacuation_budget=float(cfg["budget"]),
                                              # a step closes 1.5 sweeps after its end (90 simulated s):
                                              # on a loaded machine a sweep's rows can take longer than
                                              # half a sweep to arrive, and rows of a closed step are lost
                                              scorer_grace_seconds=90.0,
                                              policy={"cooldown_seconds": 3600.0, "stale_seconds": 300.0,
                                                      "lead_seconds": 2.0, "deadline_seconds": 3600.0})
        self.cp = build_server(settings)
        port = self.cp.start()
        addr = f"127.0.0.1:{port}"
        self.threshold = float(self.cp.policy.settings.threshold)
        self.horizon_minutes = (getattr(self.cp.scorer, "horizon_seconds", 0) or 1800) / 60
        self.say(f"control plane on {addr} (PLAINTEXT, loopback only: demo mode), model "
                 f"{self.cp.scorer.model_version}; it evacuates a node from {risk_scale.percent(self.threshold)} "
                 f"risk within {self.horizon_minutes:.0f} min (level 1x: the manifest's threshold for "
                 f"{cfg['budget']:g} false evacuations per 1,000 node-days)")
        self.say(f"Prometheus metrics: http://127.0.0.1:{self.cp.metrics_port}/metrics")

        writer = DatasetWriter(self.out / "telemetry", rotate_seconds=60.0, fsync=False)
        inventory = cluster.inventory()
        import pyarrow.compute as pc
        self.collectors = []
        for name in names:
            uplink = StreamingUplink(addr, node=name).start()
            c = Collector(name, [SimulatedSource(name, node_model=cluster.node_model(name))], writer,
                          uplink=uplink, clock=self.sim_ns)
            inv = inventory.filter(pc.equal(inventory.column("node"), name))
            uplink.submit({"inventory": inv})
            self.collectors.append(c)
        writer.append_table("inventory", inventory)
        self.writer = writer
        self.say(f"{len(names)} simulated nodes, one collector each, streaming every {cfg['interval']:g} s "
                 f"(simulated time runs {self.scale:g}x: one sweep is {cfg['interval'] * self.scale:g} simulated s)")
        # The scenario's minutes count from the sweep after the history, whatever the wall time the job
        # took to start.
        k0 = self.history_sweeps
        self.job_clock0 = (self.sim0_ns + k0 * self.step_ns) / 1e9


        from foreshock.net import Endpoint
        from foreshock.v1 import jobs_pb2, jobs_pb2_grpc, risk_pb2, risk_pb2_grpc
        channel = Endpoint(addr).open()
        risk_stub, jobs_stub = risk_pb2_grpc.RiskStub(channel), jobs_pb2_grpc.JobsStub(channel)

        # The fault: NVLink CRC and replay errors climb on one of rank 1's GPUs, a link drops, then Xid 74.
        precursor = Fault("NVLink degrades (precursors)", "precursor", ranks[1], "nvlink", 3, hosted_rank=True)
        abrupt = Fault("GPU off the bus (no precursor)", "no_precursor", abrupt_node, "gpu_off_bus", 5)
        # The benign disturbance: corrected (SRAM) ECC errors rise for an hour on a GPU of rank 2 and
        # subside, with no uncorrectable error and no row remapped: ECC doing its job. Not used, because a
        # model that warns hours ahead must warn on them (docs/predictor.md counts those false
        # evacuations): a cable that degrades and then heals, which until it heals looks exactly like the
        # early hours of one that fails, and HBM rows remapped one after another, a precursor of HBM
        # failure in the scenario catalogue (simulator/scenarios.py, "remaps+temp").
        benign = Fault("corrected ECC rises, then subsides (benign)", "benign", ranks[2], "sram", 2, hosted_rank=True)
        self.faults = [precursor, benign, abrupt]
        plan = [(float(cfg["precursor_at_minutes"]), precursor), (float(cfg["benign_at_minutes"]), benign),
                (float(cfg["abrupt_at_minutes"]), abrupt)]
        self.pending = [(k0 + round(minutes * 60e9 / self.step_ns), fault) for minutes, fault in plan]
        self.sweeper = threading.Thread(target=self._sweep_loop, name="demo-sweeper", daemon=True)
        self.sweeper.start()

        live = None
        if cfg["live"]:
            from rich.live import Live
            live = Live(self._render(), refresh_per_second=2, transient=False)
            live.start()
        try:
            deadline = self.t0 + float(cfg["time_limit_seconds"])
            # The job starts on a control plane that has taken the history in: while the history is swept
            # faster than real time the service scores several steps a second and an in-job call can wait
            # past its deadline (benchmarks/results/demo-deadlines-2026-12-07.md). The sweeper holds the
            # scenario's first sweep until the job trains, so no fault comes before it.
            while not self._history_swept.wait(0.5):
                if time.time() > deadline or not self.sweeper.is_alive():
                    raise RuntimeError("the history was not swept within the demo's time limit")
                if live is not None:
                    self._poll_riskiest(risk_stub, risk_pb2)
                    live.update(self._render())
            from foreshock.migrator.example import launch
            # A warm spare polls the job's store with a timeout and c10d warns at each one: noise here.
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            self.job = launch(JOB_ID, ranks, [spare], steps=int(cfg["steps"]), out_dir=self.out / "job",
                              service=addr, params=int(cfg["params"]), seed=int(cfg["seed"]),
                              step_sleep_s=float(cfg["step_sleep_seconds"]), fallback="checkpoint_exit")
            self.job.wait_progress(1, timeout=180.0)
            self.say(f"training job {JOB_ID} is training: ranks on {', '.join(ranks)}, warm spare on {spare}")
            self._job_training.set()
            job_done = stop_requested = False
            while time.time() < deadline:
                self._poll(risk_stub, jobs_stub, jobs_pb2, risk_pb2)
                self._fail_due()
                job_done = all(not p.is_alive() for p in self.job.processes.values())
                faults_over = all(f.injected_at and (f.fails_at is None or self.sim() > f.fails_at + 300)
                                  for f in self.faults)
                if faults_over and not stop_requested and not job_done:
                    at = self.job.request_stop(steps_ahead=25)
                    stop_requested = True
                    self.say(f"every fault has played out: the job ends cleanly at step {at}")
                if job_done:
                    break
                if self.job_restarts and not stop_requested:
                    # a rank died with its node: the other ranks block in the collective (NCCL would
                    # hang until its watchdog); the job is lost, so stop it now
                    self.say("the job is lost: stopping its remaining processes")
                    self.job.stop(grace=5.0)
                    stop_requested = True
                if live is not None:
                    live.update(self._render())
                time.sleep(0.25)
            if not job_done:
                self.time_limit_reached = True
                self.say("time limit reached: stopping the job")
        finally:
            if live is not None:
                live.update(self._render())
                live.stop()
            channel.close()
        return self._summary()

    def shutdown(self) -> None:
        """Stop everything this run started, whatever state it got to: nothing is left running."""
        job = getattr(self, "job", None)
        if job is not None:
            alive = any(p.is_alive() for p in job.processes.values())
            self.job_codes = job.stop(grace=15.0) if alive else job.wait(timeout=5.0)
        self._stop.set()
        if getattr(self, "sweeper", None) is not None:
            self.sweeper.join(timeout=10)
        for c in getattr(self, "collectors", []):
            c.uplink.close(timeout=2.0)
        if getattr(self, "writer", None) is not None:
            self.writer.close()
        if getattr(self, "cp", None) is not None:
            self.cp.stop(grace=1.0)

    def _sweep_loop(self) -> None:
        interval, speedup = float(self.cfg["interval"]), float(self.cfg["history_speedup"])
        next_at = started = time.time()
        while not self._stop.is_set():
            ts = self.sim0_ns + self.sweep_index * self.step_ns
            for k_at, fault in self.pending:
                if fault.injected_at == 0.0 and self.sweep_index >= k_at:
                    self._inject(fault, ts)
            # one vectorised sample of the whole cluster; each collector's node model takes its slice
            self.cluster.sample_all(ts)
            for c in self.collectors:
                try:
                    c.sweep_once(ts)
                except Exception as exc:  # noqa: BLE001 - a collector fault must not end the demo
                    log.error("collector %s: %s", c.node, exc)
            self.writer.maybe_rotate()
            self._swept = (ts, time.time())
            self.sweep_index += 1
            if self.sweep_index < self.history_sweeps:
                next_at += interval / speedup
            elif self.sweep_index == self.history_sweeps:
                self.say(f"{float(self.cfg['history_minutes']):g} simulated minutes of history swept in "
                         f"{time.time() - started:.0f} s; the training job starts")
                self._history_swept.set()
                while not self._job_training.wait(0.5):
                    if self._stop.is_set():
                        return
                # the timeline starts now, not where the history's pace would have it (this machine can
                # be too slow for that pace, and catching up would run the scenario faster than real time)
                next_at = time.time() + interval
            else:
                next_at += interval
            self._stop.wait(max(0.0, next_at - time.time()))

    def _inject(self, fault: Fault, now_ns: int) -> None:
        fault.injected_at = now_ns / 1e9
        if fault.kind == "benign":
            self.cluster.disturb(fault.node, fault.mode, component=fault.component, now_ns=now_ns,
                            seconds=float(self.cfg["benign_minutes"]) * 60, peak=0.35)
            self.say(f"benign: {fault.node} GPU {fault.component}: corrected ECC errors rise, then subside")
            return
        lead = float(self.cfg["precursor_lead_minutes"]) if fault.kind == "precursor" else 0.0
        ep = self.cluster.inject(fault.node, fault.mode, component=fault.component, lead_seconds=lead * 60,
                            repair_seconds=4 * 3600.0, now_ns=now_ns)
        fault.fails_at = ep.end_ns / 1e9
        what = f"fails in {lead:.0f} simulated min" if lead else "fails now"
        self.say(f"fault injected: {fault.label} on {fault.node} component {fault.component}, {what}")

    def _poll_riskiest(self, risk_stub, risk_pb2) -> None:
        """The riskiest nodes for the live view (the history's too, before the job starts)."""
        import grpc
        try:
            self.riskiest = list(risk_stub.ListRiskiest(risk_pb2.ListRiskiestRequest(limit=6), timeout=2).nodes)
        except grpc.RpcError as exc:
            log.warning("polling the control plane: %s", exc.code())

    def _poll(self, risk_stub, jobs_stub, jobs_pb2, risk_pb2) -> None:
        import grpc
        self._poll_riskiest(risk_stub, risk_pb2)
        try:
            self.directives = list(jobs_stub.ListDirectives(jobs_pb2.ListDirectivesRequest(job_id=JOB_ID),
                                                            timeout=2).directives)
            now = self.sim()
            # the threshold in force: it follows the fleet's score level (predictor/fleetlevel.py)
            self.threshold = float(self.cp.policy.settings.threshold)
            for f in self.faults:
                if not f.injected_at:
                    continue
                try:
                    r = risk_stub.GetNodeRisk(risk_pb2.GetNodeRiskRequest(node=f.node), timeout=2)
                except grpc.RpcError:
                    continue
                f.risk.append((now, r.probability))
                f.peak_risk = max(f.peak_risk, r.probability)
                if f.first_alert is None and r.probability >= self.threshold:
                    f.first_alert = now
                    self.say(f"risk alert: {f.node} at "
                             f"{risk_scale.words(r.probability, self.threshold, self.horizon_minutes * 60)}"
                             + (f" ({r.signals[0].description})" if r.signals else ""))
            for d in self.directives:
                if (d.kind == jobs_pb2.DIRECTIVE_KIND_EVACUATE and d.state == jobs_pb2.DIRECTIVE_STATE_COMPLETED
                        and d.from_node not in self.detached):
                    # The rank has left the node: when it fails, no job stalls with it. The simulated
                    # cluster's job on it follows (otherwise its peers would go idle in the simulation
                    # although, here, the job trains on).
                    self.cluster.detach(d.from_node, now_ns=self.sim_ns())
                    self.detached.add(d.from_node)
                for f in self.faults:
                    if d.from_node == f.node and f.first_directive is None:
                        f.first_directive = d.issued_at.seconds + d.issued_at.nanos / 1e9
                        self.say(f"directive {d.directive_id[:8]}: move ranks {list(d.ranks)} "
                                 f"{d.from_node} -> {d.to_node or '(none)'} at step {d.at_step} ({d.reason})")
        except grpc.RpcError as exc:
            log.warning("polling the control plane: %s", exc.code())
        try:
            self.job_step = self.job.progress()
            self.job_loss = self.job.loss()
        except Exception:  # noqa: BLE001 - the job's store goes away when it ends
            pass

    def _fail_due(self) -> None:
        """A node whose failure time has come takes down any rank still on it, as the hardware would."""
        for f in self.faults:
            if f.fails_at is None or f.killed_rank or self.sim() < f.fails_at:
                continue
            f.killed_rank = "-"
            if all(not p.is_alive() for p in self.job.processes.values()):
                self.say(f"{f.node} failed ({f.label}); the job had already finished")
                continue
            for name, proc in self.job.processes.items():
                if name.startswith("rank") and proc.is_alive() and self.placement["ranks"][int(name[4:])] == f.node:
                    proc.kill()
                    f.killed_rank = name
                    self.job_restarts = 1
                    self.say(f"{f.node} FAILED with {name} still on it: the job crashes "
                             f"(a checkpoint restart would follow)")
            if f.killed_rank == "-":
                self.say(f"{f.node} failed ({f.label}); no rank on it any more")

    # -- display ---------------------------------------------------------------------------------
    def _render(self):
        from rich.console import Group
        from rich.table import Table
        risk = Table(title=f"riskiest nodes (evacuated from {risk_scale.percent(self.threshold)} within "
                           f"{self.horizon_minutes:.0f} min, level 1x)", expand=True)
        for col in ("node", "level", f"risk in {self.horizon_minutes:.0f} min", "top signal"):
            risk.add_column(col)
        for r in self.riskiest:
            sig = r.signals[0].description if r.signals else ""
            level = risk_scale.level(r.probability, self.threshold)
            style = {"evacuate": "bold red", "watch": "yellow"}.get(risk_scale.band(level), "")
            risk.add_row(r.node, risk_scale.times(level), risk_scale.percent(r.probability), sig[:90], style=style)
        dirs = Table(title="directives", expand=True)
        for col in ("id", "ranks", "from -> to", "step", "state", "reason"):
            dirs.add_column(col)
        from foreshock.v1 import jobs_pb2
        for d in self.directives:
            dirs.add_row(d.directive_id[:8], str(list(d.ranks)), f"{d.from_node} -> {d.to_node}", str(d.at_step),
                         jobs_pb2.DirectiveState.Name(d.state).replace("DIRECTIVE_STATE_", ""), d.reason[:60])
        status = Table.grid()
        loss = f"{self.job_loss:.4f}" if self.job_loss is not None else "-"
        sim_min = self.rel(self.sim()) or 0.0
        status.add_row(f"t = {time.time() - self.t0:5.1f} s (simulated +{sim_min:.0f} min)   job {JOB_ID}: step {self.job_step}, "
                       f"loss {loss}, restarts {self.job_restarts}")
        for t, text in self.events[-6:]:
            status.add_row(f"[{t - self.t0:6.1f}s] {text}")
        return Group(status, risk, dirs)

    # -- the account -----------------------------------------------------------------------------
    def _summary(self) -> dict[str, Any]:
        from foreshock.v1 import jobs_pb2
        results = self.job.results()
        ranks_done = [r for r in results if r.get("exit") == "finished"]
        steps = max((int(max(map(int, r["losses"]), default=-1)) + 1 for r in results if r["losses"]), default=0)
        # a rank writes its losses when it finishes: a job stopped at the time limit counts its progress
        steps = steps or self.job_step
        final_hashes = {r["name"]: r["hashes"][max(r["hashes"], key=int)] for r in ranks_done if r["hashes"]}
        changes = [c for r in results for c in r.get("changes", []) if not c.get("leave")]
        pauses = [c.get("pause_s") for c in changes if c.get("pause_s") is not None]
        evacuations = []
        for d in self.directives:
            phases = next((c.get("phases", {}) for c in changes if c.get("directive") == d.directive_id), {})
            evacuations.append({"directive_id": d.directive_id, "kind": jobs_pb2.DirectiveKind.Name(d.kind),
                                "ranks": list(d.ranks), "from_node": d.from_node, "to_node": d.to_node, "at_step": d.at_step,
                                "state": jobs_pb2.DirectiveState.Name(d.state), "reason": d.reason,
                                "phases_seconds": phases,
                                "duration_seconds": round(phases["total_to_first_step"], 3)
                                if "total_to_first_step" in phases else None})
        faults = []
        for f in self.faults:
            alert = f.first_directive or f.first_alert
            predicted = alert is not None and (f.fails_at is None or alert < f.fails_at)
            faults.append({
                "label": f.label, "kind": f.kind, "node": f.node, "mode": f.mode, "component": f.component,
                "hosted_rank": f.hosted_rank, "injected_at_min": self.rel(f.injected_at),
                "fails_at_min": self.rel(f.fails_at), "first_alert_min": self.rel(f.first_alert),
                "first_directive_min": self.rel(f.first_directive),
                "predicted": bool(predicted) if f.kind != "benign" else None,
                "lead_minutes": round((f.fails_at - alert) / 60.0, 1) if predicted and f.fails_at else None,
                "false_alarm": bool(alert is not None) if f.kind == "benign" else None,
                "peak_risk": round(f.peak_risk, 4),
                "peak_level": round(risk_scale.level(f.peak_risk, self.threshold), 2), "rank_killed": f.killed_rank not in ("", "-"),
            })
        precursor = next(x for x in faults if x["kind"] == "precursor")
        benign = next(x for x in faults if x["kind"] == "benign")
        completed = [e for e in evacuations if e["state"] == "DIRECTIVE_STATE_COMPLETED"]
        saved = (self.job_restarts == 0 and precursor["predicted"] and bool(completed)
                 and not precursor["rank_killed"] and len(set(final_hashes.values())) == 1 and len(ranks_done) >= 4)
        goodput = self._goodput(pauses, steps)
        return {
            "saved": bool(saved),
            "job_restarts": self.job_restarts,
            # the run was stopped before the job finished: not saved, whatever else went right
            "time_limit_reached": self.time_limit_reached,
            "time_limit_seconds": float(self.cfg["time_limit_seconds"]),
            "steps_completed": steps,
            "ranks_finished": len(ranks_done),
            "final_parameters_identical": len(set(final_hashes.values())) == 1 and bool(final_hashes),
            "final_loss": statistics.fmean(r["losses"][str(steps - 1)] for r in ranks_done
                                           if str(steps - 1) in r["losses"]) if ranks_done else None,
            "faults": faults,
            "false_evacuations": 1 if benign["first_directive_min"] is not None else 0,
            "evacuations": evacuations,
            "healthy_rank_pause_seconds": pauses,
            "threshold": self.threshold,
            "false_evacuation_budget_per_1000_node_days": float(self.cfg["budget"]),
            "model_version": self.cp.scorer.model_version,
            "placement": self.placement,
            "goodput": goodput,
            "wall_seconds": round(time.time() - self.t0, 1),
            "results": results,
        }

    def _goodput(self, pauses: list[float], steps: int) -> dict[str, Any]:
        """This run against the same scenario under checkpoint restart, and the monthly view at scale."""
        from foreshock import goodput as gp
        s = gp.scenario_from({})
        ranks = 4
        wall = time.time() - self.t0
        pause = max(pauses) if pauses else None
        migration_s = pause if pause is not None else 0.0
        # Checkpoint restart of the same incident: the job restarts (restart_minutes) and redoes the work
        # since the last checkpoint (on average lost_progress_hours of the default interval).
        lost_progress_h = gp.lost_progress_hours(s.mttf_hours, s.checkpoint_interval_hours)
        restart_h = s.identify_hours + s.restart_hours + s.replace_hours
        ckpt_gpu_h = (restart_h + lost_progress_h) * ranks
        # a job this run lost falls back to the same checkpoint restart
        fs_gpu_h = ckpt_gpu_h if self.job_restarts else migration_s / 3600.0 * ranks
        # At scale: the shipped model's own held-out evaluation at this run's budget, and the measured
        # migration time, in the goodput model's default 1,024-GPU cluster.
        from foreshock.predictor.registry import default_model_path
        report = json.loads((default_model_path() / "evaluation.json").read_text())
        at_budget = report.get("by_budget", {}).get(str(float(self.cfg["budget"])), report)
        eval_file = self.out / "evaluation-at-budget.json"
        eval_file.write_text(json.dumps(at_budget))
        at_scale = gp.evaluate(gp.scenario_from({"migration_seconds": max(migration_s, 1.0),
                                                 "eval_report": str(eval_file), "eval_model": "model"}))
        return {
            "this_run": {
                "gpus": ranks, "wall_seconds": round(wall, 1),
                "foreshock_gpu_hours_lost": round(fs_gpu_h, 6),
                "checkpoint_restart_gpu_hours_lost": round(ckpt_gpu_h, 4),
                "checkpoint_restart_assumptions": {"restart_minutes": s.restart_hours * 60,
                                                   "replace_minutes": s.replace_hours * 60,
                                                   "checkpoint_interval_hours": s.checkpoint_interval_hours,
                                                   "lost_progress_hours": round(lost_progress_h, 4)},
            },
            "at_scale_inputs": {"eval": "models/default/evaluation.json at this budget",
                                "recall_precursor": at_scale["foreshock"].get("effective_recall"),
                                "migration_seconds": max(migration_s, 1.0)},
            "at_1024_gpus_per_month": {k: {"usd_per_month": round(at_scale[k]["usd_per_month"]),
                                           "goodput_expense": round(at_scale[k]["goodput_expense"], 5)}
                                       for k in gp.STRATEGIES},
        }


# -- report ----------------------------------------------------------------------------------------
def _png(fig) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _unfinished(summary: dict[str, Any]) -> str:
    """Why a job that did not restart was still not saved, in words."""
    if summary["time_limit_reached"]:
        return (f"The job was not saved: the run reached its time limit ({summary['time_limit_seconds']:.0f} s) "
                f"before the job finished, after {summary['steps_completed']:,} steps with no restart. A loaded "
                f"machine stretches the run; --time-limit-seconds raises the limit.")
    return (f"The job was not saved: it did not restart, but {summary['ranks_finished']} of 4 ranks finished "
            f"with the same parameters after {summary['steps_completed']:,} steps.")


def _outcome(f: dict[str, Any]) -> str:
    if f["kind"] == "benign":
        return "not evacuated (correct: it recovered)" if not f["false_alarm"] else "evacuated although benign (false alarm)"
    if f["predicted"]:
        return f"predicted {f['lead_minutes']:.0f} simulated min before it failed; its rank moved in time"
    return "not predicted (it has no precursor)" if f["kind"] == "no_precursor" else "not predicted"


def write_html(demo: Demo, summary: dict[str, Any], path: Path) -> None:
    """The run as a page a person forwards (foreshock/templates/demo.html.j2, foreshock/pages.py): the
    verdict and what it means in words, each node's story, the evacuations, three labelled plots."""
    import numpy as np
    from matplotlib.figure import Figure
    from foreshock import goodput as gp
    from foreshock import pages

    fig = Figure(figsize=(9, 3.6))
    ax = fig.add_subplot()
    for f in demo.faults:
        if f.risk:
            ax.plot([demo.rel(t) for t, _ in f.risk], [risk_scale.level(p, demo.threshold) for _, p in f.risk],
                    label=f"{f.node}: {f.label}")
        if f.injected_at:
            ax.axvline(demo.rel(f.injected_at), ls=":", color="grey")
        if f.fails_at:
            ax.axvline(demo.rel(f.fails_at), ls="--", color="red")
        if f.first_directive:
            ax.axvline(demo.rel(f.first_directive), ls="-", color="green", alpha=0.5)
    ax.axhline(risk_scale.EVACUATE_LEVEL, color="red", lw=0.8, label="evacuation threshold (1x)")
    ax.axhline(risk_scale.WATCH_LEVEL, color="orange", lw=0.6, ls=":", label="watch (0.5x)")
    ax.set_xlabel("simulated minutes since the job started")
    ax.set_ylabel("risk level (x the threshold)")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_ylim(0, None)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    timeline = _png(fig)

    # Every rank of a data-parallel job computes the same loss: one line is the job's; the evacuation
    # step is marked, and a restart would show as a gap or a repeat.
    fig = Figure(figsize=(9, 3))
    ax = fig.add_subplot()
    lead = next((r for r in summary["results"] if r.get("name") == "rank0" and r.get("losses")),
                next((r for r in summary["results"] if r.get("losses")), None))
    if lead is not None:
        xs = sorted(map(int, lead["losses"]))
        ys = np.array([lead["losses"][str(x)] for x in xs])
        ax.plot(xs, ys, lw=0.6, color="#9ecae1", label="training loss, each step")
        window = min(50, len(ys))
        if window > 1:
            smooth = np.convolve(ys, np.ones(window) / window, mode="valid")
            ax.plot(xs[window - 1:], smooth, lw=1.6, color="#08519c", label=f"mean of the last {window} steps")
    for e in summary["evacuations"]:
        ax.axvline(e["at_step"], color="green", ls="--", label=f"evacuation at step {e['at_step']}")
    ax.set_xlabel("training step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7, loc="upper right")
    losses = _png(fig)
    goodput_png = base64.b64encode(gp.plot_png(gp.scenario_from({}))).decode()

    saved = summary["saved"]
    precursor = next((f for f in summary["faults"] if f["kind"] == "precursor"), None)
    if saved and precursor:
        headline = (f"The job was saved: {precursor['label']} on {precursor['node']} was predicted "
                    f"{precursor['lead_minutes']:.0f} simulated minutes before the node failed, and its rank "
                    f"moved to a spare at a step boundary. {summary['steps_completed']:,} steps ran with no "
                    f"restart, every rank ended with the same parameters, and "
                    f"{'no healthy node was evacuated' if not summary['false_evacuations'] else 'a healthy node was evacuated too'}.")
    elif summary["job_restarts"]:
        headline = (f"The job was not saved: it restarted {summary['job_restarts']} time(s) "
                    f"after {summary['steps_completed']:,} steps. The table below says which fault it lost to.")
    else:
        headline = _unfinished(summary)
    faults = [{"label": f["label"], "node": f["node"], "outcome": _outcome(f),
               "peak": f"{risk_scale.times(f['peak_level'])} ({risk_scale.percent(f['peak_risk'])})",
               "killed": "yes" if f["rank_killed"] else "no"} for f in summary["faults"]]
    evacuations = [{"ranks": ", ".join(str(r) for r in (e.get("ranks") or [])) or "-",
                    "from_node": e["from_node"], "to_node": e["to_node"] or "(none)", "at_step": e["at_step"],
                    "state": e["state"].replace("DIRECTIVE_STATE_", "").lower(),
                    "duration": "-" if e["duration_seconds"] is None else f"{e['duration_seconds']:.2f} s",
                    "reason": e["reason"]} for e in summary["evacuations"]]
    figures = [
        {"png": timeline, "caption": "Each injected node's risk level over the run (1x: evacuated). Dotted grey: "
                                     "a fault injected; dashed red: a node failed; green: the directive to move."},
        {"png": losses, "caption": "The job's training loss (every rank computes the same one). It continues "
                                   "through the evacuation step: no restart, no step repeated."},
        {"png": goodput_png, "caption": "What failures cost a job per month, by job size and recovery strategy "
                                        "(foreshock goodput, docs/goodput.md). Dashed: evacuation added to a job that "
                                        "otherwise restarts from checkpoints; below about 1,300 GPUs the spare node it "
                                        "needs costs more than the restarts it avoids, so it lies above checkpoint "
                                        "restart there."},
    ]
    events = [{"t": f"{t - demo.t0:6.1f}", "text": text} for t, text in demo.events]
    path.write_text(pages.render("demo.html.j2",
        verdict="the job was saved" if saved else "the job was NOT saved", saved=saved, headline=headline,
        model_version=summary["model_version"], threshold=risk_scale.percent(summary["threshold"]),
        horizon=f"{demo.horizon_minutes:.0f}", budget=f"{summary['false_evacuation_budget_per_1000_node_days']:g}",
        wall=summary["wall_seconds"], faults=faults, evacuations=evacuations, figures=figures, events=events))


def print_summary(summary: dict[str, Any]) -> None:
    print()
    print("=" * 78)
    print(f"Foreshock demo: {'JOB SAVED' if summary['saved'] else 'JOB NOT SAVED'}  "
          f"(job_restarts={summary['job_restarts']}, steps_completed={summary['steps_completed']}, "
          f"false_evacuations={summary['false_evacuations']})")
    if not summary["saved"] and not summary["job_restarts"]:
        print(f"  {_unfinished(summary)}")
    for f in summary["faults"]:
        if f["kind"] == "benign":
            verdict = "no evacuation (correct)" if not f["false_alarm"] else "FALSE ALARM"
        elif f["predicted"]:
            verdict = f"predicted {f['lead_minutes']:.0f} simulated min ahead"
        else:
            verdict = "not predicted" + (" (no precursor: expected)" if f["kind"] == "no_precursor" else "")
        print(f"  {f['label']:<40} {f['node']:<9} peak {risk_scale.times(f['peak_level'])} the threshold "
              f"({risk_scale.percent(f['peak_risk'])})  {verdict}")
    for e in summary["evacuations"]:
        phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in e["phases_seconds"].items()
                           if isinstance(v, (int, float)) and k != "total_to_first_step")
        took = (f"{e['duration_seconds']} s to the first step in the new world ({phases})"
                if e["duration_seconds"] is not None else "no rank reported its time to the first step in the new world")
        print(f"  evacuation {e['from_node']} -> {e['to_node']} at step {e['at_step']}: "
              f"{e['state'].replace('DIRECTIVE_STATE_', '')}, {took}")
    g = summary["goodput"]["this_run"]
    print(f"  GPU-hours lost: {g['foreshock_gpu_hours_lost']:.5f} with Foreshock vs "
          f"{g['checkpoint_restart_gpu_hours_lost']:.3f} under checkpoint restart ({g['gpus']} GPUs)")
    for k, v in summary["goodput"]["at_1024_gpus_per_month"].items():
        print(f"  at 1,024 GPUs, {k:<19} ${v['usd_per_month']:>9,}/month, goodput expense {v['goodput_expense']:.2%}")
    print("=" * 78)


# -- the command -----------------------------------------------------------------------------------
def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="the whole pipeline on loopback: a fault predicted, a job saved",
                              description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help="working directory (default out/demo)")
    p.add_argument("--json", help="write the summary as JSON to FILE")
    p.add_argument("--html", help="write the HTML report to FILE (default OUT/report.html)")
    p.add_argument("--no-live", dest="live", action="store_false", default=None,
                   help="plain log lines instead of the live terminal view")
    p.add_argument("--steps", type=int, help="training steps of the demo job")
    p.add_argument("--time-limit-seconds", type=float)
    p.add_argument("--budget", type=float, help="false evacuations per 1,000 node-days the threshold is chosen for")
    p.set_defaults(run=run)


def run(args: argparse.Namespace, file_data) -> int:
    flags = {k: getattr(args, k, None) for k in DEFAULTS}
    cfg = config.resolve("demo", DEFAULTS, file_data=file_data, flags=flags, checks=CHECKS)
    os.environ.setdefault("MPLBACKEND", "Agg")
    if cfg["live"] and not sys.stdout.isatty():
        cfg["live"] = False   # a live view redraws in place: in a log file or CI it would show nothing
    if cfg["live"] and logging.getLogger().level == logging.INFO:
        logging.getLogger().setLevel(logging.WARNING)  # INFO lines would tear through the live view
    demo = Demo(cfg)
    try:
        summary = demo.run()
    finally:
        demo.shutdown()
    summary["process_exit_codes"] = demo.job_codes
    html_path = Path(cfg["html"] or Path(cfg["out"]) / "report.html")
    write_html(demo, summary, html_path)
    brief = {k: v for k, v in summary.items() if k != "results"}
    (Path(cfg["out"]) / "summary.json").write_text(json.dumps(brief, indent=2, default=str))
    if cfg["json"]:
        Path(cfg["json"]).write_text(json.dumps(brief, indent=2, default=str))
    print_summary(summary)
    print(f"report: {html_path}")
    return 0 if summary["saved"] else 1
