"""The control plane's Prometheus metrics: a custom collector that yields families from the latest state.

Nothing is updated on the hot path: each scrape reads the node book (risk per node), the ingest and
scoring counters and the durable store (directives by kind and state), as node_exporter-style
collectors do. Tested against a private registry and `promtool check metrics`.

  foreshock_node_failure_risk{node,leaf_switch,site}   probability of failing within the horizon
  foreshock_node_risk_level{node,leaf_switch,site}     that probability over the evacuation threshold in
                                                       force: 1 = evacuate, 0.5 = watch (foreshock/risk.py)
  foreshock_node_risk_signal_contribution{node,signal} share of the score a top signal explains
  foreshock_node_history_risk{node}                    P(a fault within the history horizon) from the node's
                                                       past faults (`serve --history`; docs/predictor.md)
  foreshock_node_evacuation_alarm{node,cause}          1 while the policy holds the node in alarm (risk, hard_evidence, fatal)
  foreshock_evacuation_threshold                       the risk threshold in force
  foreshock_evacuation_budget                          false evacuations per 1,000 node-days the threshold was
                                                       chosen for (NaN: a threshold set by hand, or no model)
  foreshock_risk_alarms_total{cause}                   risk alarms raised: the risk reached the threshold (risk), or hard
                                                       evidence (hard_evidence)
  foreshock_directives{kind,state}                     directives now in each state
  foreshock_directives_issued_total{kind}              directives ever issued
  foreshock_directive_outcomes_total{kind,outcome}     finished directives (completed, failed, cancelled)
  foreshock_ingest_batches_total{result}               accepted | duplicate
  foreshock_ingest_rejections_total{reason}            tables or batches refused, by reason
  foreshock_ingest_rows_total{table}                   rows accepted
  foreshock_ingest_received_bytes_total                Arrow IPC bytes received
  foreshock_ingest_backlog_batches                     batches waiting for the next scoring round
  foreshock_ingest_dropped_batches_total               batches dropped because the backlog was full
  foreshock_scoring_dropped_step_time_tables_total     step_times tables for the scorer dropped: the backlog full
  foreshock_scorer_rows_left_out_total{reason}         rows the scorer took and left out of the features: late,
                                                       past a bound, step times it cannot judge, undefined
                                                       fabric readings (predictor/online.py LEFT_OUT)
  foreshock_scoring_worker_up, foreshock_scoring_worker_restarts_total, foreshock_scoring_worker_lost_batches_total
                                                       the scoring worker process (service/worker.py)
  foreshock_scoring_rounds_total{trigger}              interval (incl. step closes) | events | flush (a stream ends)
  foreshock_scoring_duration_seconds                   histogram of a round (drain + score + policy)
  foreshock_model_info{version,horizon_seconds,path}   1
  foreshock_shard_info{shard,address}                  1: this instance's shard and its address in the map
                                                       (`serve --shard`; absent without one)
  foreshock_shard_redirected_streams_total{to_shard}   telemetry streams of another shard's node, refused
                                                       with that shard named (service/shardmap.py)
  foreshock_shard_unplaced_streams_total               telemetry streams of a node the map places in no
                                                       shard, in two, or that named no leaf switch
  foreshock_shard_map_info{digest}                     1: the map in force, by ShardMap.digest
  foreshock_shard_map_reloads_total, foreshock_shard_map_reload_failures_total
                                                       new versions of the map file taken | refused (`serve
                                                       --shard` follows its --shard-map; service/shardmap.py)
  foreshock_shard_map_refused                          1 while the file's latest version is refused
  foreshock_shard_moved_away_nodes_total               nodes a new map moved elsewhere, forgotten here
  foreshock_connected_collectors                       open telemetry streams
  foreshock_connected_job_watchers{job}                open WatchDirectives streams
  foreshock_registered_jobs                            jobs registered
  foreshock_fabric_incident{scope,name}                1 while a fabric incident is open
  foreshock_node_actions{state}                        nodes by node-action state: held, pending, taken,
                                                       failed, released (with actions on; service/actions.py)
  foreshock_node_action_limit                          the breaker's cap: nodes drained or tainted at once
  foreshock_node_action_calls_total{backend,call,result}  scontrol runs / API calls to take a node out (take)
                                                       or to see whether an operator brought it back (check);
                                                       result: ok, error, timeout, unknown_node
  foreshock_node_action_held_total                     times the breaker held a due node back
  foreshock_node_action_rejected_names_total           due nodes whose name no backend can take
  foreshock_node_fail_slow{node,job}                   1 while a rank of the node is consistently slower
                                                       than its job's others (service/steptimes.py)
  foreshock_node_fail_slow_ratio{node,job}             that rank's time over its job's median, meanwhile
  foreshock_step_time_samples_total{result}            ranks' step times kept | old | repeated
  foreshock_step_time_reports_refused_total            ReportStepTimes calls refused (bad input, unknown job)
  foreshock_xid_job_events_total{xid}                  one Xid on many nodes of a job or NVLink domain at once
                                                       (service/xidcontext.py): one event, no node alarmed
  foreshock_xid_context_sightings_total{outcome}       collateral Xids decided: job_event | node_fault | overflow
  foreshock_xid_context_pending                        collateral Xids waiting for their window
  foreshock_xid_outstanding{node,device,xid}           1 while an Xid that another cancels holds (163 until 162)
  foreshock_fabric_service_up{node,unit,state,judged}  1 while a fabric service (nvidia-fabricmanager,
                                                       nvidia-imex) serves, else 0; state: its ActiveState;
                                                       judged false: IMEX on an idle node, a masked unit
  foreshock_fabric_service_down{node,unit}             1 while a judged fabric service has not served for the
                                                       hold (a finding), 0 while it is judged and not
                                                       (service/fabricunits.py); no series when not judged
  foreshock_fabric_service_rows_total{result}          systemd_unit rows: taken | old | unknown_state |
                                                       unknown_unit | not_installed | overflow
  foreshock_fabric_service_crash_looping{node,unit}    1 while a judged fabric service restarted
                                                       crash_loop_restarts times within the window (a
                                                       finding), 0 while judged and not; no series when not
                                                       judged or its systemd reports no NRestarts
  foreshock_fabric_service_restart_samples_total{result}  taken rows' n_restarts: first | same | grew |
                                                       reset | missing | absurd
  foreshock_archive_up, foreshock_archive_errors_total, foreshock_archive_dropped_bytes_total,
  foreshock_archive_rows_total{table}, foreshock_archive_files_total, foreshock_archive_written_bytes_total,
  foreshock_archive_queued_bytes, foreshock_archive_buffered_bytes, foreshock_archive_restarts_total
                                                       the archive (`serve --archive`, service/archive.py,
                                                       service/archive_process.py)
  foreshock_coordinator_shard_model_mismatch{shard,model}  1 while a shard scores with another model than the
                                                       coordinator expects (the jobs coordinator only)
  foreshock_coordinator_events_total{shard,result}     shards' events applied | duplicate (sent again, known)
  foreshock_coordinator_fabric_service_findings{unit,finding}  fabric-service findings (down | crash_loop) the
                                                       shards forwarded and have not cleared
  foreshock_coordinator_reconfirm_cleared_total{kind}  risk alarms (alarm) and fabric findings (fabric_finding) a
                                                       shard's previous instance left and its new one did not
                                                       raise again within coordinator_reconfirm_seconds: cleared
  foreshock_coordinator_leader                         1 while this coordinator holds the lease, 0 on its
                                                       standby, whose /metrics has only this and process_*
  foreshock_forwarder_connected, foreshock_forwarder_buffered_events, foreshock_forwarder_acked_events_total,
  foreshock_forwarder_dropped_events_total{kind}, foreshock_forwarder_dropped_superseded_events_total,
  foreshock_forwarder_reconnects_total                 a shard's stream to the coordinator (service/forwarder.py);
                                                       superseded: drops a later buffered event made harmless
  foreshock_peer_totals_steps_total{result}           a shard's closed steps by what their job and site peer
                                                       features summed: remote (the other shards' totals of
                                                       the step), lagged (of an earlier step, within the lag),
                                                       missing (this shard's nodes only); late: sums that
                                                       came after every step that could use them closed;
                                                       refused: bad totals
  foreshock_forwarder_peer_totals_total{direction}     steps of peer totals sent to the coordinator | the
                                                       other shards' sums received
  foreshock_forwarder_step_time_rows_total, foreshock_forwarder_step_time_acks_refused_total
                                                       the jobs' step_times rows the acks brought for this
                                                       shard's scorer; acks whose rows did not decode
  foreshock_coordinator_step_time_rows_total{shard,result}  accepted step_times rows for a shard's scorer: sent
                                                       on its acks | dropped (its buffer full: the shard down
                                                       or slow; service/steptimefeed.py)
  foreshock_coordinator_step_time_rows_unrouted_total{reason}  rows of a job with a node of no known shard
                                                       that never reached that node's shard: held past
                                                       coordinator_step_time_hold_seconds (expired) or
                                                       hold_rows (full)
  foreshock_coordinator_step_time_rows_held            rows held for nodes whose shard is not known yet
  foreshock_coordinator_step_time_rows_released_total{shard}  held rows released to a node's shard once known
  foreshock_coordinator_step_time_rows_waiting{shard}  rows waiting for the shard's next ack
  process_*, python_info, python_gc_*                  the process, as any Prometheus client (foreshock/exposition.py)

The same HTTP listener (`serve_http`) answers GET /readyz: 200 while the instance serves (a coordinator:
while it leads), 503 otherwise. Kubernetes' gRPC readiness probe speaks plaintext only and the gRPC port
is TLS, so the probe that keeps a Service's traffic on the coordinator's leader reads this instead.
"""

from __future__ import annotations

import sqlite3

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from foreshock import fabric
from foreshock import risk as risk_scale
from foreshock.exposition import new_registry
from foreshock.service.actions import CALL_RESULTS, CALLS
from foreshock.service.coordinator import EventKind
from foreshock.service.domain import DirectiveKind, DirectiveState, TERMINAL_STATES
from foreshock.service.fabricunits import FINDINGS

SCORING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ControlPlaneCollector:
    def __init__(self, plane):
        self.plane = plane

    def describe(self):
        return []

    def collect(self):
        p = self.plane
        risk = GaugeMetricFamily("foreshock_node_failure_risk",
                                 "Calibrated probability that the node fails within the model's horizon.",
                                 labels=["node", "leaf_switch", "site"])
        # The top signals behind each node's score (a few per node: bounded by the scorer's
        # signals_per_node), so a dashboard can say why a node is risky next to how risky it is.
        contribution = GaugeMetricFamily("foreshock_node_risk_signal_contribution",
                                         "Share of the node's risk score attributed to a signal (top signals only).",
                                         labels=["node", "signal"])
        level = GaugeMetricFamily("foreshock_node_risk_level",
                                  "The node's risk over the evacuation threshold in force: 1 = evacuate, "
                                  f"{risk_scale.WATCH_LEVEL} = watch (docs/operations.md, the risk scale).",
                                  labels=["node", "leaf_switch", "site"])
        threshold = p.policy.settings.threshold
        for r in p.nodes.snapshot():
            topo = p.nodes.topo(r.node)
            risk.add_metric([r.node, topo.leaf_switch, topo.site], r.probability)
            level.add_metric([r.node, topo.leaf_switch, topo.site], risk_scale.level(r.probability, threshold))
            for sig in r.signals:
                contribution.add_metric([r.node, sig.name], sig.contribution)
        yield risk
        yield level
        yield contribution
        if p.nodes.history_default is not None:
            history = GaugeMetricFamily("foreshock_node_history_risk",
                                        "Probability of a fault within the history horizon (days), from the "
                                        "node's past faults; nodes with none get the fleet's default.",
                                        labels=["node"])
            for node in sorted(p.nodes.known_nodes() | set(p.nodes.history)):
                history.add_metric([node], p.nodes.history_risk(node))
            yield history
        alarm = GaugeMetricFamily("foreshock_node_evacuation_alarm",
                                  "1 while the evacuation policy holds the node in alarm; cause: risk (at or "
                                  "above the threshold), hard_evidence (a state of the hardware the model's manifest "
                                  "names, such as a link down, whatever the risk) or fatal (a fatal event).",
                                  labels=["node", "cause"])
        for node, a in list(p.policy.alarms.items()):
            alarm.add_metric([node, a.cause], 1.0)
        yield alarm
        yield GaugeMetricFamily("foreshock_evacuation_threshold", "Risk threshold in force for evacuations.",
                                value=p.policy.settings.threshold)
        budget = p.evacuation_budget
        yield GaugeMetricFamily("foreshock_evacuation_budget", "False evacuations per 1,000 node-days the "
                                "threshold in force was chosen for (NaN: set by hand, or no model).",
                                value=float("nan") if budget is None else budget)
        raised = CounterMetricFamily("foreshock_risk_alarms", "Risk alarms raised, by cause: a node's risk reached "
                                     "the evacuation threshold (risk), or its hard evidence alarmed it (hard_evidence); "
                                     "fatal alarms not counted.", labels=["cause"])
        for cause, count in p.policy.alarms_raised.items():
            raised.add_metric([cause], count)
        yield raised

        states = GaugeMetricFamily("foreshock_directives", "Directives now in each state.", labels=["kind", "state"])
        issued = CounterMetricFamily("foreshock_directives_issued", "Directives issued.", labels=["kind"])
        outcomes = CounterMetricFamily("foreshock_directive_outcomes", "Finished directives by outcome.",
                                       labels=["kind", "outcome"])
        try:
            counts = p.store_counts()
        except sqlite3.Error:
            counts = {}
        for kind in DirectiveKind:
            total = 0
            for state in DirectiveState:
                n = counts.get((int(kind), int(state)), 0)
                total += n
                states.add_metric([kind.name.lower(), state.name.lower()], n)
                if state in TERMINAL_STATES:
                    outcomes.add_metric([kind.name.lower(), state.name.lower()], n)
            issued.add_metric([kind.name.lower()], total)
        yield states
        yield issued
        yield outcomes

        ing = p.ingest
        batches = CounterMetricFamily("foreshock_ingest_batches", "Telemetry batches received.", labels=["result"])
        batches.add_metric(["accepted"], ing.accepted_batches)
        batches.add_metric(["duplicate"], ing.duplicate_batches)
        batches.add_metric(["gap"], ing.gap_batches)
        yield batches
        rej = CounterMetricFamily("foreshock_ingest_rejections", "Telemetry tables or batches refused.",
                                  labels=["reason"])
        for reason, n in sorted(dict(ing.rejected).items()):
            rej.add_metric([reason], n)
        yield rej
        rows = CounterMetricFamily("foreshock_ingest_rows", "Telemetry rows accepted.", labels=["table"])
        for table, n in sorted(dict(ing.accepted_rows).items()):
            rows.add_metric([table], n)
        yield rows
        yield CounterMetricFamily("foreshock_ingest_received_bytes", "Arrow IPC bytes received.",
                                  value=ing.bytes_received)
        yield GaugeMetricFamily("foreshock_ingest_backlog_batches", "Batches waiting for the next scoring round.",
                                value=p.scoring.backlog())
        yield CounterMetricFamily("foreshock_ingest_dropped_batches", "Batches dropped: the scoring backlog was full.",
                                  value=p.scoring.dropped_batches)
        yield CounterMetricFamily("foreshock_scoring_dropped_step_time_tables", "Tables of step_times rows for "
                                  "the scorer dropped, the oldest: more than the backlog waited for a drain.",
                                  value=p.scoring.dropped_checked)
        left_out = CounterMetricFamily("foreshock_scorer_rows_left_out", "Rows the scorer took in and left out "
                                       "of the features, by reason, since the scorer started: late for their step, "
                                       "past its pending bound, step times late, ahead, of an unknown node or not "
                                       "judgeable, fabric readings the data cannot mean.", labels=["reason"])
        for reason, n in sorted(p.scoring.left_out.items()):
            left_out.add_metric([reason], n)
        yield left_out
        worker = p.scoring.worker
        if worker is not None:
            yield GaugeMetricFamily("foreshock_scoring_worker_up",
                                    "1 while the scoring worker process is running and answering.",
                                    value=1.0 if worker.up else 0.0)
            yield CounterMetricFamily("foreshock_scoring_worker_restarts",
                                      "Scoring worker processes started again after dying or hanging.",
                                      value=worker.restarts)
            yield CounterMetricFamily("foreshock_scoring_worker_lost_batches",
                                      "Batches lost with a scoring worker that died or hung.",
                                      value=p.scoring.pipeline.lost_batches)
        rounds = CounterMetricFamily("foreshock_scoring_rounds", "Scoring rounds run.", labels=["trigger"])
        for trigger, n in sorted(dict(p.scoring.rounds).items()):
            rounds.add_metric([trigger], n)
        yield rounds
        yield CounterMetricFamily(
            "foreshock_scoring_watermark_closes", "Feature steps closed as soon as every reporting node's "
            "watermark had passed their end, not after the grace period.", value=p.scoring.early_closes)
        hold = p.hold
        yield CounterMetricFamily(
            "foreshock_ingest_close_holds", "Times telemetry streams waited for a complete step's closing round.",
            value=hold.holds)
        yield CounterMetricFamily(
            "foreshock_ingest_close_hold_expired", "Close holds that reached their limit before the round ended.",
            value=hold.expired)
        yield CounterMetricFamily(
            "foreshock_ingest_close_hold_seconds", "Time telemetry streams spent waiting for closing rounds.",
            value=hold.held_seconds)
        info = GaugeMetricFamily("foreshock_model_info", "The model in use.",
                                 labels=["version", "horizon_seconds", "path"])
        info.add_metric([p.scorer.model_version, str(p.scorer.horizon_seconds),
                         str(getattr(p.scorer, "model_path", ""))], 1.0)
        yield info
        if p.shard_gate is not None:
            yield from _shard(p.shard_gate, p.shard_map_file)
        yield GaugeMetricFamily("foreshock_connected_collectors", "Open telemetry streams.", value=ing.connected())
        watchers = GaugeMetricFamily("foreshock_connected_job_watchers", "Open WatchDirectives streams.",
                                     labels=["job"])
        for job, n in sorted(p.jobs.watchers().items()):
            watchers.add_metric([job], n)
        yield watchers
        yield GaugeMetricFamily("foreshock_registered_jobs", "Jobs registered.", value=p.registered_jobs())
        inc = GaugeMetricFamily("foreshock_fabric_incident", "1 while a fabric incident is open.",
                                labels=["scope", "name"])
        for scope, name in list(p.policy.incidents):
            inc.add_metric([scope, name], 1.0)
        yield inc
        actions = p.actions
        if actions is not None:
            by_state = GaugeMetricFamily("foreshock_node_actions", "Nodes by node-action state (drain, taint).",
                                         labels=["state"])
            for state, n in actions.counts().items():
                by_state.add_metric([state], n)
            yield by_state
            yield GaugeMetricFamily("foreshock_node_action_limit",
                                    "The circuit breaker's cap: nodes Foreshock keeps drained or tainted at once.",
                                    value=actions.limit())
            calls = CounterMetricFamily("foreshock_node_action_calls", "Calls to Slurm or the Kubernetes API.",
                                        labels=["backend", "call", "result"])
            counted = dict(actions.stats.calls)
            # every series from the start, at 0, so that increase() sees the first failure
            for backend in actions.backends:
                for call in CALLS:
                    for result in CALL_RESULTS:
                        calls.add_metric([backend.name, call, result], counted.get((backend.name, call, result), 0))
            yield calls
            yield CounterMetricFamily("foreshock_node_action_held",
                                      "Times the circuit breaker held a node due for an action back.",
                                      value=actions.stats.held)
            yield CounterMetricFamily("foreshock_node_action_rejected_names",
                                      "Nodes due for an action whose name a backend cannot take.",
                                      value=actions.stats.rejected_names)
        slow = GaugeMetricFamily("foreshock_node_fail_slow", "1 while a rank of the node is consistently "
                                 "slower than its job's other ranks (the fail-slow rule).", labels=["node", "job"])
        ratio = GaugeMetricFamily("foreshock_node_fail_slow_ratio", "The fail-slow rank's time over its job's "
                                  "median at the same steps.", labels=["node", "job"])
        for (node, job), verdict in sorted(dict(p.policy.fail_slow).items()):
            slow.add_metric([node, job], 1.0)
            ratio.add_metric([node, job], verdict.ratio)
        yield slow
        yield ratio
        samples = CounterMetricFamily("foreshock_step_time_samples", "Ranks' step times received: kept, old "
                                      "(before the job's window), or repeated (kept already).", labels=["result"])
        for result, n in sorted(dict(p.step_times.samples).items()):
            samples.add_metric([result], n)
        yield samples
        yield CounterMetricFamily("foreshock_step_time_reports_refused", "ReportStepTimes calls refused.",
                                  value=p.step_times.refused_reports)
        ctx = p.policy.context
        jobev = CounterMetricFamily("foreshock_xid_job_events", "Job events: one Xid on many nodes of a job or "
                                    "NVLink domain within seconds, alarming none of them.", labels=["xid"])
        for code, n in sorted(ctx.job_events.items()):
            jobev.add_metric([str(code)], n)
        yield jobev
        sighted = CounterMetricFamily("foreshock_xid_context_sightings", "Collateral Xids decided by the Xid "
                                      "context: part of a job event, or their node's fault.", labels=["outcome"])
        sighted.add_metric(["job_event"], ctx.suppressed)
        sighted.add_metric(["node_fault"], ctx.released)
        sighted.add_metric(["overflow"], ctx.overflow)
        yield sighted
        yield GaugeMetricFamily("foreshock_xid_context_pending", "Collateral Xids waiting for their window.",
                                value=ctx.pending())
        outstanding = GaugeMetricFamily("foreshock_xid_outstanding", "1 while an Xid another cancels is "
                                        "outstanding on a GPU (163 until 162).", labels=["node", "device", "xid"])
        for node, device, code, _ in ctx.outstanding():
            outstanding.add_metric([node, device, str(code)], 1.0)
        yield outstanding
        yield from _fabric_service_families(p.policy.units)
        if p.archive is not None:
            yield from _archive_families(p.archive.stats())
        if p.coordinator is not None:
            yield from _coordinator_families(p.coordinator)
        if p.forwarder is not None:
            yield from _forwarder_families(p.forwarder)
            yield from _peer_totals_families(p.scoring.peer_stats)


def _fabric_service_families(units):
    up = GaugeMetricFamily("foreshock_fabric_service_up", "1 while a fabric service (nvidia-fabricmanager, "
                           "nvidia-imex) serves, else 0; state: its ActiveState (unknown: none systemd defines); "
                           "judged false: IMEX on a node no compute domain uses, or a masked unit.",
                           labels=["node", "unit", "state", "judged"])
    down = GaugeMetricFamily("foreshock_fabric_service_down", "1 while a judged fabric service has not served "
                             "for the hold: a finding; 0 while judged and not.", labels=["node", "unit"])
    looping = GaugeMetricFamily("foreshock_fabric_service_crash_looping", "1 while a judged fabric service has "
                                "restarted the crash-loop rule's number of times within its window: a finding; "
                                "0 while judged and not (no series without an NRestarts).", labels=["node", "unit"])
    for u in sorted(units.snapshot(), key=lambda u: (u.node, u.unit)):
        up.add_metric([u.node, u.unit, u.state, "true" if u.judged else "false"], 1.0 if u.serving else 0.0)
        if u.judged:
            down.add_metric([u.node, u.unit], 1.0 if u.down else 0.0)
            if u.count is not None:
                looping.add_metric([u.node, u.unit], 1.0 if u.crash_looping else 0.0)
    yield up
    yield down
    yield looping
    rows = CounterMetricFamily("foreshock_fabric_service_rows", "systemd_unit rows of the fabric's services: "
                               "taken, unknown_state (taken as not serving), or not taken: old (an earlier sample), "
                               "unknown_unit, not_installed, overflow.", labels=["result"])
    for result, n in units.row_counts().items():
        rows.add_metric([result], n)
    yield rows
    restarts = CounterMetricFamily("foreshock_fabric_service_restart_samples", "n_restarts of the taken "
                                   "systemd_unit rows: first (a baseline), same, grew, reset (lower: restarted "
                                   "by hand or rebooted), missing (null: systemd < 235), absurd (no count, or "
                                   "grew impossibly fast).", labels=["result"])
    for result, n in units.restart_counts().items():
        restarts.add_metric([result], n)
    yield restarts


def _archive_families(a: dict):
    yield GaugeMetricFamily("foreshock_archive_up", "1 while the archive writes; 0 once a write failed "
                            "(a full disk): it stops, scoring goes on; 0 too while a dead archive process waits "
                            "to be started again.", value=1.0 if a["up"] else 0.0)
    yield CounterMetricFamily("foreshock_archive_errors", "Archive writes that failed, and submissions it "
                              "could not read.", value=a["errors"])
    yield CounterMetricFamily("foreshock_archive_dropped_bytes", "Bytes taken in that the archive did not "
                              "write: its queue was full, or it had stopped.", value=a["dropped_bytes"])
    rows = CounterMetricFamily("foreshock_archive_rows", "Rows written to the archive.", labels=["table"])
    for table, n in sorted(a["rows"].items()):
        rows.add_metric([table], n)
    yield rows
    yield CounterMetricFamily("foreshock_archive_files", "Parquet files written to the archive.", value=a["files"])
    yield CounterMetricFamily("foreshock_archive_written_bytes", "Parquet bytes written to the archive.",
                              value=a["written_bytes"])
    yield CounterMetricFamily("foreshock_archive_restarts", "Archive processes that died and were started "
                              "again (what each held is counted as dropped).", value=a.get("restarts", 0))
    yield GaugeMetricFamily("foreshock_archive_queued_bytes", "Bytes waiting for the archive's writer.",
                            value=a["queued_bytes"])
    yield GaugeMetricFamily("foreshock_archive_buffered_bytes", "Bytes buffered for the archive's next files.",
                            value=a["buffered_bytes"])


def _shard(gate, followed):
    shard_map, shard = gate.map, gate.shard
    info = GaugeMetricFamily("foreshock_shard_info", "This instance's shard (serve --shard) and its address in "
                                                     "the shard map.", labels=["shard", "address"])
    info.add_metric([shard.name, shard.address], 1.0)
    yield info
    redirected = CounterMetricFamily("foreshock_shard_redirected_streams",
                                     "Telemetry streams of another shard's node, refused with that shard named.",
                                     labels=["to_shard"])
    counted = dict(gate.redirected)
    for name in sorted((set(shard_map.names()) - {shard.name}) | set(counted)):
        redirected.add_metric([name], counted.get(name, 0))
    yield redirected
    yield CounterMetricFamily("foreshock_shard_unplaced_streams", "Telemetry streams of a node the shard map "
                              "places in no shard, in two, or that named no leaf switch.", value=gate.unplaced)
    map_info = GaugeMetricFamily("foreshock_shard_map_info", "1: the shard map in force, by its digest (a hash of "
                                 "what it says; every shard should hold the same).", labels=["digest"])
    map_info.add_metric([shard_map.digest], 1.0)
    yield map_info
    yield CounterMetricFamily("foreshock_shard_map_reloads", "New versions of the shard map file taken while "
                              "serving.", value=followed.reloads if followed is not None else 0)
    yield CounterMetricFamily("foreshock_shard_map_reload_failures", "New versions of the shard map file refused "
                              "(unreadable, invalid, without this shard, not fitting the inventory); the map "
                              "in force stayed.", value=followed.failed_reloads if followed is not None else 0)
    yield GaugeMetricFamily("foreshock_shard_map_refused", "1 while the shard map file's latest version is refused "
                            "and an older map stays in force.",
                            value=1.0 if followed is not None and followed.refused else 0.0)
    yield CounterMetricFamily("foreshock_shard_moved_away_nodes", "Nodes a new shard map moved to another shard "
                              "(or to none): redirected, and forgotten here.", value=gate.moved_away)


def _coordinator_families(c):
    mismatch = GaugeMetricFamily("foreshock_coordinator_shard_model_mismatch",
                                 "1 while the shard scores with another model than the coordinator expects "
                                 "(--coordinator-model-version, or the first shard's).", labels=["shard", "model"])
    events = CounterMetricFamily("foreshock_coordinator_events", "Shards' events: applied, or sent again and "
                                 "known (duplicate).", labels=["shard", "result"])
    for shard, (_, _, version) in sorted(c.shards().items()):
        mismatch.add_metric([shard, version], 1.0 if c.mismatch.get(shard) else 0.0)
    for shard in sorted(set(c.events_applied) | set(c.events_duplicate)):
        events.add_metric([shard, "applied"], c.events_applied.get(shard, 0))
        events.add_metric([shard, "duplicate"], c.events_duplicate.get(shard, 0))
    yield mismatch
    yield events
    findings = GaugeMetricFamily("foreshock_coordinator_fabric_service_findings", "Fabric-service findings the "
                                 "shards forwarded and have not cleared (a node with nvidia-fabricmanager's is "
                                 "refused as a spare); each node's series are its shard's.", labels=["unit", "finding"])
    held = {}
    for _, unit, finding, _ in c.findings.findings():
        held[(unit, finding)] = held.get((unit, finding), 0) + 1
    for unit in sorted(fabric.FABRIC_SERVICES):
        for finding in FINDINGS:
            findings.add_metric([unit, finding], held.get((unit, finding), 0))
    yield findings
    reconfirm = CounterMetricFamily("foreshock_coordinator_reconfirm_cleared", "Risk alarms and fabric findings "
                                    "a shard's previous instance left that its new instance did not raise again "
                                    "within coordinator_reconfirm_seconds, cleared.", labels=["kind"])
    for kind, n in sorted(c.reconfirm_cleared.items()):
        reconfirm.add_metric([kind], n)
    yield reconfirm
    r = c.step_times
    rows = CounterMetricFamily("foreshock_coordinator_step_time_rows", "Accepted step_times rows for a shard's "
                               "scorer (service/steptimefeed.py): sent on its acks, or dropped, the oldest, "
                               "while its buffer was full (the shard down or slow).", labels=["shard", "result"])
    waiting = r.waiting()
    for shard in sorted(set(r.sent_rows) | set(r.dropped_rows) | set(waiting)):
        rows.add_metric([shard, "sent"], r.sent_rows.get(shard, 0))
        rows.add_metric([shard, "dropped"], r.dropped_rows.get(shard, 0))
    yield rows
    unrouted = CounterMetricFamily("foreshock_coordinator_step_time_rows_unrouted", "Accepted step_times rows "
                                   "of a job with a node no shard had reported that never reached that node's "
                                   "shard: held past coordinator_step_time_hold_seconds (expired) or "
                                   "coordinator_step_time_hold_rows (full).", labels=["reason"])
    for reason, n in sorted(r.unrouted_rows.items()):
        unrouted.add_metric([reason], n)
    yield unrouted
    yield GaugeMetricFamily("foreshock_coordinator_step_time_rows_held", "step_times rows held for nodes whose "
                            "shard is not known yet, each report's once.", value=r.held())
    released = CounterMetricFamily("foreshock_coordinator_step_time_rows_released", "Held step_times rows "
                                   "released to a node's shard once it was known (then sent or dropped there).",
                                   labels=["shard"])
    for shard, n in sorted(r.released_rows.items()):
        released.add_metric([shard], n)
    yield released
    queued = GaugeMetricFamily("foreshock_coordinator_step_time_rows_waiting", "step_times rows waiting for "
                               "the shard's next ack.", labels=["shard"])
    for shard, n in sorted(waiting.items()):
        queued.add_metric([shard], n)
    yield queued
    yield _leader_family(True)


def _leader_family(leading: bool) -> GaugeMetricFamily:
    return GaugeMetricFamily("foreshock_coordinator_leader", "1 while this coordinator holds the lease and "
                             "serves, 0 while it is the standby.", value=1.0 if leading else 0.0)


class StandbyCollector:
    """A coordinator's standby opens no state, so it has none of the leader's families: only that it
    does not lead."""

    def collect(self):
        yield _leader_family(False)


def standby_registry() -> CollectorRegistry:
    registry = new_registry()
    registry.register(StandbyCollector())
    return registry


def _forwarder_families(f):
    yield GaugeMetricFamily("foreshock_forwarder_connected", "1 while the stream to the coordinator is up.",
                            value=1.0 if f.connected else 0.0)
    yield GaugeMetricFamily("foreshock_forwarder_buffered_events", "Events the coordinator has not acked yet.",
                            value=f.buffered())
    yield CounterMetricFamily("foreshock_forwarder_acked_events", "Events the coordinator acked (durable there).",
                              value=f.acked_total)
    dropped = CounterMetricFamily("foreshock_forwarder_dropped_events", "Events dropped because the buffer was "
                                  "full (risk summaries first, then events a later buffered one supersedes).",
                                  labels=["kind"])
    for kind in (k.name.lower() for k in EventKind):
        dropped.add_metric([kind], f.dropped_total.get(kind, 0))
    yield dropped
    yield CounterMetricFamily("foreshock_forwarder_dropped_superseded_events", "Of the dropped alarm, clear and "
                              "fabric-finding events, those a later buffered event of the same node (and unit) "
                              "superseded: the coordinator ends in the same state without them.",
                              value=f.dropped_superseded_total)
    yield CounterMetricFamily("foreshock_forwarder_reconnects", "Streams to the coordinator that broke or were "
                              "refused (a standby), each followed by the next address.", value=f.reconnects_total)
    totals = CounterMetricFamily("foreshock_forwarder_peer_totals", "Steps of job and site peer totals sent to "
                                 "the coordinator, and the other shards' sums received.", labels=["direction"])
    totals.add_metric(["sent"], f.totals_sent_total)
    totals.add_metric(["received"], f.peer_totals_received_total)
    yield totals
    yield CounterMetricFamily("foreshock_forwarder_step_time_rows", "The jobs' step_times rows the coordinator's "
                              "acks brought, for this shard's scorer.", value=f.step_time_rows_received_total)
    yield CounterMetricFamily("foreshock_forwarder_step_time_acks_refused", "Acks whose step times did not "
                              "decode as step_times rows (logged), let go.", value=f.step_time_acks_refused_total)


def _peer_totals_families(stats: dict):
    steps = CounterMetricFamily("foreshock_peer_totals_steps", "Closed steps by what their job and site peer "
                                "features summed: the other shards' totals of the step (remote), of an earlier "
                                "step (lagged), none (missing: this shard's nodes only); sums that came too "
                                "late to be used for any step (late); totals refused.",
                                labels=["result"])
    steps.add_metric(["remote"], stats.get("used", 0) - stats.get("lagged", 0))
    for result in ("lagged", "missing", "late", "refused"):
        steps.add_metric([result], stats.get(result, 0))
    yield steps


def build_registry(plane) -> tuple[CollectorRegistry, Histogram]:
    registry = new_registry()
    registry.register(ControlPlaneCollector(plane))
    hist = Histogram("foreshock_scoring_duration_seconds", "Duration of a scoring round (drain, score, policy).",
                     buckets=SCORING_BUCKETS, registry=registry)
    return registry, hist


def serve_http(listen: str, registry_of, ready):
    """The metrics listener: /readyz from `ready()`, everything else the exposition of `registry_of()`
    (read per request: a coordinator's registry changes when it takes the lease). Returns the server,
    serving on a daemon thread."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    from foreshock.config import parse_listen

    apps: dict[CollectorRegistry, object] = {}

    def app(environ, start_response):
        if environ.get("PATH_INFO") == "/readyz":
            ok = ready()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [b"ready\n" if ok else b"not ready: a coordinator's standby, or not serving yet\n"]
        registry = registry_of()
        exposition = apps.get(registry)
        if exposition is None:
            exposition = apps[registry] = make_wsgi_app(registry)
        return exposition(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):   # a scrape every few seconds is no news
            pass

    class Server(ThreadingWSGIServer):
        pass

    addr, port = parse_listen(listen)
    if ":" in addr:
        import socket
        Server.address_family = socket.AF_INET6
    httpd = make_server(addr, port, app, Server, handler_class=Quiet)
    threading.Thread(target=httpd.serve_forever, name="foreshock-metrics-http", daemon=True).start()
    return httpd
