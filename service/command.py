"""`foreshock serve`: the control plane as a service (gRPC + Prometheus), configured like every command.

Settings: defaults < `[serve]` in the TOML config < FORESHOCK_SERVE_<KEY> environment variables < flags
(foreshock/config.py). It prints `foreshock serve: listening on HOST:PORT` once it serves, and on
SIGTERM/SIGINT stops accepting calls, gives in-flight ones `--grace` seconds, flushes the decision log
and closes the state; a stop that overruns `--grace` plus STOP_SECONDS_AFTER_GRACE writes every thread's
stack to stderr and exits 1. Under `--shard`, SIGHUP reads the shard map again (so does a change of its
mtime; without `--shard` SIGHUP is ignored).
docs/service.md describes every setting.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import signal
import sys
import threading

from foreshock import config, stepcompare
from foreshock.service.actions import CHECKS as ACTION_CHECKS
from foreshock.service.actions import ActionSettings
from foreshock.service.coordinator import MAX_RECONFIRM_SECONDS, MIN_RECONFIRM_SECONDS, RECONFIRM_SECONDS
from foreshock.service.fabricunits import (CRASH_LOOP_RESTARTS, CRASH_LOOP_WINDOW_SECONDS, HOLD_SECONDS,
                                           MAX_CRASH_LOOP_RESTARTS, MAX_CRASH_LOOP_WINDOW_SECONDS, MAX_HOLD_SECONDS,
                                           MIN_CRASH_LOOP_RESTARTS, MIN_CRASH_LOOP_WINDOW_SECONDS, MIN_HOLD_SECONDS)
from foreshock.service.forwarder import CHECKS as FORWARD_CHECKS
from foreshock.service.forwarder import ForwardSettings
from foreshock.service.shardmap import SHARD_NAME_RE
from foreshock.service.steptimefeed import BUFFER_ROWS as STEP_TIME_BUFFER_ROWS
from foreshock.service.steptimefeed import HOLD_ROWS as STEP_TIME_HOLD_ROWS
from foreshock.service.steptimefeed import HOLD_SECONDS as STEP_TIME_HOLD_SECONDS
from foreshock.service.steptimefeed import MAX_HOLD_SECONDS as STEP_TIME_MAX_HOLD_SECONDS

# [serve] keys of the node actions (service/actions.py, docs/actions.md) -> ActionSettings fields; their
# defaults and ranges are ActionSettings' own.
ACTION_KEYS = {
    "slurm_drain": "slurm", "slurm_scontrol": "scontrol", "slurm_conf": "slurm_conf",
    "kubernetes_taint": "kubernetes", "kubernetes_kubeconfig": "kubeconfig",
    "kubernetes_taint_key": "taint_key", "kubernetes_taint_effect": "taint_effect",
    "action_timeout_seconds": "timeout_seconds", "action_max_fraction": "max_fraction",
    "action_fleet_size": "fleet_size", "action_max_attempts": "max_attempts",
    "action_backoff_seconds": "backoff_seconds", "action_recheck_seconds": "recheck_seconds",
}
# [serve] keys of a shard's forwarder to the jobs coordinator (service/forwarder.py) -> ForwardSettings
# fields; their defaults and ranges are ForwardSettings' own.
FORWARD_KEYS = {
    "forward_buffer_events": "buffer_events", "forward_batch_events": "batch_events",
    "forward_ack_timeout_seconds": "ack_timeout_seconds", "forward_stream_seconds": "stream_seconds",
    "forward_summary_seconds": "summary_seconds", "forward_tls_ca": "tls_ca",
    "forward_totals_poll_seconds": "totals_poll_seconds",
}
FORWARD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ForwardSettings)}

log = logging.getLogger(__name__)

# The stop's parts are each bounded (in-flight calls by --grace, the joins, the drain and the forwarder's
# flush by their own deadlines); the whole stop by --grace plus STOP_SECONDS_AFTER_GRACE, counted from the
# signal (stop_bound_seconds): 25 s with the default grace, 30 s with deploy/'s 10, which gives 40 s
# before a SIGKILL (tests/test_deploy_config.py checks every deployed bound against its kill). Past it
# every thread's stack goes to stderr and the process exits 1, where the kill would leave no trace. It cuts
# short no more than a kill would: the scorer checkpoint and the score level are written beside their
# file and renamed over it, the state store commits each change as it is made (the telemetry sequences
# once a second), and the archive is best-effort (docs/service.md, "The archive").
STOP_SECONDS_AFTER_GRACE = 20.0
MAX_GRACE_SECONDS = 300.0


def stop_bound_seconds(cfg: dict) -> float:
    """Seconds from the first SIGTERM/SIGINT after which a stop still running writes every thread's stack
    and exits 1: resolved settings' `grace` plus STOP_SECONDS_AFTER_GRACE. The init system's kill must
    come later (systemd TimeoutStopSec, Kubernetes terminationGracePeriodSeconds)."""
    return float(cfg["grace"]) + STOP_SECONDS_AFTER_GRACE


DEFAULTS = {
    "listen": "127.0.0.1:7443",
    "metrics_listen": "127.0.0.1:9464",
    "model": "",                 # "": the shipped default model
    "no_model": False,           # run without scoring (the Jobs API and DrainNode still work)
    "state": "/var/lib/foreshock/serve",
    "insecure": False,
    "tls_cert": "",
    "tls_key": "",
    "tls_client_ca": "",
    "token_file": "",
    "threshold": 0.0,            # 0: the model manifest's threshold
    "budget": 0.0,               # false evacuations per 1,000 node-days; 0: the manifest's recommendation
    "score_interval": 0.1,
    "cooldown_seconds": 600.0,
    "max_concurrent": 1,
    "sustain_seconds": 0.0,
    "grace": 5.0,
    "scoring_process": True,     # decode, value checks and scoring in a worker process (a second core)
    "close_hold_seconds": 0.5,   # telemetry streams wait at most this long while a step closes; 0: never
    "history": "",               # a dataset with incidents: the node history score, hourly; "": none
    "shard": "",                 # this instance's shard in shard_map: it serves that shard's nodes only
    "shard_map": "",             # the shard map (TOML, service/shardmap.py); with shard, never alone
    "shard_inventory": "",       # a dataset with an inventory table each version of the map is checked against
    **{key: getattr(ActionSettings(), name) for key, name in ACTION_KEYS.items()},
    "fail_slow": True,           # the fail-slow rule over jobs' step times (docs/service.md, "Fail-slow")
    "fail_slow_ratio": stepcompare.RATIO,     # a rank's step at this multiple of its job's median is slow ...
    "fail_slow_min_steps": stepcompare.FAIL_SLOW_MIN_STEPS,   # ... and this many slow steps ...
    "fail_slow_window": stepcompare.FAIL_SLOW_WINDOW,         # ... of its last this many make it fail-slow
    "xid_context_seconds": 5.0,  # a collateral Xid waits this long for its job's other nodes; 0: off
    "xid_context_min_nodes": 3,
    "xid_context_fraction": 0.25,
    "fabric_service_hold_seconds": HOLD_SECONDS,   # a fabric service not serving this long is down
    "fabric_service_crash_loop_restarts": CRASH_LOOP_RESTARTS,   # one restarted this often ...
    "fabric_service_crash_loop_window_seconds": CRASH_LOOP_WINDOW_SECONDS,   # ... within this is crash-looping
    "archive": "",               # a directory or URI: everything taken in, as Parquet (service/archive.py)
    "archive_file_bytes": 128 << 20,     # a file is published once it holds this many Parquet bytes ...
    "archive_roll_seconds": 900.0,       # ... or once its table's oldest rows not published waited this long
    "archive_buffer_bytes": 256 << 20,   # rows in memory, every table's together; over it, the largest
    #                                      table's go into its file as a run sorted by node
    "archive_queue_bytes": 256 << 20,    # waiting for the archive's writer; beyond, dropped and counted
    "coordinator": False,        # the jobs coordinator: Jobs API, directives, per-job policy; no telemetry
    "lease_file": "",            # the coordinator's lock file on the volume it shares with its standby
    "coordinator_model_version": "",   # the model shards should score with; "": the first shard's
    "coordinator_reconfirm_seconds": RECONFIRM_SECONDS,   # a shard's new instance has this long to raise again
    "coordinator_step_time_buffer_rows": STEP_TIME_BUFFER_ROWS,   # step_times rows waiting for each shard
    "coordinator_step_time_hold_rows": STEP_TIME_HOLD_ROWS,   # ... held for nodes of no known shard yet, in all
    "coordinator_step_time_hold_seconds": STEP_TIME_HOLD_SECONDS,   # ... each at most this long; 0: none held
    "coordinator_address": "",   # HOST:PORT[,HOST:PORT]: a shard, forwarding its alarms to the coordinator
    "forward_token_file": "",    # a file holding this shard's bearer token for the coordinator
    **{key: FORWARD_DEFAULTS[name] for key, name in FORWARD_KEYS.items()},
}
ARCHIVE_ROLL_SECONDS_MAX = 86_400   # a writer's file in progress untouched for twice this is a dead one's
# The archive's ranges: service/archive.py's ArchiveSettings holds its values to these too.
ARCHIVE_CHECKS = {
    "archive_file_bytes": config.between(1 << 20, 16 << 30),
    "archive_buffer_bytes": config.between(1 << 20, 64 << 30),
    "archive_roll_seconds": config.between(1, ARCHIVE_ROLL_SECONDS_MAX),
    "archive_queue_bytes": config.between(1 << 20, 16 << 30),
}
# close_hold_seconds and score_interval's upper bound are checked by server.Settings, which owns them;
# the fail_slow_* values by service/steptimes.py's FailSlowSettings; the xid_context_* ranges by
# service/xidcontext.py (through PolicySettings).
CHECKS = {
    "threshold": config.between(0, 1),
    "budget": config.at_least(0),
    "score_interval": config.above(0),
    "cooldown_seconds": config.at_least(0),
    "max_concurrent": config.at_least(1),
    "sustain_seconds": config.at_least(0),
    "grace": config.between(0, MAX_GRACE_SECONDS),
    "fabric_service_hold_seconds": config.between(MIN_HOLD_SECONDS, MAX_HOLD_SECONDS),
    "fabric_service_crash_loop_restarts": config.between(MIN_CRASH_LOOP_RESTARTS, MAX_CRASH_LOOP_RESTARTS),
    "fabric_service_crash_loop_window_seconds": config.between(MIN_CRASH_LOOP_WINDOW_SECONDS,
                                                               MAX_CRASH_LOOP_WINDOW_SECONDS),
    **{key: ACTION_CHECKS[name] for key, name in ACTION_KEYS.items() if name in ACTION_CHECKS},
    **ARCHIVE_CHECKS,
    "coordinator_reconfirm_seconds": config.between(MIN_RECONFIRM_SECONDS, MAX_RECONFIRM_SECONDS),
    "coordinator_step_time_buffer_rows": config.between(1024, 100_000_000),
    "coordinator_step_time_hold_rows": config.between(1024, 100_000_000),
    # past the maximum a held row reaches its shard's scorer late (service/steptimefeed.py)
    "coordinator_step_time_hold_seconds": config.between(0, STEP_TIME_MAX_HOLD_SECONDS),
    "shard": config.Check(lambda v: v == "" or bool(SHARD_NAME_RE.match(v)),
                          "must be a shard name (letters, digits, '.', '_', '-'; at most 63)"),
    **{key: FORWARD_CHECKS[name] for key, name in FORWARD_KEYS.items() if name in FORWARD_CHECKS},
}


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the control plane (gRPC telemetry, risk, jobs; Prometheus)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--listen", help="gRPC HOST:PORT (default 127.0.0.1:7443; port 0 picks one)")
    p.add_argument("--metrics-listen", help="Prometheus HOST:PORT ('' to disable; default 127.0.0.1:9464)")
    p.add_argument("--model", help="model directory (default: the shipped default model)")
    p.add_argument("--no-model", action="store_const", const=True, help="serve without scoring")
    p.add_argument("--state", help="state directory: SQLite state and the decision log")
    p.add_argument("--insecure", action="store_const", const=True,
                   help="plaintext, no credentials: loopback addresses only (demo, tests)")
    p.add_argument("--tls-cert", help="server certificate (PEM)")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", help="CA of client certificates: mutual TLS, CN = role[:subject]")
    p.add_argument("--token-file", help="bearer tokens, one `role[:subject] TOKEN` per line")
    p.add_argument("--threshold", type=float, help="evacuation risk threshold (default: the model's)")
    p.add_argument("--budget", type=float, help="false evacuations per 1,000 node-days to pick the threshold for")
    p.add_argument("--score-interval", type=float, help="seconds between scoring rounds (0.1)")
    p.add_argument("--cooldown-seconds", type=float, help="no new directive for a node this long after one")
    p.add_argument("--max-concurrent", type=int, help="default concurrent evacuations per job (1)")
    p.add_argument("--sustain-seconds", type=float, help="risk must stay above the threshold this long (0)")
    p.add_argument("--grace", type=float, help="seconds in-flight calls get on shutdown, 0-300 (5)")
    p.add_argument("--close-hold-seconds", type=float,
                   help="telemetry streams pause at most this long while a complete step's closing round "
                        "runs, so the risk path gets the CPU (0.5; 0 turns it off)")
    p.add_argument("--history", metavar="DIR",
                   help="dataset with an incidents table (foreshock history import, or your own): export the "
                        "node history score (foreshock_node_history_risk) hourly and prefer clean spares")
    p.add_argument("--archive", metavar="DIR_OR_URI",
                   help="write every telemetry table taken in, the decisions and the incidents to this "
                        "hive-partitioned Parquet dataset (a directory, or s3://... where pyarrow has it), "
                        "which foreshock train and evaluate read as is")
    p.add_argument("--archive-file-bytes", type=int,
                   help="an archive file is published once it holds this many bytes of Parquet (128 MiB)")
    p.add_argument("--archive-roll-seconds", type=float,
                   help="... or once its table's oldest rows not yet published waited this long (900)")
    p.add_argument("--archive-buffer-bytes", type=int,
                   help="archive rows held in memory, all tables together (256 MiB); over it, the largest "
                        "table's are written into its file")
    p.add_argument("--archive-queue-bytes", type=int,
                   help="submissions waiting for the archive's writer (256 MiB); beyond, dropped and counted")
    p.add_argument("--slurm-drain", action="store_const", const=True,
                   help="drain due nodes in Slurm (scontrol; docs/actions.md)")
    p.add_argument("--kubernetes-taint", action="store_const", const=True,
                   help="taint due Kubernetes nodes and set their ForeshockRisk condition (docs/actions.md)")
    p.add_argument("--no-fail-slow", dest="fail_slow", action="store_const", const=False,
                   help="do not judge jobs' step times (the fail-slow rule); they are still kept")
    p.add_argument("--fail-slow-ratio", type=float, help="a rank's step at this multiple of its job's median is "
                                                         "slow (1.2)")
    p.add_argument("--fail-slow-min-steps", type=int, help="slow steps among the last --fail-slow-window "
                                                           "that make a rank fail-slow (12)")
    p.add_argument("--fail-slow-window", type=int, help="steps a rank is judged over (16)")
    p.add_argument("--xid-context-seconds", type=float,
                   help="a collateral Xid (45, 79, 74, ...) waits this long for its job's or NVLink domain's other "
                        "nodes before it alarms its own (5; 0: never waits)")
    p.add_argument("--xid-context-min-nodes", type=int,
                   help="nodes of one job or NVLink domain with the same Xid that make one job event (3)")
    p.add_argument("--xid-context-fraction", type=float,
                   help="... or this share of the job's nodes, whichever is fewer, at least 2 (0.25)")
    p.add_argument("--fabric-service-hold-seconds", type=float,
                   help="nvidia-fabricmanager or nvidia-imex not serving this long (every sample of it) is a "
                        "finding: a restart is not (60; 10..3600)")
    p.add_argument("--fabric-service-crash-loop-restarts", type=int,
                   help="nvidia-fabricmanager or nvidia-imex restarted by systemd this many times (its NRestarts) "
                        "within --fabric-service-crash-loop-window-seconds is crash-looping (3; 2..1000)")
    p.add_argument("--fabric-service-crash-loop-window-seconds", type=float,
                   help="... and the finding clears once it has not restarted for this long (600; 60..86400)")
    p.add_argument("--shard", metavar="NAME",
                   help="serve only the nodes of the leaf switches this shard owns in --shard-map; another "
                        "shard's collectors are redirected there (docs/scaling.md, sharding)")
    p.add_argument("--shard-map", metavar="FILE", help="the shard map (TOML): shard -> address, leaves or selector; "
                   "read again when it changes or on SIGHUP")
    p.add_argument("--shard-inventory", metavar="DIR",
                   help="a dataset with the cluster's inventory table (the archive, foreshock simulate's output): "
                        "refuse a map (at start, or a new version while serving) with leaves it lacks, nodes in "
                        "two shards or leaves no shard owns")
    p.add_argument("--coordinator", action="store_const", const=True,
                   help="run as the jobs coordinator of a sharded control plane: the Jobs API, the directive "
                        "store and the per-job policy, fed by the shards' alarms; no telemetry (docs/scaling.md)")
    p.add_argument("--lease-file", metavar="PATH",
                   help="the coordinator's lock file, on the volume shared with its standby (beside --state): "
                        "whoever holds it leads, the other waits and takes over")
    p.add_argument("--coordinator-model-version",
                   help="the model version shards should score with (a shard with another is reported, not "
                        "refused); default: the first shard's")
    p.add_argument("--coordinator-reconfirm-seconds", type=float,
                   help="a shard's new instance (a restart) has this long to raise again the risk alarms and "
                        "fabric findings its previous one left; the rest are cleared (1200; keep it above the "
                        "shards' fabric_service_hold_seconds and crash-loop window)")
    p.add_argument("--coordinator-address", metavar="HOST:PORT[,HOST:PORT]",
                   help="a scoring shard: forward alarms, fatal events and risks to this jobs coordinator (and "
                        "its standby) instead of issuing directives here")
    p.add_argument("--forward-buffer-events", type=int,
                   help="events held for the coordinator until it acks them (100000); beyond, the oldest "
                        "risk summaries, then alarms, are dropped and counted")
    p.add_argument("--forward-ack-timeout-seconds", type=float,
                   help="a batch the coordinator has not acked this long ends the stream; the next address "
                        "is tried (5)")
    p.add_argument("--forward-summary-seconds", type=float,
                   help="how often every scored node's risk goes to the coordinator (15)")
    p.add_argument("--forward-tls-ca", help="CA of the coordinator's certificate (PEM)")
    p.add_argument("--forward-token-file", help="file holding this shard's bearer token (role shard:NAME)")
    p.add_argument("--no-scoring-process", dest="scoring_process", action="store_const", const=False,
                   help="score in the service process instead of a worker process (one core)")
    p.set_defaults(run=run)


def settings_from(cfg: dict):
    from foreshock.service.auth import load_token_file
    from foreshock.service.errors import ServiceError
    from foreshock.service.scoring import default_model_path
    from foreshock.service.server import Settings, SettingsError

    model_path = None
    scorer = None
    if cfg["no_model"] or cfg["coordinator"]:   # the coordinator loads no model: the shards score
        from foreshock.service.scoring import NullScorer
        scorer = NullScorer()
    else:
        model_path = cfg["model"] or (str(default_model_path()) if default_model_path() else "")
        if not model_path:
            raise SettingsError("no model: the predictor's default model path is unknown; give --model or --no-model")
    try:
        tokens = load_token_file(cfg["token_file"]) if cfg["token_file"] else {}
    except ServiceError as exc:
        raise SettingsError(str(exc)) from None
    shard_map = None
    if cfg["coordinator"] and (cfg["shard"] or cfg["shard_map"]):
        raise SettingsError("--coordinator and --shard/--shard-map are exclusive: the coordinator takes no "
                            "telemetry, the shards do")
    if cfg["shard"] or cfg["shard_map"]:
        from foreshock.service.shardmap import ShardMapError, ShardMapFile, shard_check
        if not (cfg["shard"] and cfg["shard_map"]):
            raise SettingsError("--shard and --shard-map go together: name this instance's shard and the map "
                                f"it is in (got shard {cfg['shard']!r}, shard_map {cfg['shard_map']!r})")
        try:   # followed while serving: every new version is held to the same checks (SIGHUP: now)
            shard_map = ShardMapFile(cfg["shard_map"], check=shard_check(cfg["shard"], cfg["shard_inventory"]))
        except ShardMapError as exc:
            raise SettingsError(str(exc)) from None
    elif cfg["shard_inventory"]:
        raise SettingsError("--shard-inventory checks a shard map: give --shard and --shard-map too")
    archive = None
    if cfg["archive"]:
        from foreshock.service.archive import ArchiveError, ArchiveSettings
        try:
            archive = ArchiveSettings(cfg["archive"], file_bytes=cfg["archive_file_bytes"],
                                      roll_seconds=cfg["archive_roll_seconds"],
                                      buffer_bytes=cfg["archive_buffer_bytes"], queue_bytes=cfg["archive_queue_bytes"])
        except ArchiveError as exc:
            raise SettingsError(str(exc)) from None
    coordinator = forward = None
    if cfg["coordinator"]:
        from foreshock.service.coordinator import CoordinatorSettings
        if cfg["coordinator_address"]:
            raise SettingsError("--coordinator and --coordinator-address are exclusive: the coordinator "
                                "forwards to no one")
        try:
            coordinator = CoordinatorSettings(cfg["lease_file"],
                                              expected_model_version=cfg["coordinator_model_version"],
                                              reconfirm_seconds=cfg["coordinator_reconfirm_seconds"],
                                              step_time_buffer_rows=cfg["coordinator_step_time_buffer_rows"],
                                              step_time_hold_rows=cfg["coordinator_step_time_hold_rows"],
                                              step_time_hold_seconds=cfg["coordinator_step_time_hold_seconds"])
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    elif cfg["lease_file"]:
        raise SettingsError("--lease-file is the coordinator's: give --coordinator too")
    if cfg["coordinator_address"]:
        from foreshock.service.forwarder import ForwardError, parse_addresses
        if not cfg["shard"]:
            # The coordinator keys every forwarded event by shard name and checks the token's role
            # against it: a shard has a name only from the map it is served in.
            raise SettingsError("--coordinator-address is a shard's: give --shard NAME and --shard-map FILE too")
        token = ""
        if cfg["forward_token_file"]:
            try:
                token = open(cfg["forward_token_file"]).read().strip()
            except OSError as exc:
                raise SettingsError(f"forward_token_file {cfg['forward_token_file']}: {exc.strerror}") from None
        try:
            forward = ForwardSettings(parse_addresses(cfg["coordinator_address"]),
                                      shard=cfg["shard"], token=token,
                                      **{name: cfg[key] for key, name in FORWARD_KEYS.items()})
        except ForwardError as exc:
            raise SettingsError(str(exc)) from None
    return Settings(
        coordinator=coordinator, forward=forward,
        state_dir=cfg["state"], archive=archive, listen=cfg["listen"], metrics_listen=cfg["metrics_listen"],
        model_path=model_path, scorer=scorer, insecure=cfg["insecure"], tls_cert=cfg["tls_cert"],
        tls_key=cfg["tls_key"], tls_client_ca=cfg["tls_client_ca"], tokens=tokens,
        threshold=cfg["threshold"] or None, false_evacuation_budget=cfg["budget"] or None,
        score_interval=cfg["score_interval"], scoring_process=bool(cfg["scoring_process"]),
        close_hold_seconds=cfg["close_hold_seconds"], history_dir=cfg["history"],
        shard=cfg["shard"], shard_map=shard_map,
        actions=ActionSettings(**{name: cfg[key] for key, name in ACTION_KEYS.items()}),
        policy={"cooldown_seconds": cfg["cooldown_seconds"], "default_max_concurrent": cfg["max_concurrent"],
                "sustain_seconds": cfg["sustain_seconds"], "xid_context_seconds": cfg["xid_context_seconds"],
                "xid_context_min_nodes": cfg["xid_context_min_nodes"],
                "xid_context_fraction": cfg["xid_context_fraction"],
                "fabric_service_hold_seconds": cfg["fabric_service_hold_seconds"],
                "fabric_service_crash_loop_restarts": cfg["fabric_service_crash_loop_restarts"],
                "fabric_service_crash_loop_window_seconds": cfg["fabric_service_crash_loop_window_seconds"]},
        fail_slow={"enabled": bool(cfg["fail_slow"]), "ratio": cfg["fail_slow_ratio"],
                   "min_steps": cfg["fail_slow_min_steps"], "window": cfg["fail_slow_window"]})


def run(args, file_data) -> int:
    from foreshock.service.scoring import ModelError
    from foreshock.service.server import SettingsError, build_server
    from foreshock.service.tuning import tune_gc, tune_malloc, tune_threads

    flags = {k: getattr(args, k, None) for k in DEFAULTS}
    cfg = config.resolve("serve", DEFAULTS, file_data=file_data, flags=flags, checks=CHECKS)
    try:
        plane = build_server(settings_from(cfg))
    except (SettingsError, ModelError) as exc:
        print(f"foreshock serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # the state folder (or a file it names) cannot be made or opened
        print(f"foreshock serve: {exc.filename or cfg['state']}: {exc.strerror}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum, _frame):
        if stop.is_set():
            return
        bound = stop_bound_seconds(cfg)
        log.info("signal %s: stopping (within %g s, or the threads' stacks are written here and it exits 1)",
                 signal.Signals(signum).name, bound)
        faulthandler.dump_traceback_later(bound, exit=True)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    # SIGHUP (`systemctl reload`) reads a shard's map again; without --shard it has nothing to do, and
    # must not stop the service as its default action would.
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda _s, _f: plane.request_shard_map_reload())
    try:
        try:
            port = plane.start()
        except Exception as exc:  # a port in use, unreadable certificates: say which, exit 2
            print(f"foreshock serve: cannot start: {exc}", file=sys.stderr)
            plane.stop(0)
            return 2
        tune_gc()
        tune_malloc()
        tune_threads()
        host = cfg["listen"].rpartition(":")[0]
        print(f"foreshock serve: listening on {host}:{port}"
              + (f" as shard {cfg['shard']}" if cfg["shard"] else "")
              + (f", metrics on {cfg['metrics_listen'].rpartition(':')[0]}:{plane.metrics_port}"
                 if plane.metrics_port else "")
              + (" (INSECURE: plaintext, loopback only, no credentials checked)" if cfg["insecure"] else "")
              + ("" if plane.leading else f" (coordinator standby: waiting for the lease {cfg['lease_file']})"),
              flush=True)
        leading = plane.leading
        while not stop.wait(0.2):
            if plane.leading and not leading:
                leading = True
                print(f"foreshock serve: coordinator leader on {host}:{port} (took the lease {cfg['lease_file']})"
                      + (f", metrics on {cfg['metrics_listen'].rpartition(':')[0]}:{plane.metrics_port}"
                         if plane.metrics_port else ""), flush=True)
        plane.stop(grace=cfg["grace"])
        return 0
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
