"""The executors of offline feature building (predictor/executors.py): a real local Ray cluster, started
by the test on loopback with `ray start --head`, gives the same features, model and evaluation as the
local process pool, bit for bit; a node partition that keeps failing is named; a Ray address that
does not answer is refused within its deadline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from foreshock import cli
from foreshock.dataset import read_table
from foreshock.predictor import executors, offline, registry, train
from support import free_port

ray = pytest.importorskip("ray", reason="Ray is the optional extra foreshock[ray] (make installs it)")
RAY = Path(sys.executable).with_name("ray")


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head` on loopback with 2 CPUs; yields HOST:PORT; `ray stop` at the end."""
    port = free_port()
    # Ray's AF_UNIX sockets live under its temp dir, and a socket path may not pass 107 bytes: beneath
    # pytest's temp dir (a level deeper per pytest-xdist worker) Ray's session and socket names leave too
    # little room.
    tmp = tempfile.mkdtemp(prefix="fs-ray-")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [str(RAY), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
           "--include-dashboard", "false", "--temp-dir", tmp, "--disable-usage-stats"]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        os.environ.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([str(RAY), "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def data(small_world):
    return small_world


def _features(data, **kw) -> dict[str, np.ndarray]:
    with offline.FeatureBuilder(data, **kw) as fb:
        return {nf.node: (nf.steps, nf.X) for nf in fb}


def test_ray_builds_the_same_features_as_the_process_pool_and_in_process(data, ray_head):
    serial = _features(data, workers=1)
    pool = _features(data, workers=2)
    on_ray = _features(data, workers=2, executor="ray", ray_address=ray_head)
    # a URI: the Ray tasks get the dataset's filesystem pickled and read through it
    on_ray_uri = _features(f"file://{data}", workers=2, executor="ray", ray_address=ray_head)
    assert list(serial) == list(pool) == list(on_ray) == list(on_ray_uri)
    for node in serial:
        for other in (pool, on_ray, on_ray_uri):
            assert np.array_equal(serial[node][0], other[node][0])
            assert np.array_equal(serial[node][1], other[node][1], equal_nan=True), node


def test_train_and_evaluate_on_ray_give_the_local_model_and_figures(data, small_world_model, ray_head, tmp_path,
                                                                    capsys):
    local_dir, local = small_world_model
    on_ray = train.train(data, tmp_path / "ray", max_iter=15, executor="ray", ray_address=ray_head)
    assert on_ray["thresholds"] == local["thresholds"]
    assert on_ray["threshold_curves"] == local["threshold_curves"]
    # the same figures (json: NaN compares equal as text)
    assert json.dumps(on_ray["metrics"], sort_keys=True) == json.dumps(local["metrics"], sort_keys=True)
    a, b = registry.load_model(local_dir), registry.load_model(tmp_path / "ray")
    X = np.random.default_rng(0).normal(size=(64, len(a.feature_names))).astype(np.float32)
    assert np.array_equal(a.probability(X), b.probability(X))
    reports = []
    for extra in ([], ["--executor", "ray", "--ray-address", ray_head]):
        js = tmp_path / f"e{len(reports)}.json"
        rc = cli.main(["evaluate", "--data", str(data), "--model", str(local_dir), "--json", str(js),
                       *extra])
        assert rc == 0, capsys.readouterr().err
        reports.append(json.loads(js.read_text()))
    assert json.dumps(reports[0], sort_keys=True) == json.dumps(reports[1], sort_keys=True)


def test_a_node_partition_that_keeps_failing_is_named_after_ray_retries_it(data, ray_head, tmp_path, capsys):
    broken = tmp_path / "broken"
    victim = _broken_copy(data, broken)
    rc = cli.main(["evaluate", "--data", str(broken), "--executor", "ray", "--ray-address", ray_head])
    err = capsys.readouterr().err
    assert rc == 1
    assert "node partition node-003" in err and str(victim) in err


def test_a_ray_address_that_does_not_answer_is_refused_within_its_deadline(data, capsys):
    port = free_port()      # nothing listens there
    rc = cli.main(["evaluate", "--data", str(data), "--executor", "ray", "--ray-address", f"127.0.0.1:{port}"])
    assert rc == 2
    assert (f"the Ray cluster at 127.0.0.1:{port} does not answer within {executors.RAY_CONNECT_TIMEOUT_S:g} s"
            in capsys.readouterr().err)
    with pytest.raises(executors.ExecutorError, match="expected HOST:PORT"):
        executors.RayExecutor(1, "ray://somewhere")


def _broken_copy(data, dest):
    shutil.copytree(data, dest)
    victim = sorted((dest / "table=gpu").rglob("node=node-003/*.parquet"))[0]
    victim.write_bytes(b"PAR1 not a parquet file")
    return victim


def test_a_corrupt_file_stops_the_command_naming_it_or_is_left_out_by_the_flag(data, tmp_path, capsys):
    broken = tmp_path / "broken"
    victim = _broken_copy(data, broken)
    rc = cli.main(["evaluate", "--data", str(broken)])
    err = capsys.readouterr().err
    assert rc == 1 and "node partition node-003" in err and str(victim) in err
    js = tmp_path / "e.json"
    rc = cli.main(["evaluate", "--data", str(broken), "--on-corrupt", "skip", "--json", str(js)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "WARNING: node node-003 left out (--on-corrupt skip)" in err and str(victim) in err
    rep = json.loads(js.read_text())
    assert list(rep["skipped_partitions"]) == ["node-003"] and rep["nodes"] == 11
    # the rest is judged as without the broken node: its steps are simply not there
    with offline.FeatureBuilder(broken, workers=2, on_error="skip") as fb:
        nodes = [nf.node for nf in fb]
        assert "node-003" not in nodes and len(nodes) == 11 and list(fb.skipped) == ["node-003"]


def test_simulate_on_ray_writes_the_same_data_as_the_local_pool(ray_head, tmp_path):
    args = ["simulate", "--world", "random", "--nodes", "12", "--days", "0.25", "--interval", "60", "--seed", "8",
            "--rate-scale", "400", "--block-nodes", "4"]
    assert cli.main(args + ["--workers", "2", "--out", str(tmp_path / "local")]) == 0
    assert cli.main(args + ["--executor", "ray", "--ray-address", ray_head, "--out", str(tmp_path / "ray")]) == 0
    for table in ("gpu", "rdma_port", "events", "inventory", "incidents"):
        a = read_table(tmp_path / "local", table)
        b = read_table(tmp_path / "ray", table)
        assert a.num_rows == b.num_rows and a.equals(b), table
    assert not list((tmp_path / "ray").rglob(".*.tmp"))
