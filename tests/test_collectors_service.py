"""The collector as a library and a service: `collect --once` golden, /metrics (promtool), SIGTERM flush,
bounded spool, source isolation, the uplink contract, configuration."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pytest

from foreshock import cli
from foreshock import schema as sch
from foreshock.collectors import command, metrics
from foreshock.collectors.base import Source
from foreshock.collectors.collector import Collector
from foreshock.collectors.rdma import RdmaSource
from foreshock.collectors.simulated import SimulatedSource
from foreshock.dataset import DatasetWriter, read_table
from support import free_port, stop_stuck_script

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
TS = 1_780_000_000_000_000_000


def _jsonable(v):
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float):
        return round(v, 6)
    return v


def dataset_rows(root) -> dict[str, list[dict]]:
    out = {}
    for d in sorted(Path(root).glob("table=*")):
        name = d.name.split("=", 1)[1]
        t = read_table(root, name).drop_columns(["ts"])
        rows = [{k: _jsonable(v) for k, v in r.items()} for r in t.to_pylist()]
        out[name] = sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))
    return out


@pytest.mark.parametrize("where", ["shared", "examples"])
def test_collect_once_over_the_fixture_matches_the_golden(procfs_fixture, xid_lines, tmp_path, capsys, where):
    """The fixture of ../shared, and its copy in examples/ that the README's collect example reads
    (issue 22: the example ran only where ../shared sits beside the clone)."""
    if where == "examples":
        procfs_fixture, xid_lines = REPO / "examples" / "procfs", REPO / "examples" / "kmsg" / "xid-lines.txt"
        readme = (REPO / "README.md").read_text()
        assert "--sysfs examples/procfs/sys --kmsg examples/kmsg/xid-lines.txt" in readme
    out = tmp_path / "ds"
    (tmp_path / "proc").mkdir()   # the fixture has no procfs tree: host_net reports itself absent
    rc = cli.main(["collect", "--once", "--sources", "rdma,netdev,host_net,kmsg", "--sysfs",
                   str(procfs_fixture / "sys"), "--procfs", str(tmp_path / "proc"), "--kmsg",
                   str(xid_lines), "--node", "fixture-node", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "rdma_port       4 rows" in printed and "source host_net   absent" in printed
    assert "events         10 rows" in printed
    got = dataset_rows(out)
    golden = GOLDEN / "collectors_once_fixture.json"
    if os.environ.get("FORESHOCK_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(got, indent=1, sort_keys=True, default=str) + "\n")
    assert got == json.loads(golden.read_text())
    assert not list(out.rglob(".*.tmp"))


def test_metrics_families_from_the_snapshot_pass_promtool(procfs_fixture, tmp_path):
    writer = DatasetWriter(tmp_path / "ds", fsync=False)
    class AbsentRdma(RdmaSource):
        name = "rdma_absent"

    col = Collector("m", [RdmaSource("m", sysfs=str(procfs_fixture / "sys")), SimulatedSource("m", gpus=2, hcas=1),
                          AbsentRdma("m", sysfs=str(tmp_path))], writer)
    col.sweep_once(TS)
    col.flush()
    text = metrics.render(col).decode()
    assert 'foreshock_collector_source_success{source="rdma"} 1.0' in text
    assert 'foreshock_collector_source_absent{source="rdma_absent"} 1.0' in text
    assert 'foreshock_collector_rows_written_total{table="rdma_port"} 5.0' in text
    assert 'foreshock_collector_source_duration_seconds{source="simulated"}' in text
    assert "foreshock_collector_bytes_written_total" in text and "foreshock_collector_files_dropped_total 0.0" in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: tests/setup.sh installs Debian's prometheus package")
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_metrics_endpoint_serves_http(tmp_path):
    col = Collector("h", [SimulatedSource("h", gpus=1, hcas=1)], DatasetWriter(tmp_path, fsync=False))
    col.sweep_once(TS)
    server, _thread = metrics.serve(col, "127.0.0.1:0")
    try:
        port = server.server_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert "foreshock_collector_sweeps_total 1.0" in body


def _sweeps_done(port: int) -> int:
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return 0
    line = [ln for ln in body.splitlines() if ln.startswith("foreshock_collector_sweeps_total ")]
    return int(float(line[0].split()[1])) if line else 0


def _wait_for_sweeps(proc, port: int, n: int) -> int:
    """Wait (60 s at most) until the collector's metrics count n sweeps; the count it reached."""
    deadline, seen = time.time() + 60, 0
    while time.time() < deadline and seen < n:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
        seen = _sweeps_done(port)
    assert seen >= n
    return seen


def test_sigterm_flushes_everything(procfs_fixture, tmp_path):
    out = tmp_path / "ds"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "foreshock", "collect", "--sources", "simulated,rdma", "--sysfs",
         str(procfs_fixture / "sys"), "--interval", "0.05", "--rotate-seconds", "3600", "--metrics-listen",
         f"127.0.0.1:{port}", "--node", "term", "--out", str(out), "--sim-gpus", "2", "--sim-hcas", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = _wait_for_sweeps(proc, port, 5)
        assert not list(out.rglob("*.parquet"))  # nothing closed yet: every row is in the open interval
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    gpu, rdma = read_table(out, "gpu"), read_table(out, "rdma_port")
    sweeps = gpu.num_rows // 2
    assert sweeps >= seen and gpu.num_rows == 2 * sweeps
    assert rdma.num_rows == 5 * sweeps  # 4 fixture ports + 1 simulated HCA, every sweep complete
    assert len(set(rdma.column("ts").to_pylist())) == sweeps
    assert not list(out.rglob(".*.tmp")) and "flushing" in err


_STUCK_AT_CLOSE = """
import logging, sys, time
from foreshock.collectors import command
from foreshock.collectors.base import Source
from foreshock.collectors.collector import Collector
from foreshock.collectors.simulated import SimulatedSource
from foreshock.dataset import DatasetWriter

class Wedged(Source):
    name = "wedged"          # NVML's shutdown on a wedged GPU can block like this
    def sweep(self, ts_ns):
        print("swept", flush=True)
        return {}
    def close(self):
        time.sleep(3600)

logging.basicConfig(level=logging.INFO)
command.SHUTDOWN_SECONDS = float(sys.argv[2])
col = Collector("n1", [SimulatedSource("n1", gpus=1, hcas=1), Wedged("n1")], DatasetWriter(sys.argv[1], fsync=False))
sys.exit(command.serve_forever(col, {"metrics_listen": "", "interval": 0.05, "out": sys.argv[1]}))
"""


def test_a_stop_that_overruns_its_bound_writes_the_stacks_and_exits_1(tmp_path):
    """A source that never lets go at close: the collector's rows are flushed first, then, past
    SHUTDOWN_SECONDS, every thread's stack names where it hangs and the process exits 1 on its own."""
    rc, err, took = stop_stuck_script(_STUCK_AT_CLOSE, str(tmp_path / "ds"), "1.5",
                                      ready=lambda ln: ln.strip() == "swept")
    assert rc == 1, err
    assert "within 1.5 s, or the threads' stacks are written here" in err and "Timeout (0:00:01" in err
    assert "in close" in err and "in serve_forever" in err
    assert 1.5 <= took < 30
    assert read_table(tmp_path / "ds", "gpu").num_rows >= 1   # flushed before the sources were released


def test_sigkill_loses_no_sweep_the_metrics_counted(procfs_fixture, tmp_path):
    """kill -9 with the default-length interval open: the next start replays the journal, so every sweep
    counted before the kill is in the dataset (issue 23: 300 s of sweeps were lost)."""
    out = tmp_path / "ds"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "foreshock", "collect", "--sources", "simulated", "--interval", "0.05",
         "--rotate-seconds", "300", "--metrics-listen", f"127.0.0.1:{port}", "--node", "kill", "--out", str(out),
         "--sim-gpus", "2", "--sim-hcas", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = _wait_for_sweeps(proc, port, 5)
    finally:
        proc.kill()
        proc.communicate()
    assert not list(out.rglob("*.parquet"))
    rc = subprocess.run([sys.executable, "-m", "foreshock", "collect", "--once", "--sources", "simulated",
                         "--node", "kill", "--out", str(out), "--sim-gpus", "2", "--sim-hcas", "1"],
                        capture_output=True, text=True, timeout=120)
    assert rc.returncode == 0, rc.stderr
    gpu = read_table(out, "gpu")
    assert gpu.num_rows // 2 >= seen + 1   # every sweep the killed collector counted, and the --once one


def test_spool_drops_the_oldest_files_and_sampling_goes_on(tmp_path):
    writer = DatasetWriter(tmp_path, rotate_seconds=0, max_bytes=200_000, fsync=False)
    col = Collector("s", [SimulatedSource("s", gpus=8, hcas=8)], writer)
    for k in range(12):
        col.sweep_once(TS + k * 10**9)
    snap = col.snapshot()
    assert snap.sweeps == 12 and snap.files_dropped > 0 and snap.spool_bytes <= 200_000
    assert f"foreshock_collector_files_dropped_total {float(snap.files_dropped)}" in metrics.render(col).decode()
    ts = read_table(tmp_path, "gpu").column("ts").to_pylist()
    assert max(ts).value == TS + 11 * 10**9  # the newest survive
    assert min(ts).value > TS  # the oldest were dropped


class Exploding(Source):
    name = "exploding"

    def sweep(self, ts_ns):
        raise RuntimeError("boom")


class BadModel:
    node = "bad"

    def sample(self, ts_ns):
        good = sch.to_table("host_net", [{"ts": ts_ns, "node": "bad", "Tcp_OutSegs": 1}])
        bad = pa.table({"ts": pa.array([ts_ns], pa.int64()).cast(sch.TS), "node": ["bad"], "gpu": ["zero"]})
        return {"host_net": good, "gpu": bad}


def test_a_failing_source_or_bad_table_does_not_stop_the_sweep(tmp_path):
    writer = DatasetWriter(tmp_path, fsync=False)
    class Simulated2(SimulatedSource):
        name = "simulated2"

    col = Collector("i", [Exploding("i"), SimulatedSource("i", node_model=BadModel()),
                          Simulated2("i", gpus=1, hcas=1)], writer)
    tables = col.sweep_once(TS)
    snap = col.snapshot()
    assert snap.sources["exploding"].success is False and snap.sources["exploding"].errors == 1
    assert snap.rejected_tables == 1 and tables["gpu"].num_rows == 1  # the bad gpu batch refused whole
    assert tables["host_net"].num_rows == 2 and snap.sources["simulated"].success
    col.flush()
    assert read_table(tmp_path, "host_net").num_rows == 2 and read_table(tmp_path, "gpu").num_rows == 1


class FakeUplink:
    def __init__(self, accept=True):
        self.batches, self.accept = [], accept

    def submit(self, tables):
        self.batches.append(tables)
        return self.accept

    def stats(self):
        return {"connected": False, "queued": 3, "dropped_oldest": 2, "acked": 0}


def test_uplink_gets_each_sweeps_tables_once(tmp_path):
    up = FakeUplink(accept=False)
    col = Collector("u", [SimulatedSource("u", gpus=2, hcas=2)], DatasetWriter(tmp_path, fsync=False), uplink=up)
    col.sweep_once(TS)
    col.sweep_once(TS + 10**9)
    assert len(up.batches) == 2 and set(up.batches[0]) == {"gpu", "nvlink", "rdma_port", "netdev", "host_net"}
    assert up.batches[1]["gpu"].column("ts").to_pylist()[0].value == TS + 10**9
    assert col.snapshot().uplink_refused == 2
    text = metrics.render(col).decode()
    assert "foreshock_collector_uplink_dropped_sweeps_total 2.0" in text
    assert 'foreshock_collector_uplink_batches_total{result="refused"} 2.0' in text
    lint = subprocess.run([shutil.which("promtool") or "promtool", "check", "metrics"], input=text,
                          capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    col.flush()
    assert read_table(tmp_path, "gpu").num_rows == 4  # a refusing uplink never costs local Parquet


def test_service_flag_without_the_uplink_module_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "foreshock.collectors.uplink", None)
    cfg = dict(command.DEFAULTS, service="cp:7000", out=str(tmp_path), sources=["simulated"], node="x")
    with pytest.raises((SystemExit, ImportError)) as exc:
        command.build_collector(cfg)
    assert "uplink" in str(exc.value)


def test_settings_resolve_file_env_and_flags(monkeypatch):
    monkeypatch.setenv("FORESHOCK_COLLECT_INTERVAL", "5")
    args = cli.build_parser().parse_args(["collect", "--sources", "rdma,netdev"])
    cfg = command._settings(args, {"collect": {"interval": 2.0, "node": "from-file", "peers": ["a:1"]}})
    assert cfg["interval"] == 5.0 and cfg["node"] == "from-file" and cfg["sources"] == ["rdma", "netdev"]
    assert cfg["peers"] == ["a:1"]


def test_an_interval_longer_than_the_predictors_step_is_refused(tmp_path, capsys):
    """Sampled less than once per feature step, a node's windowed counts read low (docs/predictor.md,
    "Telemetry interval"): the collector refuses such an interval, naming it, and writes nothing."""
    assert cli.main(["collect", "--once", "--sources", "netdev", "--interval", "120", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "interval from flag --interval: must be > 0 and <= 60" in err
    assert not any(tmp_path.iterdir())


def test_unknown_source_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["collect", "--once", "--sources", "rdma,gpu_magic", "--out", str(tmp_path)]) == 2
    assert "gpu_magic" in capsys.readouterr().err


def test_a_named_path_that_does_not_exist_is_a_clear_error(tmp_path, capsys):
    """--sysfs, --procfs or --kmsg the operator named and mistyped: exit 2 naming it, nothing written;
    the defaults missing (a machine without that hardware) stay an empty sweep."""
    for flag, source in (("--sysfs", "rdma"), ("--procfs", "host_net"), ("--kmsg", "kmsg")):
        missing = tmp_path / "nope" / flag.strip("-")
        rc = cli.main(["collect", "--once", "--sources", source, flag, str(missing), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert rc == 2 and str(missing) in err, err
    assert not (tmp_path / "out").exists()


def test_two_sources_of_one_kind_are_reported_apart(procfs_fixture, tmp_path):
    col = Collector("d", [RdmaSource("d", sysfs=str(procfs_fixture / "sys")), RdmaSource("d", sysfs=str(tmp_path))],
                    DatasetWriter(tmp_path / "ds", fsync=False))
    tables = col.sweep_once(TS)
    snap = col.snapshot()
    assert set(snap.sources) == {"rdma", "rdma#2"} and snap.sources["rdma#2"].absent
    assert snap.sources["rdma"].rows == 4 and tables["rdma_port"].num_rows == 4


def test_service_flag_builds_the_real_streaming_uplink(tmp_path):
    pytest.importorskip("foreshock.collectors.uplink")
    cfg = dict(command.DEFAULTS, service="127.0.0.1:9", out=str(tmp_path), sources=["simulated"], node="up",
               sim_gpus=1, sim_hcas=1, fsync=False)
    col = command.build_collector(cfg)
    try:
        col.sweep_once(TS)
        snap = col.snapshot()
        assert type(col.uplink).__name__ == "StreamingUplink" and snap.uplink_submitted == 1
        assert snap.uplink.get("submitted") == 1  # queued without waiting on the (absent) control plane
    finally:
        col.uplink.close(1.0)
        col.close()
    with pytest.raises(ValueError, match="mutual TLS"):
        command.build_collector(dict(cfg, tls_cert="c.pem"))


def test_sweeps_the_uplink_could_not_deliver_at_close_are_counted_and_said(caplog):
    import logging

    from foreshock.collectors.uplink import StreamingUplink

    port = free_port()     # a port nobody listens on: the stream never connects
    up = StreamingUplink(f"127.0.0.1:{port}", node="n1", backoff_initial=0.1).start()
    inv = sch.to_table("inventory", [{"ts": 0, "node": "n1"}])
    for _ in range(3):
        assert up.submit({"inventory": inv})
    with caplog.at_level(logging.WARNING, logger="foreshock.collectors.uplink"):
        up.close(0.2)
    assert up.stats()["unsent_at_close"] == 3 and up.stats()["queued"] == 3
    assert "3 sweep(s) not delivered" in caplog.text and "Parquet spool" in caplog.text
