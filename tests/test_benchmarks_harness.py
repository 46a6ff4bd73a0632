"""The benchmarks' own harness: the service benchmark waits for its service as long as it lives (not a
fixed 30 s), says why when it dies first, and leaves no temporary directory behind, whatever happens;
the soak's RSS reading and slopes."""

from __future__ import annotations

import math
import mmap
import os
import subprocess
import sys
import tempfile

import pytest

from benchmarks import bench_service, bench_soak


def _process(code: str, *args: str, stderr=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stderr=stderr)


def test_the_wait_ends_when_the_service_writes_its_ports(tmp_path):
    port_file = tmp_path / "port.json"
    server = _process("import pathlib, sys, time; time.sleep(0.3); "
                      "pathlib.Path(sys.argv[1]).write_text('{\"port\": 7, \"metrics\": 9}'); time.sleep(60)",
                      str(port_file))
    try:
        assert bench_service.wait_for_port_file(server, port_file, tmp_path / "serve.log") == {"port": 7, "metrics": 9}
    finally:
        server.kill()
        server.wait()


def test_a_service_that_dies_before_serving_is_an_error_with_its_status_and_log(tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "wb") as fh:
        server = _process("import sys; print('cannot load the model', file=sys.stderr); sys.exit(3)", stderr=fh)
    with pytest.raises(RuntimeError, match=r"status 3(.|\n)*cannot load the model"):
        bench_service.wait_for_port_file(server, tmp_path / "port.json", log)


def test_a_failed_run_leaves_no_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def no_model(out):
        (out.parent / "half-written").write_text("x")
        raise OSError("disk full")
    monkeypatch.setattr(bench_service, "train_model", no_model)
    with pytest.raises(OSError, match="disk full"):
        bench_service.run_once(4, 1.0, fatal_victims=0, ramp_victims=0)
    assert list(tmp_path.iterdir()) == []


def test_the_fault_and_fuzz_loops_find_nothing_wrong():
    """A few rounds of benchmarks/bench_faults.py's loops, so that they keep running (the full counts
    and their figures: docs/operations.md)."""
    from benchmarks import bench_faults
    sysfs = bench_faults.fuzz_sysfs(16, seed=1)
    assert sum(sysfs["tried"].values()) == 16 and sysfs["wrong"] == {}
    grpc_ = bench_faults.fuzz_grpc(2, seed=1)
    from foreshock.service.auth import PERMISSIONS
    assert grpc_["sent"] == 2 * (len(PERMISSIONS) + 1)   # every method, and the health check
    assert grpc_["unknown"] == 0 and grpc_["tracebacks"] == 0


def test_the_soak_reads_the_rss_of_a_process_and_nan_once_it_has_gone():
    before = bench_soak.rss_mib(os.getpid())[1]
    # pages new to the process, each written: a bytearray may be carved from free heap memory that is
    # already resident, which depends on what ran in this process before
    block = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_PRIVATE)   # private: shared pages are not RssAnon
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    assert bench_soak.rss_mib(os.getpid())[1] - before > 60
    block.close()
    gone = _process("pass")
    gone.wait()
    assert all(math.isnan(x) for x in bench_soak.rss_mib(gone.pid))


def test_the_soak_slope_is_mib_a_minute_and_the_second_half_sees_windows_that_filled():
    assert bench_soak.slope_per_minute([0, 60, 120], [100, 102, 104]) == pytest.approx(2.0)
    assert math.isnan(bench_soak.slope_per_minute([0], [1.0]))
    assert bench_soak.slope_per_minute([0, 60, 120, 180], [5, float("nan"), 5, 5]) == pytest.approx(0.0)
    # Before the feed (accepted 0) is left out; growth for 30 minutes, then flat.
    rows = [{"elapsed_s": -10.0, "accepted": 0, "service": 1.0}]
    rows += [{"elapsed_s": 60.0 * m, "accepted": m + 1, "service": 500.0 + 3 * min(m, 30)} for m in range(61)]
    (s,) = bench_soak.summarize(rows, ["service"], 3600.0)
    assert (s["start"], s["mid"], s["end"]) == (500.0, 590.0, 590.0)
    assert s["slope_late"] == pytest.approx(0.0, abs=1e-9) and s["slope_all"] > 1.0


def test_a_failed_soak_leaves_no_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def no_model(out):
        raise OSError("disk full")
    monkeypatch.setattr(bench_service, "train_model", no_model)
    with pytest.raises(OSError, match="disk full"):
        bench_soak.soak(4, 1.0, 1.0, None)
    assert list(tmp_path.iterdir()) == []
