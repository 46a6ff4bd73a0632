"""Fault injection and fuzzing, bounded and on loopback only: `python -m benchmarks faults [--quick]`.

Four loops, each printing what it tried and what went wrong (every "wrong" count should be 0):

1. sysfs: the `rdma` source over a copy of ../shared/fixtures/procfs, one mutation at a time of one
   entry of one port: a directory or a symlink loop where a file should be, an empty or whitespace-only
   file, garbage, permission denied on a file or on a device's `ports`/`counters` directory (os.open and
   os.listdir refuse that one path: chmod cannot refuse root), and "N/A (no PMA)" (unsupported: null
   and no error). Wrong: a sweep that raised, a port of another device missing, an entry that went
   null without a warning naming its path, an error where the value is only unsupported.
2. collector kills: `foreshock collect` (simulated source, 20 sweeps a second, the default 300 s
   rotation) killed with SIGKILL after a random number of sweeps, restarted on the same dataset, again
   and again; then one `--once` run. Wrong: a sweep its metrics had counted that is not in the dataset,
   a sweep written twice, a file that does not read.
3. service kills: `foreshock serve` (no model) killed with SIGKILL the instant it acknowledges a sweep
   that carries an Xid 79 of a node with a job, then restarted on the same state, which is killed at
   the next node's ack, and so on. Wrong: a directive missing after the restart, or its decision-log
   row missing or written twice.
4. gRPC: a real control plane (insecure, 127.0.0.1, no model) and, on every method of Telemetry, Risk,
   Jobs and health, random byte strings and valid requests with bytes flipped, sent raw. Wrong: any
   UNKNOWN status (an exception escaped a handler), and any traceback in the log. Printed too: the
   statuses seen and how many log lines the flood made.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FORESHOCK_SHARED", REPO.parent / "shared"))
FIXTURE = SHARED / "fixtures" / "procfs" / "sys"
TS = 1_780_000_000 * 10**9

ERROR_MUTATIONS = ("directory", "symlink_loop", "empty", "whitespace", "garbage", "eacces_file", "eacces_dir")
MUTATIONS = ERROR_MUTATIONS + ("unsupported",)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if record.exc_info:
            text += "\nTraceback"
        self.lines.append(text)


def _port_entries(root: Path) -> list[Path]:
    ports = sorted(root.glob("class/infiniband/*/ports/*"))
    out = []
    for port in ports:
        out += [port / n for n in ("state", "phys_state", "rate") if (port / n).is_file()]
        for sub in ("counters", "hw_counters"):
            out += sorted(p for p in (port / sub).glob("*") if p.is_file())
    return out


def _refusing(path: str, real):
    def call(p, *args, **kwargs):
        if str(p) == path:
            raise PermissionError(13, "Permission denied", str(p))
        return real(p, *args, **kwargs)
    return call


def fuzz_sysfs(mutations: int, seed: int = 0) -> dict:
    from foreshock.collectors.rdma import RdmaSource

    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench-faults-sys-"))
    lines = _Lines()
    logger = logging.getLogger("foreshock.collectors")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    tried: Counter = Counter()
    wrong: Counter = Counter()
    try:
        root = tmp / "sys"
        shutil.copytree(FIXTURE, root)
        for p in root.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        entries = _port_entries(root)
        counters = [p for p in entries if p.parent.name in ("counters", "hw_counters")]
        all_ports = {(p.parts[-3], int(p.name)) for p in root.glob("class/infiniband/*/ports/*")}
        for k in range(mutations):
            kind = MUTATIONS[k % len(MUTATIONS)]
            # "N/A (no PMA)" is what a counter reads when the port has no performance agent
            target = rng.choice(counters if kind == "unsupported" else entries)
            saved = target.read_bytes()
            patches = []
            expect_missing: set = set()
            if kind == "directory":
                target.unlink()
                target.mkdir()
            elif kind == "symlink_loop":
                target.unlink()
                target.symlink_to(target.name)
            elif kind == "empty":
                target.write_text("")
            elif kind == "whitespace":
                target.write_text(rng.choice([" ", "\n", " \t\n", "\n\n"]))
            elif kind == "garbage":
                target.write_bytes(b"x" + bytes(rng.randrange(33, 127) for _ in range(rng.randrange(0, 20))))
            elif kind == "unsupported":
                target.write_text("N/A (no PMA)\n")
            elif kind == "eacces_file":
                patches.append(mock.patch.object(os, "open", _refusing(str(target), os.open)))
            elif kind == "eacces_dir":
                port_dir = target.parent if target.parent.name.isdigit() else target.parent.parent
                device = port_dir.parent.parent.name
                if rng.random() < 0.5:
                    target = port_dir.parent      # the device's ports/ directory: its ports are gone
                    expect_missing = {p for p in all_ports if p[0] == device}
                else:
                    target = port_dir / "counters"
                patches.append(mock.patch.object(os, "listdir", _refusing(str(target), os.listdir)))
            tried[kind] += 1
            del lines.lines[:]
            src = RdmaSource("fuzz", sysfs=str(root))
            try:
                for patch in patches:
                    patch.start()
                try:
                    got = src.sweep(TS + k)
                except Exception:  # noqa: BLE001 - what the loop counts
                    wrong["sweep raised"] += 1
                    got = None
            finally:
                for patch in patches:
                    patch.stop()
                src.close()
            if got is not None:
                seen = {(r["device"], r["port"]) for r in got["rdma_port"].select(["device", "port"]).to_pylist()} \
                    if "rdma_port" in got else set()
                if seen != all_ports - expect_missing:
                    wrong["other ports lost"] += 1
                named = any(str(target) in line for line in lines.lines)
                if kind in ERROR_MUTATIONS and not (named and src.errors):
                    wrong[f"silent ({kind})"] += 1
                if kind == "unsupported" and src.errors:
                    wrong["error for an unsupported value"] += 1
            if kind == "directory":
                target.rmdir()
            elif kind == "symlink_loop":
                target.unlink()
            if kind not in ("eacces_file", "eacces_dir"):
                target.write_bytes(saved)
    finally:
        logger.removeHandler(lines)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"tried": dict(tried), "wrong": dict(wrong)}


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sweeps_counted(port: int) -> int:
    import urllib.request
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return 0
    for line in body.splitlines():
        if line.startswith("foreshock_collector_sweeps_total "):
            return int(float(line.split()[1]))
    return 0


def kill_collector(kills: int, seed: int = 0) -> dict:
    import subprocess

    from foreshock.dataset import read_table

    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench-faults-kill-"))
    out = tmp / "ds"
    common = ["--sources", "simulated", "--node", "k", "--out", str(out), "--sim-gpus", "2", "--sim-hcas", "1"]
    counted = 0
    try:
        for _ in range(kills):
            port = _free_port()
            proc = subprocess.Popen([sys.executable, "-m", "foreshock", "collect", *common, "--interval", "0.05",
                                     "--metrics-listen", f"127.0.0.1:{port}"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            want, seen, deadline = rng.randrange(3, 40), 0, time.monotonic() + 120
            while seen < want and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
                seen = _sweeps_counted(port)
            proc.kill()
            proc.wait()
            counted += seen
        subprocess.run([sys.executable, "-m", "foreshock", "collect", "--once", *common], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        counted += 1
        ts = read_table(out, "gpu").column("ts").to_pylist()
        sweeps = len(set(ts))
        return {"kills": kills, "sweeps_counted": counted, "sweeps_in_dataset": sweeps,
                "lost": max(0, counted - sweeps), "written_twice": len(ts) - 2 * sweeps}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _start_serve(state: Path):
    import subprocess
    proc = subprocess.Popen([sys.executable, "-m", "foreshock", "serve", "--insecure", "--listen", "127.0.0.1:0",
                             "--metrics-listen", "", "--no-model", "--state", str(state)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"foreshock serve did not start: {line!r}")
    return proc, line.split("listening on ")[1].split(" ")[0].rstrip(",")


def _fatal_batch(node: str):
    import datetime as dt

    import pyarrow as pa

    from foreshock import schema as sch
    from foreshock.v1 import telemetry_pb2 as tpb
    ev = sch.to_table("events", [{"ts": dt.datetime.now(dt.timezone.utc), "node": node, "kind": "xid",
                                  "source": "kmsg", "severity": "fatal", "xid": 79, "gpu": 0, "message": "Xid 79"}])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ev.schema) as w:
        w.write_table(ev)
    return tpb.SweepBatch(node=node, collector_id=f"c-{node}", sequence=1, tables=[
        tpb.TableRows(table="events", schema_version=1, arrow_ipc=sink.getvalue().to_pybytes())])


def kill_service(kills: int) -> dict:
    import grpc

    from foreshock.service.decisions import read_decisions
    from foreshock.v1 import jobs_pb2 as pb
    from foreshock.v1 import jobs_pb2_grpc, telemetry_pb2_grpc

    tmp = Path(tempfile.mkdtemp(prefix="bench-faults-serve-"))
    state = tmp / "state"
    lost_directives = bad_log_rows = 0
    proc = None
    try:
        for k in range(kills + 1):
            proc, address = _start_serve(state)
            with grpc.insecure_channel(address) as ch:
                jobs = jobs_pb2_grpc.JobsStub(ch)
                if k:   # the last kill's directive, after the restart
                    listed = jobs.ListDirectives(pb.ListDirectivesRequest(job_id=f"j{k - 1}"), timeout=10).directives
                    if [d.from_node for d in listed] != [f"n{k - 1}"]:
                        lost_directives += 1
                    else:
                        rows = read_decisions(state / "decisions").column("directive_id").to_pylist()
                        bad_log_rows += rows.count(listed[0].directive_id) != 1
                if k == kills:
                    break
                jobs.RegisterJob(pb.RegisterJobRequest(job_id=f"j{k}", ranks=[pb.RankPlacement(rank=0, node=f"n{k}")],
                                                       spare_nodes=[f"s{k}"], current_step=1), timeout=10)
                stream = telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([_fatal_batch(f"n{k}")]), timeout=10)
                next(stream)
                proc.kill()   # at the ack
                proc.wait()
        return {"kills": kills, "lost_directives": lost_directives, "bad_log_rows": bad_log_rows}
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _flip(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw or b"\x00")
    for _ in range(rng.randrange(1, 4)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def fuzz_grpc(per_method: int, seed: int = 0) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2

    from foreshock.service.auth import PERMISSIONS
    from foreshock.service.scoring import NullScorer
    from foreshock.service.server import Settings, build_server
    from foreshock.v1 import coordinator_pb2, jobs_pb2, risk_pb2, telemetry_pb2

    valid = {
        "RegisterJob": jobs_pb2.RegisterJobRequest(job_id="j", ranks=[jobs_pb2.RankPlacement(rank=0, node="n1")]),
        "ReportStep": jobs_pb2.ReportStepRequest(job_id="j", step=3), "DeregisterJob": jobs_pb2.DeregisterJobRequest(job_id="j"),
        "ReportStepTimes": jobs_pb2.ReportStepTimesRequest(job_id="j", rank=0, node="n1", steps=[
            jobs_pb2.StepTime(step=3, step_seconds=0.5, compute_seconds=0.2)]),
        "WatchDirectives": jobs_pb2.WatchDirectivesRequest(job_id="j"), "AckDirective": jobs_pb2.AckDirectiveRequest(job_id="j"),
        "ListDirectives": jobs_pb2.ListDirectivesRequest(job_id="j"), "CancelDirective": jobs_pb2.CancelDirectiveRequest(),
        "DrainNode": jobs_pb2.DrainNodeRequest(node="n1"), "GetNodeRisk": risk_pb2.GetNodeRiskRequest(node="n1"),
        "ListRiskiest": risk_pb2.ListRiskiestRequest(limit=3), "WatchRisk": risk_pb2.WatchRiskRequest(nodes=["n1"]),
        "StreamSweeps": telemetry_pb2.SweepBatch(node="n1", collector_id="c", sequence=1), "Check": health_pb2.HealthCheckRequest(),
        # served by a jobs coordinator only: a plain instance answers UNIMPLEMENTED, never UNKNOWN
        "ForwardAlarms": coordinator_pb2.ForwardRequest(shard="a", epoch=1, model_version="m"),
    }
    streaming = {"WatchDirectives", "WatchRisk"}
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench-faults-grpc-"))
    lines = _Lines()
    root = logging.getLogger()
    root.addHandler(lines)
    statuses: Counter = Counter()
    sent = 0
    plane = build_server(Settings.insecure_loopback(tmp / "state", scorer=NullScorer()))
    plane.start()
    try:
        with grpc.insecure_channel(plane.address) as ch:
            for method in sorted(PERMISSIONS) + ["/grpc.health.v1.Health/Check"]:
                name = method.rsplit("/", 1)[1]
                template = valid[name].SerializeToString()
                for k in range(per_method):
                    raw = _flip(rng, template) if k % 2 else bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
                    sent += 1
                    try:
                        if name in ("StreamSweeps", "ForwardAlarms"):
                            list(ch.stream_stream(method)(iter([raw]), timeout=2))
                        elif name in streaming:
                            list(ch.unary_stream(method)(raw, timeout=0.3))
                        else:
                            ch.unary_unary(method)(raw, timeout=2)
                        statuses["OK"] += 1
                    except grpc.RpcError as exc:
                        statuses[exc.code().name] += 1
    finally:
        plane.stop(0.5)
        root.removeHandler(lines)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"sent": sent, "statuses": dict(statuses), "unknown": statuses.get("UNKNOWN", 0),
            "tracebacks": sum("Traceback" in line for line in lines.lines),
            "log_lines": len(lines.lines)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench faults")
    ap.add_argument("--mutations", type=int, default=600, help="sysfs mutations (600)")
    ap.add_argument("--per-method", type=int, default=64, help="fuzzed requests per gRPC method (64)")
    ap.add_argument("--kills", type=int, default=20, help="collector kills (20)")
    ap.add_argument("--service-kills", type=int, default=12, help="service kills at the ack of an Xid 79 (12)")
    ap.add_argument("--quick", action="store_true", help="80 mutations, 3 + 2 kills, 8 requests a method")
    args = ap.parse_args(argv)
    if args.quick:
        args.mutations, args.kills, args.service_kills, args.per_method = 80, 3, 2, 8
    t0 = time.monotonic()
    s = fuzz_sysfs(args.mutations)
    print(f"sysfs: {sum(s['tried'].values())} mutations of the rdma source's entries ({s['tried']}) in "
          f"{time.monotonic() - t0:.1f} s; wrong: {s['wrong'] or 'none'}")
    t0 = time.monotonic()
    k = kill_collector(args.kills)
    print(f"collector: {k['kills']} kill -9 with the interval open, {k['sweeps_counted']} sweeps counted, "
          f"{k['sweeps_in_dataset']} in the dataset, {k['lost']} lost, {k['written_twice']} rows written twice, "
          f"in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    v = kill_service(args.service_kills)
    print(f"service: {v['kills']} kill -9 at the ack of an Xid 79, each restarted: {v['lost_directives']} "
          f"directives lost, {v['bad_log_rows']} missing or doubled in the decision log, in "
          f"{time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    g = fuzz_grpc(args.per_method)
    print(f"gRPC: {g['sent']} fuzzed requests over every method in {time.monotonic() - t0:.1f} s; statuses "
          f"{g['statuses']}; UNKNOWN {g['unknown']}, tracebacks logged {g['tracebacks']}, log lines "
          f"{g['log_lines']}; load average {os.getloadavg()[0]:.2f}")
    wrong = (s["wrong"] or k["lost"] or k["written_twice"] or v["lost_directives"] or v["bad_log_rows"]
             or g["unknown"] or g["tracebacks"])
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
