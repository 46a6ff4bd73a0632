"""Control-plane load: N simulated nodes streaming 1 Hz sweeps into one `foreshock serve` process.

    .venv/bin/python -m benchmarks service [--nodes 2048] [--seconds 200] [--probe 3072,4096]
    BENCH_GENERATOR_NICE=19 ...   the load generator at the lowest priority (the collectors elsewhere)
    BENCH_CLOSE_HOLD=0 ...        the service without its close hold (`--close-hold-seconds`), to compare
    BENCH_ARCHIVE=1 ...           the service with its archive (`--archive`, service/archive.py) in the
                                  run's temporary directory (32 MiB buffer, files every 30 s), to compare
                                  the scoring path with and without; its writer in a process of its own,
                                  as `foreshock serve` runs it (service/archive_process.py)
    BENCH_ARCHIVE=thread ...      the same with the writer a thread of the service process

Three processes: the service (build_server, insecure loopback, a small model trained here through the
predictor's registry), a load generator (grpc.aio: one bidirectional stream per node, as real
collectors open them, each sending a SweepBatch every second: gpu, nvlink, rdma_port, netdev, host_net
for an 8-GPU / 8-HCA node, encoded once by the real uplink encoder, with each second's timestamp
written into the encoded bytes so the generator stays cheap), and this one, which is the job client
(registered jobs, watching their directives, acknowledging them) and the measurer.

Printed: offered and accepted batches per second, the scoring backlog over time (flat = sustained),
the service's CPU (share of one core) and memory (RSS, peak), ack round trips, and two latencies:
- fatal: from sending a sweep that carries an Xid 95 (uncontained ECC: a fault of the GPU itself, never
  another node's collateral) to the evacuation directive reaching the subscribed job client (the
  service acts on the sample at once; a collateral Xid such as 79 waits for its context window first,
  docs/service.md);
- risk: nodes whose PCIe replay counters climb cross the model's threshold when their one-minute
  feature step closes, which is as soon as every node's watermark is past the step's end (each sweep
  carries one, as the collectors send it); to the directive at the client from the arrival of the
  step's last sample (any node's: from then on the step is complete), from the crossing node's own last
  sample of the step, and from the step's end.
`--probe` repeats a shorter run at larger node counts to see how far one instance goes. Each run works
in a temporary directory that it removes, whatever happens; the service gets as long as it needs to
start (it writes `port.json` once it serves) for as long as it is alive, up to SERVICE_START_SECONDS
(600 s; BENCH_SERVICE_START_SECONDS=N to change it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

S = 1_000_000_000
GRACE = 0.25
GENERATOR_NICE = int(os.environ.get("BENCH_GENERATOR_NICE", "0"))
# Training the model and starting the scoring worker took over 30 s on a busy 2-core machine: the wait
# ends when the service writes its port file or exits, this is only the bound for a hung one.
SERVICE_START_SECONDS = float(os.environ.get("BENCH_SERVICE_START_SECONDS", "600"))


# -- the service process -----------------------------------------------------------------------------
def train_model(out: Path) -> Path:
    from foreshock.predictor import synthetic
    return synthetic.pcie_replay_model_dir(out, version="bench-pcie-1", calibrated=True)


def serve(state: str, model: str, port_file: str) -> int:
    from foreshock.service.archive import ArchiveSettings
    from foreshock.service.server import Settings, build_server
    from foreshock.service.tuning import tune_gc, tune_malloc, tune_threads
    # Small bounds, so that the archive sorts, writes and publishes all through the run (the defaults
    # would hold a 130 s run in memory and write it at the stop, outside the measured window).
    mode = os.environ.get("BENCH_ARCHIVE", "0")
    archive = ArchiveSettings(str(Path(state).parent / "archive"), buffer_bytes=32 << 20, roll_seconds=30,
                              process=mode == "1") if mode in ("1", "thread") else None
    plane = build_server(Settings.insecure_loopback(
        state, model_path=model, metrics_listen="127.0.0.1:0", scorer_grace_seconds=GRACE, fsync=True,
        scoring_process=os.environ.get("BENCH_SERVICE_IN_PROCESS") != "1",
        close_hold_seconds=float(os.environ.get("BENCH_CLOSE_HOLD", "0.5")),
        policy={"cooldown_seconds": 0.0}, archive=archive))
    port = plane.start()
    tune_gc()   # as `foreshock serve` does
    tune_malloc()
    tune_threads()
    if os.environ.get("BENCH_SERVICE_SWITCH"):
        sys.setswitchinterval(float(os.environ["BENCH_SERVICE_SWITCH"]))
    partial = Path(port_file).with_suffix(".partial")
    partial.write_text(json.dumps({"port": port, "metrics": plane.metrics_port}))
    os.replace(partial, port_file)   # whole or absent: the reader never parses half of it
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    profile = os.environ.get("BENCH_SERVICE_PROFILE")
    if profile:
        threading.Thread(target=_sample_stacks, args=(stop, profile), daemon=True).start()
    while not stop.wait(0.5):
        pass
    plane.stop(grace=1.0)
    return 0


def _sample_stacks(stop: threading.Event, out: str) -> None:
    """A sampling profile of the service's threads (sys._current_frames every 10 ms): where the event
    loop and the scoring thread spend their time. BENCH_SERVICE_PROFILE=FILE turns it on."""
    import collections
    import traceback
    names = {}
    own = collections.Counter()
    total = collections.Counter()
    while not stop.wait(0.01):
        for t in threading.enumerate():
            names[t.ident] = t.name
        for ident, frame in sys._current_frames().items():
            name = names.get(ident, "?")
            if name.startswith("foreshock") or name == "MainThread":
                stack = traceback.extract_stack(frame)
                if not stack:
                    continue
                top = stack[-1]
                own[(name, f"{top.filename.rsplit('/', 2)[-1]}:{top.lineno} {top.name}")] += 1
                for fr in {f"{f.filename.rsplit('/', 2)[-1]}:{f.name}" for f in stack}:
                    total[(name, fr)] += 1
    with open(out, "w") as f:
        f.write("# own samples (10 ms each)\n")
        for (name, where), n in own.most_common(40):
            f.write(f"{n:6d} {name:24s} {where}\n")
        f.write("# inclusive samples\n")
        for (name, where), n in total.most_common(60):
            f.write(f"{n:6d} {name:24s} {where}\n")


# -- the load generator process ----------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (SweepBatch is assembled from pre-serialized parts)."""
    return bytes([tag]) + _varint(len(payload)) + payload


def _table_rows(name: str, blob: bytes, omitted: bool) -> bytes:
    from foreshock.collectors.uplink import split_stream
    from foreshock.v1 import telemetry_pb2 as tpb
    ipc = split_stream(blob)[1] if omitted else blob
    return _field(0x22, tpb.TableRows(table=name, schema_version=1, arrow_ipc=ipc,
                                      schema_omitted=omitted).SerializeToString())


def _offsets(blob: bytes, marker: bytes) -> list[int]:
    offs, k = [], blob.find(marker)
    while k >= 0:
        offs.append(k)
        k = blob.find(marker, k + 1)
    return offs


def _templates(nodes: list[str], t0: int):
    """Per node: (the SweepBatch's node and collector_id fields, then for the whole-schema and the
    schema-omitted forms: the serialized TableRows fields and the offsets of the timestamp in them).
    A sweep is then a copy, 8-byte timestamp patches and the sequence field: no Arrow, no protobuf."""
    from foreshock.collectors.simulated import SimpleNodeModel
    from foreshock.collectors.uplink import encode_table
    marker = struct.pack("<q", t0)
    out = {}
    for i, node in enumerate(nodes):
        tables = SimpleNodeModel(node, gpus=8, hcas=8, seed=i).sample(t0)
        tables.pop("events", None)
        prefix = _field(0x0A, node.encode()) + _field(0x12, f"bench-{node}".encode())
        forms = {}
        for omitted in (False, True):
            parts = {name: _table_rows(name, encode_table(name, t), omitted) for name, t in tables.items()}
            gpu = parts.pop("gpu")
            blob = b"".join(parts.values()) + gpu   # the gpu part last: a ramp node replaces it
            forms[omitted] = (blob, _offsets(blob, marker), len(blob) - len(gpu))
        out[node] = (prefix, forms)
    return out


def _ipc(name, rows):
    from foreshock import schema as sch
    from foreshock.collectors.uplink import encode_table
    return encode_table(name, sch.to_table(name, rows))


async def _generate(address: str, nodes: list[str], seconds: float, fatal: dict[str, float],
                    ramp: list[str], result: dict, leaves: dict[str, str] | None = None):
    import grpc

    from foreshock.collectors.simulated import SimpleNodeModel
    from foreshock.collectors.uplink import encode_table
    from foreshock.v1 import telemetry_pb2 as tpb

    t0 = time.time_ns()
    templates = _templates(nodes, t0)
    ramp_models = {n: SimpleNodeModel(n, gpus=8, hcas=8, seed=7) for n in ramp}
    ramp_extra = {n: 0 for n in ramp}
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(8)]
    # Pre-serialized requests go as they are (no request serializer).
    methods = [ch.stream_stream("/foreshock.v1.Telemetry/StreamSweeps", request_serializer=None,
                                response_deserializer=tpb.SweepAck.FromString) for ch in channels]
    loop = asyncio.get_running_loop()
    sent_at: dict[str, float] = {}
    step_last_sent: dict[int, float] = {}        # per feature step: when its last sample (any node) went
    ramp_sent: dict[str, list[tuple[int, float]]] = {n: [] for n in ramp}   # (ts, when sent)
    counters = {"sent": 0, "acked": 0, "rejected": 0, "inflight_max": 0, "bytes": 0}
    # The most recent million round trips (over 8 minutes at 2,048 nodes): a soak's generator stays flat.
    rtts: collections.deque[float] = collections.deque(maxlen=1_000_000)
    inflight_series: list[int] = []

    # Ramp node j starts climbing at second 2 + 60 (j % closes), so that the crossings fall in
    # several step closes of the run, not all in one.
    closes = max(1, int((seconds - 15) // 60))
    ramp_start = {n: 2 + 60 * (j % closes) for j, n in enumerate(ramp)}

    def ramp_gpu_at(node: str, k: int, ts: int) -> dict[bool, tuple[bytes, list[int]]]:
        import pyarrow as pa
        import pyarrow.compute as pc
        g = ramp_models[node].sample(ts)["gpu"]
        if k >= ramp_start[node]:
            ramp_extra[node] += 20_000
        col = pc.add(g.column("pcie_replay_counter").fill_null(0),
                     pa.array(np.full(g.num_rows, ramp_extra[node], np.uint64)))
        g = g.set_column(g.schema.get_field_index("pcie_replay_counter"), g.schema.field("pcie_replay_counter"), col)
        marker = struct.pack("<q", ts)
        out = {}
        for omitted in (False, True):
            part = _table_rows("gpu", encode_table("gpu", g), omitted)
            out[omitted] = (part, _offsets(part, marker))
        return out

    # The ramp nodes' gpu tables (PCIe replays climbing 20,000 a second), encoded before the run, one
    # per second, as the other tables are: the generator's own CPU goes to sending, not to Arrow.
    ramp_parts = {n: [ramp_gpu_at(n, k, t0 + k * S) for k in range(int(seconds) + 4)] for n in ramp}

    def ramp_gpu(node: str, k: int, tsb: bytes, omitted: bool) -> bytes:
        parts = ramp_parts[node]
        part, offs = parts[min(k, len(parts) - 1)][omitted]
        p = bytearray(part)
        for o in offs:
            p[o:o + 8] = tsb
        return bytes(p)

    start = loop.time() + 2.0
    stop_at = start + seconds

    async def one(i: int, node: str):
        pending: dict[int, float] = {}
        kept = {"schemas": False}
        # A shard places a stream by the leaf switch its collector names (service/shardmap.py LABEL_KEYS).
        metadata = (("foreshock-leaf-switch", leaves[node]),) if leaves else None
        call = methods[i % len(methods)](timeout=seconds + 120, metadata=metadata)

        async def reader(call):
            try:
                while (ack := await call.read()) is not grpc.aio.EOF:
                    t = pending.pop(ack.acked_sequence, None)
                    if t is not None:
                        rtts.append(time.perf_counter() - t)
                    kept["schemas"] = ack.schemas_kept
                    counters["acked"] += 1
                    counters["rejected"] += len(ack.rejections)
            except grpc.aio.AioRpcError as exc:
                result.setdefault("stream_errors", []).append(
                    f"{node}: {exc.code().name} at {loop.time() - stop_at:+.0f} s from the end")
        rt = asyncio.create_task(reader(call))
        await asyncio.sleep(max(0.0, start - loop.time()) + (i % 1000) / 1000.0)
        prefix, forms = templates[node]
        seq, next_t, fatal_at = 0, loop.time(), fatal.get(node)
        while loop.time() < stop_at:
            ts = time.time_ns()
            omitted = kept["schemas"]
            blob, offs, gpu_at = forms[omitted]
            b = bytearray(blob)
            tsb = struct.pack("<q", ts)
            for o in offs:
                b[o:o + 8] = tsb
            body = bytes(b) if node not in ramp_models else bytes(b[:gpu_at]) + ramp_gpu(node, seq, tsb, omitted)
            if fatal_at is not None and loop.time() >= start + fatal_at:
                fatal_at = None
                import datetime as dt
                body += _field(0x22, tpb.TableRows(table="events", schema_version=1, arrow_ipc=_ipc("events", [{
                    "ts": dt.datetime.now(dt.timezone.utc), "node": node, "kind": "xid", "source": "kmsg",
                    "severity": "fatal", "xid": 95, "gpu": 3,
                    "message": "NVRM: Xid 95, Uncontained ECC error."}])).SerializeToString())
                sent_at[node] = time.time()
            seq += 1
            pending[seq] = time.perf_counter()
            # The watermark, as a collector sends it: the wall-clock time of the next sweep, less 1 ms.
            wm = time.time_ns() + int((next_t + 1.0 - loop.time()) * 1e9) - 1_000_000
            msg = prefix + body + b"\x18" + _varint(seq) + b"\x29" + struct.pack("<q", wm)
            counters["bytes"] += len(msg)
            sent = time.time()   # handed to gRPC: on loopback, about when the service has it
            try:
                await call.write(msg)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                result.setdefault("stream_errors", []).append(
                    f"{node}: write {exc} at {loop.time() - stop_at:+.0f} s from the end")
                # As a collector does: a new stream (schemas whole again), the sweep again.
                counters["reopened"] = counters.get("reopened", 0) + 1
                call.cancel()
                call = methods[(i + counters["reopened"]) % len(methods)](timeout=seconds + 120, metadata=metadata)
                kept["schemas"] = False
                rt = asyncio.create_task(reader(call))
                if "Xid 95" in msg.decode("latin-1"):
                    fatal_at, sent_at[node] = 0.0, None
                await asyncio.sleep(0.1)
                continue
            counters["sent"] += 1
            step_last_sent[ts // (60 * S)] = sent
            if node in ramp_sent:
                ramp_sent[node].append((ts, sent))
            next_t += 1.0
            await asyncio.sleep(max(0.0, next_t - loop.time()))
        try:
            await call.done_writing()
            await asyncio.wait_for(rt, 30)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            call.cancel()

    async def watch():
        while loop.time() < stop_at:
            inflight_series.append(counters["sent"] - counters["acked"])
            await asyncio.sleep(1.0)
    tasks = [asyncio.create_task(one(i, n)) for i, n in enumerate(nodes)] + [asyncio.create_task(watch())]
    result["setup_seconds"] = (time.time_ns() - t0) / S
    await asyncio.gather(*tasks)
    for ch in channels:
        await ch.close()
    rt = np.array(rtts) if rtts else np.zeros(1)
    result.update(counters, fatal_sent=sent_at, inflight=inflight_series, ramp_sent=ramp_sent,
                  step_last_sent={str(k): v for k, v in step_last_sent.items()},
                  ack_rtt_p50_ms=float(np.percentile(rt, 50) * 1e3), ack_rtt_p99_ms=float(np.percentile(rt, 99) * 1e3))


def generate(address, nodes_json, seconds, fatal_json, ramp_json, out, leaves_json="{}") -> int:
    result: dict = {}
    asyncio.run(_generate(address, json.loads(nodes_json), float(seconds), json.loads(fatal_json),
                          json.loads(ramp_json), result, json.loads(leaves_json)))
    Path(out).write_text(json.dumps(result))
    return 0


# -- the measurer ------------------------------------------------------------------------------------
def _proc(pid: int) -> tuple[float, int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) * 1024
    hwm = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024
    return cpu, rss, hwm


def children(pid: int) -> list[int]:
    """The process's children (the service's: its scoring worker, and its archive process with
    BENCH_ARCHIVE=1); none once it has gone."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _proc_tree_cpu(pid: int) -> tuple[float, int]:
    """CPU seconds and RSS of the service's child processes (the scoring worker, the archive process)."""
    cpu, rss = 0.0, 0
    for c in children(pid):
        try:
            c_cpu, c_rss, _ = _proc(c)
        except (OSError, StopIteration, ValueError):
            continue
        cpu += c_cpu
        rss += c_rss
    return cpu, rss


def _metrics(port: int, prefixes: list[str]) -> list[float]:
    out = [float("nan")] * len(prefixes)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            for i, prefix in enumerate(prefixes):
                if line.startswith(prefix + " "):
                    out[i] = float(line.rsplit(" ", 1)[1])
    return out


def _metric(port: int, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + (("{" + labels) if labels else "")) and not line.startswith("#"):
                if labels or line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
    return float("nan")


def wait_for_port_file(server: subprocess.Popen, port_file: Path, log: Path,
                       timeout: float = SERVICE_START_SECONDS) -> dict:
    """The service's ports, once it has written them; an error with its exit status and the end of its
    log if it exits first, or if it is still silent after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"the service exited with status {server.returncode} before serving:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the service wrote no {port_file.name} in {timeout:.0f} s")
        time.sleep(0.1)
    return json.loads(port_file.read_text())


def run_once(n_nodes: int, seconds: float, *, fatal_victims: int, ramp_victims: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-service-"))
    try:
        return _run_in(tmp, n_nodes, seconds, fatal_victims=fatal_victims, ramp_victims=ramp_victims)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def start_service(tmp: Path) -> tuple[subprocess.Popen, dict]:
    """A service on loopback with its state, model and log in `tmp`, and its ports once it serves; the
    service is stopped if it never does."""
    model = train_model(tmp / "model")
    port_file = tmp / "port.json"
    server_log = tmp / "serve.log"
    with open(server_log, "wb") as log_fh:
        server = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_service", "--serve", str(tmp / "state"),
                                   str(model), str(port_file)], stderr=log_fh)
    try:
        return server, wait_for_port_file(server, port_file, server_log)
    except BaseException:
        stop_processes([], server)
        raise


def start_generators(tmp: Path, address: str, nodes: list[str], seconds: float, fatal_at: dict[str, float],
                     ramp_nodes: list[str]) -> tuple[list[subprocess.Popen], list[Path]]:
    """Two load generator processes, half the nodes each, and the files they write their results to."""
    halves = [nodes[: len(nodes) // 2], nodes[len(nodes) // 2:]]
    outs = [tmp / f"gen{i}.json" for i in range(2)]
    nice = ["nice", "-n", str(GENERATOR_NICE)] if GENERATOR_NICE else []
    gens = [subprocess.Popen(nice + [sys.executable, "-m", "benchmarks.bench_service", "--generate", address,
                                     json.dumps(h), str(seconds),
                                     json.dumps({n: a for n, a in fatal_at.items() if n in h}),
                                     json.dumps([n for n in ramp_nodes if n in h]), str(o)])
            for h, o in zip(halves, outs)]
    return gens, outs


def stop_processes(gens: list[subprocess.Popen], server: subprocess.Popen) -> None:
    """The generators killed (still running only when the run failed), then the service stopped
    (stop_services)."""
    for g in gens:
        if g.poll() is None:
            g.kill()
            g.wait()
    stop_services([server])


def stop_services(procs: list[subprocess.Popen]) -> None:
    """As a supervisor stops them: SIGTERM, a kill past 30 s, and any scoring worker left behind."""
    workers = [pid for p in procs for pid in children(p.pid)]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def job_client(address: str, victims: list[str], spares: list[str], seconds: float):
    """One job per victim (so the per-job concurrency limit never holds a measurement back), each with
    a spare of its own, registered at `address` and watched: the directives' arrival times by node as
    they come, acknowledged COMPLETED; and the function that stops watching."""
    import grpc

    from foreshock.v1 import jobs_pb2 as pb
    from foreshock.v1 import jobs_pb2_grpc
    ch = grpc.insecure_channel(address)
    jobs = jobs_pb2_grpc.JobsStub(ch)
    received: dict[str, tuple[float, object]] = {}
    streams = []
    for i, victim in enumerate(victims):
        jid = f"job-{i:03d}"
        jobs.RegisterJob(pb.RegisterJobRequest(job_id=jid, ranks=[pb.RankPlacement(rank=0, node=victim)],
                                               spare_nodes=[spares[i]], current_step=1), timeout=10)
        stream = jobs.WatchDirectives(pb.WatchDirectivesRequest(job_id=jid, rank=0), timeout=seconds)

        def drain(stream=stream, jid=jid):
            try:
                for d in stream:
                    if d.from_node not in received and d.state == pb.DIRECTIVE_STATE_PENDING:
                        received[d.from_node] = (time.time(), d)
                        jobs.AckDirective(pb.AckDirectiveRequest(job_id=jid, directive_id=d.directive_id,
                                                                 rank=0, phase=pb.ACK_PHASE_COMPLETED), timeout=10)
            except grpc.RpcError:
                pass
        threading.Thread(target=drain, daemon=True).start()
        streams.append(stream)

    def close():
        for stream in streams:
            stream.cancel()
        ch.close()
    return received, close


def _run_in(tmp: Path, n_nodes: int, seconds: float, *, fatal_victims: int, ramp_victims: int) -> dict:
    gens: list[subprocess.Popen] = []
    server, ports = start_service(tmp)
    try:
        address = f"127.0.0.1:{ports['port']}"
        nodes = [f"node-{i:05d}" for i in range(n_nodes)]
        # Victims host one rank each of their own job (so the per-job concurrency limit never holds a
        # measurement back); each job has a spare of its own.
        fatal_nodes = nodes[:fatal_victims]
        ramp_nodes = nodes[fatal_victims:fatal_victims + ramp_victims]
        spares = nodes[-(fatal_victims + ramp_victims):]
        fatal_at = {n: 6.0 + 1.5 * i for i, n in enumerate(fatal_nodes)}
        received, close_jobs = job_client(address, fatal_nodes + ramp_nodes, spares, seconds + 120)
        gens, outs = start_generators(tmp, address, nodes, seconds, fatal_at, ramp_nodes)
        # Sample the service every second for the whole run; the steady window is from 15 s after the
        # first accepted batch (connection storm over) to 5 s before the generators stop sending.
        samples = []   # (time, accepted, backlog, cpu seconds, rss, hwm)
        while any(g.poll() is None for g in gens):
            try:
                # One scrape a sample (a real Prometheus scrapes every 15-30 s; each scrape renders every
                # node's risk, which costs the service itself).
                got = _metrics(ports["metrics"], ['foreshock_ingest_batches_total{result="accepted"}',
                                                  "foreshock_ingest_backlog_batches"])
                acc, blog = got[0], got[1]
            except OSError:
                acc = blog = float("nan")
            gen_cpu = 0.0
            for g in gens:
                try:
                    gen_cpu += _proc(g.pid)[0]
                except (OSError, StopIteration):
                    pass
            samples.append((time.time(), acc, blog, *_proc(server.pid), gen_cpu, _proc_tree_cpu(server.pid)))
            time.sleep(2.0)
        first = next((t for t, a, *_ in samples if a == a and a > 0), samples[0][0])
        window = [x for x in samples if first + 15 <= x[0] <= first + seconds - 5]
        if len(window) < 2:
            window = samples[len(samples) // 3: -2] or samples
        w0, acc0, _, cpu0, _, _, gcpu0, tree0 = window[0]
        w1, acc1, _, cpu1, rss, hwm, gcpu1, tree1 = window[-1]
        load = os.getloadavg()
        backlog = [x[2] for x in window]
        accepted_series = [x[1] for x in window]
        rounds = _metric(ports["metrics"], "foreshock_scoring_duration_seconds_count")
        round_sum = _metric(ports["metrics"], "foreshock_scoring_duration_seconds_sum")
        watermark_closes = _metric(ports["metrics"], "foreshock_scoring_watermark_closes_total")
        holds = _metrics(ports["metrics"], ["foreshock_ingest_close_holds_total",
                                            "foreshock_ingest_close_hold_expired_total",
                                            "foreshock_ingest_close_hold_seconds_total"])
        for g in gens:
            g.wait(seconds + 180)
        gen = [json.loads(o.read_text()) for o in outs]
        time.sleep(1.0)
        close_jobs()
        archive = _metrics(ports["metrics"], ["foreshock_archive_up", "foreshock_archive_files_total",
                                              "foreshock_archive_written_bytes_total",
                                              "foreshock_archive_dropped_bytes_total",
                                              "foreshock_archive_buffered_bytes"])
    finally:
        stop_processes(gens, server)
    files = sorted((tmp / "archive").rglob("*.parquet")) if (tmp / "archive").is_dir() else []
    fatal_lat, risk_complete, risk_own, risk_end, by_close = latencies(gen, received, ramp_nodes)
    return {
        "nodes": n_nodes, "window_s": w1 - w0,
        "accepted_series": accepted_series, "offered_per_s": n_nodes, "accepted_per_s": (acc1 - acc0) / (w1 - w0), "accepted_total": (acc0, acc1),
        "server_cpu_share_of_one_core": (cpu1 - cpu0) / (w1 - w0), "server_rss_mib": rss / 2**20,
        "worker_cpu_share_of_one_core": (tree1[0] - tree0[0]) / (w1 - w0), "worker_rss_mib": tree1[1] / 2**20,
        "gen_cpu_share_of_one_core": (gcpu1 - gcpu0) / (w1 - w0), "loadavg": load,
        "server_peak_rss_mib": hwm / 2**20, "backlog_first_last_max": (backlog[0], backlog[-1], max(backlog)) if backlog else None,
        "gen_sent": sum(g["sent"] for g in gen), "gen_acked": sum(g["acked"] for g in gen),
        "gen_rejected": sum(g["rejected"] for g in gen), "gen_reopened": sum(g.get("reopened", 0) for g in gen),
        "gen_inflight_tail": [g["inflight"][-3:] for g in gen],
        "ack_rtt_p50_ms": max(g["ack_rtt_p50_ms"] for g in gen), "ack_rtt_p99_ms": max(g["ack_rtt_p99_ms"] for g in gen),
        "stream_errors": sum(len(g.get("stream_errors", [])) for g in gen),
        "stream_error_kinds": sorted({e.split(": ", 1)[1][:70] for g in gen for e in g.get("stream_errors", [])})[:6],
        "fatal_latency_ms": sorted(x * 1e3 for x in fatal_lat), "fatal_expected": len(fatal_nodes),
        "risk_from_complete_ms": sorted(x * 1e3 for x in risk_complete),
        "risk_from_own_sample_ms": sorted(x * 1e3 for x in risk_own),
        "risk_from_step_end_ms": sorted(x * 1e3 for x in risk_end), "risk_expected": len(ramp_nodes),
        "risk_by_close_ms": [sorted(by_close[k]) for k in sorted(by_close)],
        "scoring_round_mean_ms": round_sum / rounds * 1e3 if rounds else float("nan"),
        "watermark_closes": watermark_closes,
        "close_holds": holds[0], "close_holds_expired": holds[1], "close_hold_seconds": holds[2],
        # before the stop (files written mid-run, buffered), and the files there after it
        "archive_up_files_bytes_dropped_buffered": archive,
        "archive_files_after_stop": [f.stat().st_size for f in files],
    }


def latencies(gen: list[dict], received: dict[str, tuple[float, object]], ramp_nodes: list[str]):
    """From the generators' results and the job client's (arrival time, directive) per node: the fatal
    latencies, and the risk latencies from the step's last sample (any node), from the crossing node's
    own last sample of the step, from the step's end, and those from the step's last sample per close
    (seconds)."""
    sent_at = {k: v for g in gen for k, v in g["fatal_sent"].items() if v is not None}
    fatal_lat = [received[n][0] - sent_at[n] for n in sent_at if n in received]
    step_last = {}
    for g in gen:
        for k, v in g.get("step_last_sent", {}).items():
            step_last[int(k)] = max(step_last.get(int(k), 0.0), v)
    ramp_sent = {n: v for g in gen for n, v in g.get("ramp_sent", {}).items()}
    risk_complete, risk_own, risk_end = [], [], []
    by_close: dict[int, list[float]] = {}
    for n in ramp_nodes:
        if n in received and ramp_sent.get(n):
            got, d = received[n]
            # The step that crossed: the last one whose last sample of this node went before the
            # directive came (the next step's last sample comes a minute later).
            sent = ramp_sent[n]
            lasts = [(ts, at) for (ts, at), (nts, _) in zip(sent, sent[1:] + [(1 << 62, 0.0)])
                     if ts // (60 * S) != nts // (60 * S) and at <= got]
            if not lasts:
                continue
            ts, at = lasts[-1]
            step = ts // (60 * S)
            risk_own.append(got - at)
            risk_complete.append(got - step_last.get(step, at))
            by_close.setdefault(step, []).append(risk_complete[-1] * 1e3)
            risk_end.append(got - (step + 1) * 60)
    return fatal_lat, risk_complete, risk_own, risk_end, by_close


def ingest_only(n: int = 1000) -> None:
    """The service's own per-batch cost, in-process, without gRPC: receipt, then the round's checks."""
    from foreshock.collectors.simulated import SimpleNodeModel
    from foreshock.collectors.uplink import encode_table, split_stream
    from foreshock.service.ingest import Ingest
    from foreshock.service.nodes import NodeBook
    from foreshock.v1 import telemetry_pb2 as tpb
    now = time.time_ns()
    raw = {False: [], True: []}
    for i in range(n):
        tables = SimpleNodeModel(f"n{i}", gpus=8, hcas=8, seed=i).sample(now)
        tables.pop("events", None)
        blobs = {k: encode_table(k, v) for k, v in tables.items()}
        for omitted in (False, True):
            raw[omitted].append(tpb.SweepBatch(node=f"n{i}", collector_id=f"c{i}", sequence=1, tables=[
                tpb.TableRows(table=k, schema_version=1, arrow_ipc=split_stream(v)[1] if omitted else v,
                              schema_omitted=omitted) for k, v in blobs.items()]).SerializeToString())
    sizes = {o: sum(map(len, raw[o])) / n / 1024 for o in raw}
    queue: list = []
    ing = Ingest(NodeBook(), lambda p: queue.append(p) or len(queue))
    sessions = [ing.open_session("bench", "") for _ in range(n)]
    figures = {}
    for seq, omitted in ((1, False), (2, False), (3, True), (4, True)):   # the first sweep learns the schemas
        t0 = time.perf_counter()
        for i, r in enumerate(raw[omitted]):
            b = tpb.SweepBatch.FromString(r)
            ack = ing.accept(sessions[i], b.node, b.collector_id, seq,
                             [(t.table, t.schema_version, t.arrow_ipc, t.schema_omitted) for t in b.tables])
            tpb.SweepAck(acked_sequence=ack.acked_sequence, credits=ack.credits).SerializeToString()
        t1 = time.perf_counter()
        ing.take_round(queue)
        queue.clear()
        t2 = time.perf_counter()
        figures[omitted] = ((t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6)
    for omitted, what in ((False, "whole schema every sweep"), (True, "schema once a stream")):
        print(f"in-process ({n} nodes, 8 GPUs / 8 HCAs each), {what} ({sizes[omitted]:.1f} KiB a sweep): receipt "
              f"{figures[omitted][0]:.0f} us a batch, round decode + value checks {figures[omitted][1]:.0f} us a batch")


def _pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def report(r: dict) -> None:
    print(f"nodes {r['nodes']}: offered {r['offered_per_s']:.0f} batches/s, accepted {r['accepted_per_s']:.0f}/s "
          f"over {r['window_s']:.0f} s (counter {r['accepted_total']}); scoring backlog first/last/max "
          f"{r['backlog_first_last_max']}")
    print(f"  accepted counter each second: {[int(x) for x in r['accepted_series']]}")
    print(f"  service CPU {100 * r['server_cpu_share_of_one_core']:.0f}% of one core (main process) + "
          f"{100 * r['worker_cpu_share_of_one_core']:.0f}% (child processes: scoring worker, archive); "
          f"RSS {r['server_rss_mib']:.0f} MiB (peak {r['server_peak_rss_mib']:.0f} MiB) + "
          f"{r['worker_rss_mib']:.0f} MiB (children); "
          f"scoring round mean {r['scoring_round_mean_ms']:.2f} ms")
    print(f"  load generator CPU {100 * r['gen_cpu_share_of_one_core']:.0f}% of one core (2 processes); "
          f"load average at the end {', '.join(f'{x:.1f}' for x in r['loadavg'])}")
    print(f"  generator sent {r['gen_sent']}, acked {r['gen_acked']}, rejected {r['gen_rejected']}, "
          f"stream errors {r['stream_errors']} {r['stream_error_kinds']} (streams reopened {r['gen_reopened']}); in flight at the end {r['gen_inflight_tail']}; "
          f"ack round trip p50 {r['ack_rtt_p50_ms']:.1f} ms p99 {r['ack_rtt_p99_ms']:.1f} ms")
    f = r["fatal_latency_ms"]
    print(f"  fatal (Xid 95) sample -> directive at the job client: {len(f)}/{r['fatal_expected']} received, "
          f"p50 {_pct(f, 50):.0f} ms, p99 {_pct(f, 99):.0f} ms, max {max(f) if f else float('nan'):.0f} ms")
    c, o, e = r["risk_from_complete_ms"], r["risk_from_own_sample_ms"], r["risk_from_step_end_ms"]
    print(f"  risk crossing -> directive: {len(c)}/{r['risk_expected']} received; from the arrival of the "
          f"step's last sample (any node: the step is complete) p50 {_pct(c, 50):.0f} ms p99 {_pct(c, 99):.0f} ms, "
          f"max {max(c) if c else float('nan'):.0f} ms; from the crossing node's own last sample of the step "
          f"p50 {_pct(o, 50):.0f} ms p99 {_pct(o, 99):.0f} ms; from the step's end p50 {_pct(e, 50):.0f} ms "
          f"p99 {_pct(e, 99):.0f} ms; steps closed on the watermarks {r['watermark_closes']:.0f}")
    closes = r.get("risk_by_close_ms") or []
    if closes:
        print("  risk per close (from the step's last sample): " + "; ".join(
            f"{len(x)} crossings, {min(x):.0f}-{max(x):.0f} ms" for x in closes))
    a = r.get("archive_up_files_bytes_dropped_buffered")
    if a and a[0] == a[0]:   # NaN: no archive
        sizes = r["archive_files_after_stop"]
        print(f"  archive: up {a[0]:.0f}, {a[1]:.0f} files ({a[2] / 2**20:.1f} MiB) written during the run, "
              f"{a[4] / 2**20:.1f} MiB buffered, {a[3]:.0f} bytes dropped; after the stop {len(sizes)} files, "
              f"{sum(sizes) / 2**20:.1f} MiB, largest {max(sizes, default=0) / 2**20:.1f} MiB")
    h = r["close_holds"]
    print(f"  streams held for closing rounds: {h:.0f} times, {r['close_holds_expired']:.0f} ran out, "
          f"{r['close_hold_seconds'] / h * 1e3 if h else float('nan'):.0f} ms on average")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--serve":
        return serve(*argv[1:4])
    if argv and argv[0] == "--generate":
        return generate(*argv[1:8])
    p = argparse.ArgumentParser(prog="bench service")
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=200.0,
                   help="200 s: three step closes with risk crossings in each (70 s: one)")
    p.add_argument("--probe", default="", help="comma-separated larger node counts for shorter runs")
    p.add_argument("--quick", action="store_true", help="256 nodes, 20 s (a smoke run)")
    p.add_argument("--ingest-only", action="store_true", help="only the in-process per-batch cost")
    args = p.parse_args(argv)
    print(f"# {os.cpu_count()} CPUs")
    ingest_only()
    if args.ingest_only:
        return 0
    if args.quick:
        args.nodes, args.seconds = 256, 20.0
    print("# service, load generator (2 processes) and job client share the CPUs")
    r = run_once(args.nodes, args.seconds, fatal_victims=20, ramp_victims=20 if args.seconds >= 70 else 0)
    report(r)
    for n in [int(x) for x in args.probe.split(",") if x]:
        report(run_once(n, 40.0, fatal_victims=10, ramp_victims=0))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
