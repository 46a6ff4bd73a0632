"""`foreshock collect`: the node collector as a service (or one sweep with --once).

Settings resolve through foreshock.config: defaults < the TOML file's [collect] table <
FORESHOCK_COLLECT_<KEY> environment variables < flags. The service sweeps every --interval seconds,
writes the Parquet dataset under --out (rotated every --rotate-seconds, bounded by --spool-max-bytes and
--min-free-bytes), serves its health on --metrics-listen, optionally streams each sweep to the control
plane (--service HOST:PORT, or the address of its shard in --shard-map, through
foreshock.collectors.uplink.StreamingUplink), and on SIGTERM/SIGINT finishes the sweep in progress,
flushes every buffered row to Parquet and exits 0. SIGHUP reads the shard map again (so does a change of
its mtime). A stop that overruns SHUTDOWN_SECONDS (a sweep, a flush or the uplink's close stuck) writes
every thread's stack to stderr and exits 1, before the init system's kill would end it without a word.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time

from foreshock import config
from foreshock.predictor.signals import STEP_SECONDS
from foreshock.service.shardmap import LABEL_VALUE_RE, PLACEMENT_LABELS

from .repeats import DEFAULT_WINDOW_SECONDS, MAX_WINDOW_SECONDS

log = logging.getLogger("foreshock.collectors")

# The stop's parts are each bounded (the uplink's close by UPLINK_CLOSE_SECONDS, and what it waits on
# by its own deadlines); the whole stop by SHUTDOWN_SECONDS, under the 30 s that deploy/ gives before a
# SIGKILL (systemd TimeoutStopSec, Kubernetes terminationGracePeriodSeconds).
UPLINK_CLOSE_SECONDS = 5.0
SHUTDOWN_SECONDS = 20.0

DEFAULTS = {
    "interval": 1.0,
    "sources": ["nvml", "rdma", "netdev", "host_net", "kmsg"],
    "sysfs": "/sys",
    "procfs": "/proc",
    "kmsg": "/dev/kmsg",
    "node": "",
    "out": "/var/lib/foreshock/telemetry",
    "rotate_seconds": 300.0,
    "spool_max_bytes": 8 * 1024**3,
    "min_free_bytes": 1024**3,
    "max_buffer_rows": 500_000,
    "metrics_listen": "127.0.0.1:9465",   # the control plane's is 9464 (docs/operations.md)
    "service": "",
    "shard_map": "",             # a sharded control plane: stream to this node's shard (service/shardmap.py)
    "leaf_switch": "",           # this node's leaf switch, which places it in a shard ...
    "site": "",                  # ... and the labels a shard map's selector may use
    "spine": "",
    "tls_ca": "",
    "tls_cert": "",
    "tls_key": "",
    "token_file": "",
    "peers": [],
    "nvlink_links": False,
    "sim_gpus": 8,
    "sim_hcas": 8,
    "seed": 0,
    "fsync": True,
    "xid_fold_seconds": DEFAULT_WINDOW_SECONDS,
}
CHECKS = {
    # the predictor reads a counter's growth per feature step; a node sampled less often reads low counts
    "interval": config.Check(lambda v: 0 < v <= STEP_SECONDS, f"must be > 0 and <= {STEP_SECONDS} (the predictor's "
                             "feature step, docs/predictor.md \"Telemetry interval\")"),
    "rotate_seconds": config.above(0),
    "spool_max_bytes": config.at_least(0),     # 0: no bound
    "min_free_bytes": config.at_least(0),
    "max_buffer_rows": config.at_least(1),
    "sim_gpus": config.at_least(0),
    "sim_hcas": config.at_least(0),
    "seed": config.at_least(0),
    "xid_fold_seconds": config.between(0, MAX_WINDOW_SECONDS),
    # the placement labels travel as gRPC metadata (collectors/uplink.py)
    **{key: config.Check(lambda v: bool(LABEL_VALUE_RE.match(v)), "must be at most 256 printable ASCII "
                         "characters without spaces") for key in PLACEMENT_LABELS},
}


def register(subparsers) -> None:
    p = subparsers.add_parser("collect", help="collect node telemetry into Parquet (a node service)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--once", action="store_true", help="one sweep: write it, print what was read, exit")
    p.add_argument("--interval", type=float, help="seconds between sweeps (default 1)")
    p.add_argument("--sources", help="comma-separated sources (nvml,rdma,netdev,host_net,kmsg,systemd,simulated)")
    p.add_argument("--sysfs", help="sysfs root (default /sys)")
    p.add_argument("--procfs", help="procfs root (default /proc)")
    p.add_argument("--kmsg", help="/dev/kmsg, or a dmesg-style text file")
    p.add_argument("--node", help="node name (default: the hostname)")
    p.add_argument("--out", help="dataset root directory")
    p.add_argument("--rotate-seconds", type=float, help="close a Parquet interval every N seconds (300)")
    p.add_argument("--spool-max-bytes", type=int, help="drop the oldest files beyond this many bytes")
    p.add_argument("--min-free-bytes", type=int, help="drop the oldest files when free disk is below this")
    p.add_argument("--max-buffer-rows", type=int, help="close the interval early at this many rows")
    p.add_argument("--metrics-listen", help="HOST:PORT of the Prometheus endpoint ('' to disable)")
    p.add_argument("--service", help="HOST:PORT of the control plane to stream to (optional)")
    p.add_argument("--shard-map", metavar="FILE",
                   help="a sharded control plane's shard map (TOML): stream to this node's shard, and move when "
                        "the file changes or on SIGHUP (instead of --service)")
    p.add_argument("--leaf-switch", help="this node's leaf switch: places it in a shard of --shard-map")
    p.add_argument("--site", help="this node's site, for a shard map's selector")
    p.add_argument("--spine", help="this node's spine group, for a shard map's selector")
    p.add_argument("--tls-ca", help="CA bundle for --service TLS")
    p.add_argument("--tls-cert", help="client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", help="client key for mutual TLS")
    p.add_argument("--token-file", help="file with the node's bearer token for --service")
    p.add_argument("--peers", help="comma-separated [site=]host:port TCP probe targets")
    p.add_argument("--nvlink-links", action="store_const", const=True, help="also write nvlink_link rows")
    p.add_argument("--sim-gpus", type=int, help="GPUs of the simulated source (8)")
    p.add_argument("--sim-hcas", type=int, help="HCAs of the simulated source (8)")
    p.add_argument("--seed", type=int, help="seed of the simulated source")
    p.add_argument("--xid-fold-seconds", type=float,
                   help="fold repeats of one Xid within this window into one counted row (60; 0: every line a row)")
    p.set_defaults(run=run)


def _settings(args, file_data) -> dict:
    flags = {k: getattr(args, k, None) for k in DEFAULTS}
    return config.resolve("collect", DEFAULTS, file_data=file_data, flags=flags, checks=CHECKS)


def _tls(cfg: dict):
    """None, a CA path, or (ca, cert, key) for mutual TLS; a half-given mutual TLS is an error."""
    if cfg["tls_cert"] or cfg["tls_key"]:
        if not (cfg["tls_ca"] and cfg["tls_cert"] and cfg["tls_key"]):
            raise ValueError("mutual TLS needs --tls-ca, --tls-cert and --tls-key together")
        return (cfg["tls_ca"], cfg["tls_cert"], cfg["tls_key"])
    return cfg["tls_ca"] or None


def _shard_map(cfg: dict, node: str):
    """The shard map file of a sharded control plane, with this node placed in one of its shards (or
    ValueError naming the file, the node and its leaf); None without one."""
    if not cfg["shard_map"]:
        return None
    if cfg["service"]:
        raise ValueError("--service and --shard-map are exclusive: a sharded control plane's address is the "
                         "node's shard's, from the map")
    from foreshock.service.shardmap import ShardMapError, ShardMapFile
    try:
        shard_map = ShardMapFile(cfg["shard_map"])
        shard_map.current().shard_of(node, cfg["leaf_switch"], {k: cfg[k] for k in PLACEMENT_LABELS})
    except ShardMapError as exc:
        raise ValueError(str(exc) + ("" if cfg["leaf_switch"] else " (give --leaf-switch)")) from None
    return shard_map


def _uplink(cfg: dict, node: str, shard_map=None):
    try:
        from foreshock.collectors.uplink import StreamingUplink, UplinkError
    except ModuleNotFoundError as exc:
        if exc.name == "foreshock.collectors.uplink":
            raise SystemExit("foreshock collect: --service needs foreshock.collectors.uplink, "
                             "which this build does not have") from None
        raise
    token = None
    if cfg["token_file"]:
        with open(cfg["token_file"], encoding="utf-8") as fh:
            token = fh.read().strip()
    tls = _tls(cfg)
    try:
        uplink = StreamingUplink(cfg["service"], node=node, tls=tls, token=token, shard_map=shard_map,
                                 labels={k: cfg[k] for k in PLACEMENT_LABELS})
    except UplinkError as exc:
        raise ValueError(str(exc)) from None
    uplink.start()
    return uplink


def build_collector(cfg: dict, *, once: bool = False):
    from foreshock.dataset import DatasetWriter

    from .collector import Collector
    from .registry import SourceConfig, build_sources

    from .base import raise_fd_limit

    node = cfg["node"] or socket.gethostname()
    _tls(cfg)  # refuse bad TLS settings before anything is opened
    shard_map = _shard_map(cfg, node) if not once else None   # and a map that does not place the node
    # A missing default path is a machine without that hardware (the source reports "absent"); a path
    # the operator named that does not exist is a mistake to say, not an empty sweep.
    for key, users in (("sysfs", ("rdma", "netdev")), ("procfs", ("host_net",)), ("kmsg", ("kmsg",))):
        if cfg[key] != DEFAULTS[key] and set(users) & set(cfg["sources"]) and not os.path.exists(cfg[key]):
            raise ValueError(f"--{key} {cfg[key]}: does not exist")
    raise_fd_limit()
    sources = build_sources(cfg["sources"], SourceConfig(
        node=node, sysfs=cfg["sysfs"], procfs=cfg["procfs"], kmsg=cfg["kmsg"], peers=list(cfg["peers"]),
        nvlink_links=cfg["nvlink_links"], sim_gpus=cfg["sim_gpus"], sim_hcas=cfg["sim_hcas"],
        seed=cfg["seed"], xid_fold_seconds=cfg["xid_fold_seconds"]))
    writer = DatasetWriter(cfg["out"], rotate_seconds=cfg["rotate_seconds"],
                           max_buffer_rows=cfg["max_buffer_rows"], max_bytes=cfg["spool_max_bytes"] or None,
                           min_free_bytes=cfg["min_free_bytes"], fsync=cfg["fsync"])
    uplink = _uplink(cfg, node, shard_map) if (cfg["service"] or shard_map) and not once else None
    return Collector(node, sources, writer, uplink=uplink)


def summarize(tables: dict) -> str:
    """A short per-table summary of one sweep: rows, entities, a few non-null columns."""
    from foreshock import schema as sch
    lines = []
    for name in sorted(tables):
        t = tables[name]
        keys = sch.ENTITY_KEYS.get(name, ())
        ents = ""
        if keys and t.num_rows:
            vals = sorted({"/".join(str(r[k]) for k in keys) for r in t.select(list(keys)).to_pylist()})
            ents = " [" + ", ".join(vals[:8]) + (" ..." if len(vals) > 8 else "") + "]"
        nonnull = sum(1 for c in t.column_names if t.column(c).null_count < t.num_rows)
        lines.append(f"  {name:<12} {t.num_rows:>4} rows, {nonnull:>3} of {t.num_columns} columns set{ents}")
    return "\n".join(lines) if lines else "  (nothing read)"


def run(args, file_data) -> int:
    from .registry import UnknownSource
    cfg = _settings(args, file_data)
    try:
        collector = build_collector(cfg, once=args.once)
    except (UnknownSource, ValueError, OSError) as exc:
        print(f"foreshock collect: {exc}", file=sys.stderr)
        return 2
    if args.once:
        try:
            tables = collector.sweep_once()
        finally:
            collector.close()
        snap = collector.snapshot()
        print(f"foreshock collect --once: node {collector.node}, out {cfg['out']}")
        for name, st in sorted(snap.sources.items()):
            state = "absent" if st.absent else ("ok" if st.success else "FAILED")
            print(f"  source {name:<10} {state:<7} {st.rows:>4} rows, {st.errors} errors, "
                  f"{st.duration_seconds * 1e3:.2f} ms")
        print(summarize(tables))
        print(f"  wrote {snap.files_written} files, {snap.bytes_written} bytes")
        return 0
    return serve_forever(collector, cfg)


def serve_forever(collector, cfg: dict) -> int:
    stop = threading.Event()

    def _on_signal(signum, _frame):
        if stop.is_set():
            return
        log.info("signal %s: finishing the sweep, flushing and exiting (within %g s, or the threads' stacks "
                 "are written here and it exits 1)", signal.Signals(signum).name, SHUTDOWN_SECONDS)
        faulthandler.dump_traceback_later(SHUTDOWN_SECONDS, exit=True)
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    shard_map = getattr(collector.uplink, "shard_map", None)
    if shard_map is not None:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda _s, _f: shard_map.request_reload())
    server = None
    if cfg["metrics_listen"]:
        from .metrics import serve
        try:
            server, _thread = serve(collector, cfg["metrics_listen"])
        except (OSError, ValueError) as exc:
            print(f"foreshock collect: metrics endpoint {cfg['metrics_listen']}: {exc}", file=sys.stderr)
            collector.close()
            return 2
        log.info("metrics on http://%s/metrics", cfg["metrics_listen"])
    interval = cfg["interval"]
    log.info("collecting %s every %.3gs into %s as node %s", ",".join(s.name for s in collector.sources),
             interval, cfg["out"], collector.node)
    next_tick = time.monotonic()
    try:
        while not stop.is_set():
            # The next sweep is taken no earlier than the next tick (stop.wait never returns early);
            # 1 ms less covers the wall clock slewing against the monotonic one meanwhile.
            next_wall = time.time_ns() + int((next_tick + interval - time.monotonic()) * 1e9) - 1_000_000
            collector.sweep_once(next_sweep_ns=next_wall)
            next_tick += interval
            delay = next_tick - time.monotonic()
            if delay < 0:  # fell behind (a slow sweep): skip the missed ticks rather than burst
                next_tick = time.monotonic()
                delay = 0
            stop.wait(delay)
    finally:
        collector.close()
        if collector.uplink is not None:
            try:
                collector.uplink.close(UPLINK_CLOSE_SECONDS)
            except Exception as exc:  # noqa: BLE001
                log.warning("uplink close: %s", exc)
        if server is not None:
            server.shutdown()
            server.server_close()
        for s, h in previous.items():
            signal.signal(s, h)
        snap = collector.snapshot()
        log.info("stopped after %d sweeps: %d files, %d bytes written, %d dropped", snap.sweeps,
                 snap.files_written, snap.bytes_written, snap.files_dropped)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="foreshock")
    register(parser.add_subparsers())
    args = parser.parse_args(["collect", *(argv or [])])
    return run(args, {})
