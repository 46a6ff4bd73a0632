"""The foundation: one import path per module, config precedence, the dataset writer, schema docs, stubs."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from foreshock import config, dataset, schema

REPO = Path(__file__).resolve().parents[1]


def _ts(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc)


# -- packaging -------------------------------------------------------------------------------------
def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found <= listed, f"packages not listed in pyproject.toml: {sorted(found - listed)}"


def test_wheel_puts_only_foreshock_in_site_packages(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), str(REPO)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("foreshock-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    tops = {t for t in tops if not t.endswith(".dist-info")}
    assert tops == {"foreshock"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "foreshock/collectors/__init__.py" in names
    assert "foreshock/v1/jobs_pb2_grpc.py" in names


def test_generated_stubs_match_the_proto_sources(tmp_path):
    protos = sorted(str(p.relative_to(REPO / "proto")) for p in (REPO / "proto").rglob("*.proto"))
    out = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO / 'proto'}",
                          f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                          f"--grpc_python_out={tmp_path}", *protos], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc generated nothing"
    for rel in generated:
        committed = REPO / rel
        assert committed.exists(), f"{rel} is generated but not committed (run make proto)"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} differs: run make proto"


# -- configuration ---------------------------------------------------------------------------------
DEFAULTS = {"interval": 1.0, "node": "", "sources": ["rdma", "netdev"], "once": False, "port": 9400}


def test_config_precedence_defaults_file_env_flags():
    file_data = {"collect": {"interval": 5, "node": "from-file", "port": 9500}}
    env = {"FORESHOCK_COLLECT_NODE": "from-env", "FORESHOCK_COLLECT_SOURCES": "kmsg, nvml",
           "FORESHOCK_OTHER_NODE": "ignored"}
    got = config.resolve("collect", DEFAULTS, file_data=file_data, env=env, flags={"port": 9600, "once": None})
    assert got == {"interval": 5.0, "node": "from-env", "sources": ["kmsg", "nvml"], "once": False, "port": 9600}


@pytest.mark.parametrize("file_data, env, needle", [
    ({"collect": {"intervl": 1}}, {}, "intervl"),
    ({"collect": {"interval": "fast"}}, {}, "interval"),
    ({}, {"FORESHOCK_COLLECT_ONCE": "maybe"}, "FORESHOCK_COLLECT_ONCE"),
    ({"collect": 3}, {}, "[collect]"),
])
def test_config_errors_name_the_key(file_data, env, needle):
    with pytest.raises(config.ConfigError, match=None) as info:
        config.resolve("collect", DEFAULTS, file_data=file_data, env=env)
    assert needle in str(info.value)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("nan"), float("inf")])
def test_config_refuses_non_finite_floats_from_every_origin(value):
    for file_data, env in (({"collect": {"interval": value}}, {}), ({}, {"FORESHOCK_COLLECT_INTERVAL": str(value)})):
        with pytest.raises(config.ConfigError, match="interval.*finite"):
            config.resolve("collect", DEFAULTS, file_data=file_data, env=env)


def test_config_checks_name_the_key_its_origin_and_the_range():
    checks = {"interval": config.above(0), "port": config.between(1, 65535)}
    assert config.resolve("collect", DEFAULTS, env={}, checks=checks)["port"] == 9400
    with pytest.raises(config.ConfigError, match=r"interval from environment variable FORESHOCK_COLLECT_INTERVAL: "
                                                 r"must be > 0, got -1\.0"):
        config.resolve("collect", DEFAULTS, env={"FORESHOCK_COLLECT_INTERVAL": "-1"}, checks=checks)
    with pytest.raises(config.ConfigError, match=r"port from flag --port: must be in \[1, 65535\], got 0"):
        config.resolve("collect", DEFAULTS, env={}, flags={"port": 0}, checks=checks)
    with pytest.raises(config.ConfigError, match="port from the config file"):
        config.resolve("collect", DEFAULTS, file_data={"collect": {"port": 70000}}, env={}, checks=checks)


def test_config_refuses_unknown_sections_and_variables():
    commands = ("collect", "serve")
    config.check_file({"collect": {}, "serve": {}}, commands)
    with pytest.raises(config.ConfigError, match=r"\[colect\].*unknown section"):
        config.check_file({"colect": {"interval": 5}}, commands)
    config.check_environment(commands, {"FORESHOCK_COLLECT_INTERVAL": "5", "FORESHOCK_CONFIG": "f.toml",
                                        "FORESHOCK_STORE": "h:1", "FORESHOCK_SERVICE": "h:2", "PATH": "/bin"})
    with pytest.raises(config.ConfigError, match="FORESHOCK_COLECT_INTERVAL"):
        config.check_environment(commands, {"FORESHOCK_COLECT_INTERVAL": "5"})
    with pytest.raises(config.ConfigError, match="FORESHOCK_COLLECT_INTERVL"):
        config.resolve("collect", DEFAULTS, env={"FORESHOCK_COLLECT_INTERVL": "5"})


def test_every_foreshock_variable_the_code_reads_is_declared():
    """OTHER_VARIABLES is the one list of FORESHOCK_* names that are no command's settings: each name the
    code reads is a command's setting or in it, so check_environment never refuses one the project sets."""
    import re
    commands = ("collect", "simulate", "train", "evaluate", "serve", "goodput", "demo")
    names = set()
    for folder in ("foreshock", "collectors", "service", "migrator", "predictor", "simulator", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            names |= set(re.findall(r"[\"'](FORESHOCK_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    assert "FORESHOCK_STORE" in names and "FORESHOCK_PREDICT_THREADS" in names
    config.check_environment(commands, dict.fromkeys(names, ""))


def test_cli_refuses_bad_config_before_doing_anything(tmp_path, monkeypatch, capsys):
    from foreshock import cli
    out = tmp_path / "out"
    base = {k: v for k, v in os.environ.items() if not k.startswith("FORESHOCK_")}
    for env, toml, needle in (
            ({"FORESHOCK_COLLECT_INTERVAL": "nan"}, "", "FORESHOCK_COLLECT_INTERVAL"),
            ({"FORESHOCK_COLLECT_ROTATE_SECONDS": "-5"}, "", "rotate_seconds"),
            ({}, "[collect]\nspool_max_bytes = -1\n", "spool_max_bytes"),
            ({}, "[collect]\nmax_buffer_rows = 0\n", "max_buffer_rows"),
            ({}, "[colect]\ninterval = 5\n", "[colect]"),
            ({"FORESHOCK_COLLECTOR_INTERVAL": "5"}, "", "FORESHOCK_COLLECTOR_INTERVAL")):
        monkeypatch.setattr(os, "environ", {**base, **env})
        cfg = tmp_path / "f.toml"
        cfg.write_text(toml)
        rc = cli.main(["--config", str(cfg), "collect", "--once", "--sources", "kmsg", "--kmsg", str(cfg),
                       "--out", str(out)])
        assert rc == 2 and needle in capsys.readouterr().err
        assert not out.exists()


@pytest.mark.parametrize("key, value", [("max_concurrent", "0"), ("max_concurrent", "-1"),
                                        ("score_interval", "nan"), ("score_interval", "0"),
                                        ("cooldown_seconds", "-1"), ("threshold", "1.5"), ("grace", "-1"),
                                        ("grace", "1e12"), ("grace", "nan")])
def test_serve_settings_are_range_checked(key, value):
    from foreshock.service import command
    with pytest.raises(config.ConfigError, match=key):
        config.resolve("serve", command.DEFAULTS, env={f"FORESHOCK_SERVE_{key.upper()}": value},
                       checks=command.CHECKS)


@pytest.mark.parametrize("field, value", [("default_max_concurrent", 0), ("default_max_concurrent", -1),
                                          ("cooldown_seconds", -1.0), ("sustain_seconds", float("nan"))])
def test_policy_settings_refuse_values_that_would_never_or_always_act(field, value):
    from foreshock.service.policy import PolicySettings
    with pytest.raises(ValueError, match=field):
        PolicySettings(**{field: value})


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("interval = = 1")
    with pytest.raises(config.ConfigError, match="bad.toml"):
        config.load_file(bad)
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load_file(tmp_path / "missing.toml")


# -- schema ----------------------------------------------------------------------------------------
def test_schema_doc_is_generated_from_the_code():
    doc = (REPO / "docs" / "schema.md").read_text()
    assert schema.markdown() in doc, "docs/schema.md is stale: regenerate its reference section"


def test_conform_refuses_unknown_columns_and_nulls_in_keys():
    t = pa.table({"ts": pa.array([0], pa.timestamp("ns", tz="UTC")), "node": ["a"], "gpu": [0],
                  "gpu_lost": [False], "bogus": [1]})
    with pytest.raises(schema.SchemaError, match="bogus"):
        schema.conform("gpu", t)
    t = pa.table({"ts": pa.array([0], pa.timestamp("ns", tz="UTC")), "node": [None], "gpu": [0],
                  "gpu_lost": [False]})
    with pytest.raises(schema.SchemaError, match="'node' must not be null"):
        schema.conform("gpu", t)
    with pytest.raises(schema.SchemaError, match="unknown table"):
        schema.schema("gpus")


def test_missing_values_stay_null_not_zero():
    t = schema.to_table("gpu", [{"ts": _ts(0), "node": "n", "gpu": 0, "gpu_lost": False}])
    assert t.column("ecc_corrected_volatile").null_count == 1
    assert t.column("temperature_c")[0].as_py() is None


# -- the dataset writer ----------------------------------------------------------------------------
def _gpu_rows(node: str, start: float, n: int) -> list[dict]:
    return [{"ts": _ts(start + i), "node": node, "gpu": i % 8, "gpu_lost": False,
             "ecc_corrected_volatile": i} for i in range(n)]


def test_writer_partitions_by_table_date_node_and_reads_back(tmp_path):
    w = dataset.DatasetWriter(tmp_path, fsync=False)
    midnight = dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc).timestamp()
    w.append_rows("gpu", _gpu_rows("node-a", midnight - 5, 10) + _gpu_rows("node/b", midnight, 3))
    files = w.flush()
    rel = sorted(str(f.parent.relative_to(tmp_path)) for f in files)
    assert rel == ["table=gpu/date=2026-12-01/node=node-a", "table=gpu/date=2026-12-02/node=node%2Fb",
                   "table=gpu/date=2026-12-02/node=node-a"]
    assert dataset.list_nodes(tmp_path, "gpu") == ["node-a", "node/b"]
    back = dataset.read_table(tmp_path, "gpu", nodes=["node-a"])
    assert back.num_rows == 10 and back.schema.equals(schema.schema("gpu"), check_metadata=False)
    assert back.column("ecc_corrected_volatile").to_pylist() == list(range(10))
    assert pq.read_metadata(files[0]).row_group(0).column(0).compression == "ZSTD"


def test_writer_rotates_by_time_and_never_leaves_partial_files(tmp_path):
    now = [1000.0]
    w = dataset.DatasetWriter(tmp_path, rotate_seconds=300, fsync=False, clock=lambda: now[0])
    w.append_rows("gpu", _gpu_rows("n", 1_700_000_000, 5))
    assert not w.maybe_rotate()
    assert dataset.partition_files(tmp_path, "gpu") == []  # the open interval is only in memory
    now[0] += 301
    assert w.maybe_rotate()
    assert len(dataset.partition_files(tmp_path, "gpu")) == 1
    assert not list(tmp_path.rglob(".*.tmp"))


def test_writer_bad_rows_lose_only_their_table(tmp_path, caplog):
    w = dataset.DatasetWriter(tmp_path, fsync=False)
    w.append_rows("gpu", [{"ts": _ts(0), "node": "n", "gpu": "not-an-int", "gpu_lost": False}])
    w.append_rows("netdev", [{"ts": _ts(0), "node": "n", "iface": "eth0", "mtu": 1500}])
    w.flush()
    assert w.stats.write_errors == 1
    assert "gpu" in caplog.text
    assert dataset.read_table(tmp_path, "netdev").num_rows == 1


def test_writer_buffer_is_bounded(tmp_path):
    w = dataset.DatasetWriter(tmp_path, max_buffer_rows=100, fsync=False)
    for i in range(5):
        w.append_rows("gpu", _gpu_rows("n", 1_700_000_000 + i * 50, 50))
    assert w.buffered_rows() < 100
    assert dataset.read_table(tmp_path, "gpu").num_rows + w.buffered_rows() == 250


def test_spool_drops_oldest_closed_files_and_counts(tmp_path):
    w = dataset.DatasetWriter(tmp_path, fsync=False, max_bytes=40_000)
    for i in range(20):
        w.append_rows("gpu", _gpu_rows("n", 1_700_000_000 + i * 100, 50))
        w.flush()
    assert w.stats.files_dropped > 0
    assert 0 < w.spool_bytes <= 40_000
    remaining = dataset.partition_files(tmp_path, "gpu")
    firsts = sorted(int(p.name.split("-")[1]) for p in remaining)
    assert firsts[0] > 1_700_000_000 * 10**9  # the oldest went first
    # A new writer over the same spool sees what is there and keeps the bound.
    w2 = dataset.DatasetWriter(tmp_path, fsync=False, max_bytes=40_000)
    assert w2.spool_bytes == sum(p.stat().st_size for p in remaining)


_KILLED_WRITER = """
import datetime as dt, os, signal, sys
from foreshock import dataset
w = dataset.DatasetWriter(sys.argv[1], rotate_seconds=300, fsync=True)
for k in range(int(sys.argv[2])):
    w.append_rows("gpu", [{"ts": dt.datetime.fromtimestamp(1_700_000_000 + k, dt.timezone.utc), "node": "n",
                           "gpu": g, "gpu_lost": False, "ecc_corrected_volatile": k} for g in range(8)])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_writer_loses_nothing_it_appended(tmp_path):
    """kill -9 with the whole interval open (rotate_seconds 300): the next writer replays the journal."""
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), "25"], timeout=120)
    assert proc.returncode == -9
    assert dataset.partition_files(tmp_path, "gpu") == []   # nothing had been written as Parquet
    w = dataset.DatasetWriter(tmp_path, fsync=False)
    assert w.stats.rows_recovered == 200
    back = dataset.read_table(tmp_path, "gpu")
    assert back.num_rows == 200 and sorted(set(back.column("ecc_corrected_volatile").to_pylist())) == list(range(25))
    assert list((tmp_path / dataset.JOURNAL_DIR).iterdir()) == []
    assert dataset.DatasetWriter(tmp_path, fsync=False).stats.rows_recovered == 0   # replayed once


def test_a_torn_journal_keeps_its_whole_batches(tmp_path):
    w = dataset.DatasetWriter(tmp_path, fsync=False)
    for i in range(3):
        w.append_rows("gpu", _gpu_rows("n", 1_700_000_000 + 10 * i, 4))
    (journal,) = (tmp_path / dataset.JOURNAL_DIR).iterdir()
    torn = journal.read_bytes() + b"\xff\xff\xff\xff\x00\x01"   # a kill in the middle of the next batch
    w._journals["gpu"].close()                                           # the process is gone
    journal.write_bytes(torn)
    again = dataset.DatasetWriter(tmp_path, fsync=False)
    assert again.stats.rows_recovered == 12 and dataset.read_table(tmp_path, "gpu").num_rows == 12


def test_a_crash_after_writing_before_removing_the_journal_writes_nothing_twice(tmp_path):
    w = dataset.DatasetWriter(tmp_path, fsync=False)
    midnight = dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc).timestamp()
    w.append_rows("gpu", _gpu_rows("a", midnight - 3, 6) + _gpu_rows("b", midnight, 2))  # three partitions
    (journal,) = (tmp_path / dataset.JOURNAL_DIR).iterdir()
    kept = journal.read_bytes()
    files = w.flush()
    assert len(files) == 3 and not journal.exists()
    missing = pq.read_metadata(files[1]).num_rows
    files[1].unlink()                    # the crash: one partition not yet renamed, the journal still there
    journal.write_bytes(kept)
    again = dataset.DatasetWriter(tmp_path, fsync=False)
    assert again.stats.rows_recovered == missing
    assert sorted(p.name for p in dataset.partition_files(tmp_path, "gpu")) == sorted(p.name for p in files)
    assert dataset.read_table(tmp_path, "gpu").num_rows == 8


def test_a_live_writers_journal_is_not_replayed_by_another(tmp_path):
    w1 = dataset.DatasetWriter(tmp_path, fsync=False)
    w1.append_rows("gpu", _gpu_rows("n", 1_700_000_000, 5))
    w2 = dataset.DatasetWriter(tmp_path, fsync=False)
    assert w2.stats.rows_recovered == 0 and dataset.partition_files(tmp_path, "gpu") == []
    w1.flush()
    assert dataset.read_table(tmp_path, "gpu").num_rows == 5
    assert list((tmp_path / dataset.JOURNAL_DIR).iterdir()) == []


def test_leftover_temp_files_are_removed_on_start(tmp_path):
    d = dataset.partition_dir(tmp_path, "gpu", "2026-12-02", "n")
    d.mkdir(parents=True)
    (d / ".part-1-x-000001.parquet.tmp").write_bytes(b"PAR1 half written")
    dataset.DatasetWriter(tmp_path, fsync=False)
    assert not list(d.iterdir())


@pytest.mark.parametrize("command", [
    ["simulate", "--nodes", "4", "--days", "0.01", "--out"],
    ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "", "--insecure", "--state"]])
def test_an_output_folder_that_cannot_be_made_is_one_line_naming_it(command, tmp_path, capsys):
    from foreshock import cli
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "sub"
    assert cli.main([*command, str(target)]) == 2
    err = capsys.readouterr().err
    assert str(target) in err and "Traceback" not in err, err


@pytest.mark.parametrize("where", ["before", "after"])
def test_config_and_log_level_are_read_before_or_after_the_subcommand(where, tmp_path, capsys):
    from foreshock import cli
    cfg = tmp_path / "f.toml"
    cfg.write_text("[goodput]\nno_such_key = 1\n")
    opts = ["--config", str(cfg), "--log-level", "WARNING"]
    argv = [*opts, "goodput"] if where == "before" else ["goodput", *opts]
    assert cli.main(argv) == 2                       # the file was read: its unknown key is refused
    assert "no_such_key" in capsys.readouterr().err
    args = cli.build_parser().parse_args(argv)
    assert args.config == str(cfg) and args.log_level == "WARNING"
    assert cli.build_parser().parse_args(["goodput"]).log_level == "INFO"


@pytest.mark.parametrize("address, loopback", [
    ("localhost:7443", True), ("127.0.0.1:7443", True), ("127.8.9.1:1", True), ("[::1]:7443", True),
    ("localhost", True), ("0.0.0.0:7443", False), ("10.0.0.5:7443", False), ("[2001:db8::1]:7443", False),
    ("control-plane.example:7443", False), ("", False)])
def test_one_loopback_rule_for_every_channel_and_listener(address, loopback):
    from foreshock.net import is_loopback

    assert is_loopback(address) is loopback


def test_one_threshold_rule_for_a_budget_from_a_manifest():
    from foreshock.risk import threshold_for_budget

    curve = [[0.001, 9.0, 0.9], [0.004, 1.5, 0.6], [0.01, 0.0, 0.3]]
    man = {"threshold_curves": {"model": curve}, "thresholds": {"2.0": 0.5}, "recommended_threshold": 0.004,
           "budget": 2.0}
    # the curve decides over the table: the lowest threshold within the budget
    assert threshold_for_budget(man, 2.0) == 0.004 and threshold_for_budget(man, 10.0) == 0.001
    assert threshold_for_budget(man, 0.5) == 0.01 and threshold_for_budget(man) == 0.004
    # a table alone: the loosest threshold whose budget is within the one asked, else the strictest
    table = {"thresholds": {"1.0": 0.02, "2.0": 0.01, "5.0": 0.005}}
    assert threshold_for_budget(table, 3.0) == 0.01 and threshold_for_budget(table, 0.1) == 0.02
    assert threshold_for_budget({}, 2.0) is None and threshold_for_budget({"recommended_threshold": 0.3}, 2.0) == 0.3
