"""deploy/grafana and deploy/prometheus query only metrics Foreshock really exports.

The names the code exports are read at run time: a real collector and a real control plane are started
and their /metrics endpoints scraped over HTTP (see `exported` below), and each metric family's type
gives the sample names Prometheus stores (`_total` for counters, `_bucket`/`_sum`/`_count` for
histograms, ...). Every metric name in every alerting/recording rule and every dashboard query must be
one of those, a recording rule of deploy/prometheus, or a series Prometheus itself synthesises (`up`,
`ALERTS`); the join rules alone also read node_exporter's and dcgm-exporter's series. Every dashboard query must also parse as PromQL: the queries are written into a rule file
(Grafana's variables replaced by values) and checked with `promtool check rules`. Last, a real
Prometheus runs deploy/prometheus's scrape configuration and rules against a real collector and a real
control plane, and the dashboard's collector queries are asked of it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import free_port

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "foreshock.json"
RULES = REPO / "deploy" / "prometheus" / "foreshock-rules.yaml"
# Series Prometheus writes itself, not scraped from a target.
PROMETHEUS_OWN = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                   "unless", "offset", "inf", "nan", "Inf", "NaN", "atan2"}
# Other exporters' series, read only by the rules of JOIN_GROUP (deploy/prometheus/foreshock-rules.yaml).
OTHER_EXPORTERS = {"node_uname_info": "node_exporter's uname collector",
                   "DCGM_FI_DEV_GPU_TEMP": "dcgm-exporter's default counters"}
JOIN_GROUP = "foreshock.joins"
# Grafana's built-in variables and the dashboard's own, replaced before promtool sees a query.
GRAFANA_VALUES = {"__rate_interval": "5m", "__interval": "1m", "__range": "6h", "node": ".*", "shard": ".*"}


# -- PromQL metric names ------------------------------------------------------------------------------
def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions, keywords or labels."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"\$\{[^}]*\}|\$\w+", "", s)                                   # Grafana variables
    s = re.sub(r"\{[^{}]*\}", "", s)                                          # label matchers
    s = re.sub(r"\[[^\[\]]*\]", "", s)                                        # ranges, subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)  # label lists
    names = set()
    for match in re.finditer(r"(?<![\w.:])[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        if s[match.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group(0) not in PROMQL_KEYWORDS:
            names.add(match.group(0))
    return names


@pytest.mark.parametrize("expr,names", [
    ('sum by (kind, outcome) (rate(foreshock_directives_total{outcome="failed"}[5m]))', {"foreshock_directives_total"}),
    ("histogram_quantile(0.99, sum by (le) (rate(x_seconds_bucket[$__rate_interval])))", {"x_seconds_bucket"}),
    ('a > on (node) group_left (leaf_switch) b{node=~"$node"} or vector(0)', {"a", "b"}),
    ("topk(20, risk) and on(node) sig offset 5m", {"risk", "sig"}),
    ('label_replace(up{job="x"}, "dst", "$1", "instance", "(.*):.*") == 0', {"up"}),
    ("node:foreshock_node_failure_risk:max5m > 1e3", {"node:foreshock_node_failure_risk:max5m"}),
    ("sum(rate(a[5m])) / (sum(rate(b[5m])) + sum(rate(a[5m])))", {"a", "b"}),
])
def test_metric_names_extracts_only_metrics(expr, names):
    assert metric_names(expr) == names


# -- what the rules and the dashboard use -------------------------------------------------------------
def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def recorded_names() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def rule_exprs(groups: set[str] | None = None) -> list[tuple[str, str]]:
    return [(r.get("alert") or r["record"], r["expr"]) for g in rule_groups() for r in g["rules"]
            if groups is None or g["name"] in groups]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out += all_panels(p.get("panels", []))
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    d = dashboard()
    exprs = [(f"{p['title']}/{t['refId']}", t["expr"]) for p in all_panels(d["panels"]) for t in p.get("targets", [])]
    for var in d["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["definition"])
            assert inner, var["definition"]
            exprs.append((f"variable {var['name']}", inner.group(1)))
    exprs += [(f"annotation {a['name']}", a["expr"]) for a in d["annotations"]["list"] if "expr" in a]
    return exprs


def grafana_to_promql(expr: str) -> str:
    def value(match: re.Match) -> str:
        name = (match.group(1) or match.group(2)).split(":")[0]
        assert name in GRAFANA_VALUES, f"unknown Grafana variable ${name} in {expr}"
        return GRAFANA_VALUES[name]
    return re.sub(r"\$\{([^}]*)\}|\$(\w+)", value, expr)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (run tests/setup.sh)")
def test_every_dashboard_query_is_valid_promql(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)}
        for i, (_, expr) in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({"groups": [{"name": "b", "rules": [{"record": "b:x", "expr": "sum by (a"}]}]}))
    assert subprocess.run(["promtool", "check", "rules", str(broken)], capture_output=True).returncode != 0


def test_dashboard_is_well_formed_and_covers_the_issue():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    panels = all_panels(d["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
    titles = {p["title"] for p in panels}
    for wanted in ("Risk level heatmap by node", "Risk level heatmap by leaf switch", "Top risky nodes",
                   "Top risky nodes: their signals", "Directives by kind and outcome", "Source success by node",
                   "Nodes taken out, held back, and the breaker's cap",
                   # issue 19: the sharded control plane
                   "Shards up", "Coordinators leading", "Nodes scored by shard", "Model by shard"):
        assert wanted in titles
    # Panels that break a figure down by shard take the shard's name from foreshock_shard_info, filtered
    # by the dashboard's shard variable; the shards' target labels name pods, not shards.
    shard_panels = [p for p in panels if p["type"] != "row"
                    and any("by (shard)" in t["expr"] or "by (le, shard)" in t["expr"] for t in p["targets"])]
    assert len(shard_panels) >= 3
    for p in shard_panels:
        assert any('shard=~"$shard"' in t["expr"] for t in p["targets"]), p["title"]
    assert variables["shard"]["definition"] == "label_values(foreshock_shard_info, shard)"


def _colour_steps(config: dict) -> list[tuple[str, float | None]] | None:
    thresholds = config.get("thresholds")
    return None if thresholds is None else [(st["color"], st["value"]) for st in thresholds["steps"]]


def test_risk_is_coloured_by_its_level_against_the_threshold_in_force():
    """Issue 22, item 1: no panel paints risk on a fixed probability scale (0.2 / 0.5 / 0.8 made an
    evacuated node at 0.6 % green); every risk colour is the level's bands (foreshock/risk.py), and the
    alert fires where the policy evacuates."""
    from foreshock import risk

    want = [("green", None), ("yellow", risk.WATCH_LEVEL), ("red", risk.EVACUATE_LEVEL)]
    coloured = 0
    for p in all_panels(dashboard()["panels"]):
        exprs = " ".join(t.get("expr", "") for t in p.get("targets", []))
        configs = [p.get("fieldConfig", {}).get("defaults", {})]
        configs += [{pr["id"]: pr["value"] for pr in o["properties"]}
                    for o in p.get("fieldConfig", {}).get("overrides", [])]
        for config in configs:
            steps = _colour_steps(config)
            if steps is None or not ("foreshock_node_failure_risk" in exprs or "foreshock_node_risk_level" in exprs):
                continue
            assert "foreshock_node_risk_level" in exprs and steps == want, (p["title"], steps)
            coloured += 1
    assert coloured >= 4
    alert = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                 if r.get("alert") == "ForeshockNodeRiskHigh")
    assert alert["expr"] == f"foreshock_node_risk_level >= {risk.EVACUATE_LEVEL:g}"


def test_the_risk_scale_in_words():
    from foreshock import risk

    assert risk.level(0.0062, 0.0039) == pytest.approx(1.59, abs=0.01)
    assert risk.band(risk.level(0.0062, 0.0039)) == "evacuate"
    assert risk.band(risk.level(0.0025, 0.0039)) == "watch" and risk.band(0.1) == "normal"
    assert risk.words(0.0062, 0.0039, 1800) == "0.62 % within 30 min, 1.6x the evacuation threshold (evacuate)"
    assert risk.words(0.0062, None, 1800) == "0.62 % within 30 min"
    assert risk.percent(0.00001) == "< 0.01 %" and risk.percent(0.25) == "25 %"
    assert risk.times(float("nan")) == "-" and risk.times(12.4) == "12x" and risk.times(1.04) == "1.0x"
    assert risk.times(0.42) == "0.42x"


# -- what the code exports ----------------------------------------------------------------------------
def sample_names(families) -> set[str]:
    """The series names Prometheus stores for prometheus-client metric families."""
    names = set()
    for family in families:
        n = family.name
        names |= {s.name for s in family.samples}
        names |= {"counter": {n + "_total", n + "_created"},
                  "histogram": {n + "_bucket", n + "_sum", n + "_count", n + "_created"},
                  "summary": {n, n + "_sum", n + "_count", n + "_created"},
                  "info": {n + "_info"},
                  "gaugehistogram": {n + "_bucket", n + "_gsum", n + "_gcount"}}.get(family.type, {n})
    return names


@contextlib.contextmanager
def running_exporters(procfs_fixture: Path, base: Path):
    """A real control plane (started on loopback, no model) and a real collector that swept the procfs
    fixture, flushed its Parquet and streams to that control plane through its real uplink."""
    import time

    from foreshock.collectors import command
    from foreshock.config import resolve
    from foreshock.service.actions import ActionSettings
    from foreshock.service.scoring import NullScorer
    from foreshock.service.server import Settings, build_server

    # Slurm drains on, so the node-action series exist. No node is due, so scontrol never runs: any
    # executable stands in for it where Slurm is not installed. The archive on, so its series exist.
    from foreshock.service.archive import ArchiveSettings

    plane = build_server(Settings.insecure_loopback(
        base / "state", scorer=NullScorer(), metrics_listen="127.0.0.1:0",
        actions=ActionSettings(slurm=True, scontrol=shutil.which("scontrol") or sys.executable),
        archive=ArchiveSettings(str(base / "archive"), fsync=False)))
    collector = None
    try:
        port = plane.start()
        cfg = resolve("collect", command.DEFAULTS, env={}, flags={
            "sources": ["rdma", "netdev", "host_net"], "sysfs": str(procfs_fixture / "sys"),
            "procfs": str(base), "node": "fixture", "out": str(base / "out"),
            "metrics_listen": "", "service": f"127.0.0.1:{port}"})
        collector = command.build_collector(cfg)
        collector.sweep_once()
        collector.flush()  # rows and bytes are counted when an interval's file is written
        deadline = time.monotonic() + 20
        while plane.ingest.connected() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        yield collector, plane
    finally:
        if collector is not None:
            collector.close()
            if collector.uplink is not None:
                collector.uplink.close(2.0)
        plane.stop(0)


def _scrape(port: int) -> set[str]:
    """Series names in what an HTTP GET of /metrics returns, as Prometheus scrapes it."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return sample_names(text_string_to_metric_families(resp.read().decode()))


@pytest.fixture(scope="module")
def exported(procfs_fixture, tmp_path_factory) -> dict[str, set[str]]:
    """Series names from a real scrape of the collector's and the control plane's /metrics endpoints."""
    from foreshock.collectors import metrics

    with running_exporters(procfs_fixture, tmp_path_factory.mktemp("exported")) as (collector, plane), \
            sharded_roles(tmp_path_factory.mktemp("sharded")) as (shard, coordinator):
        http, _thread = metrics.serve(collector, "127.0.0.1:0")
        try:
            got = {"collector": _scrape(http.server_port), "single": _scrape(plane.metrics_port),
                   "shard": _scrape(shard.metrics_port), "coordinator": _scrape(coordinator.metrics_port)}
        finally:
            http.shutdown()
            http.server_close()
    got["service"] = got["single"] | got["shard"] | got["coordinator"]
    return got


@contextlib.contextmanager
def sharded_roles(base: Path):
    """The control plane's two sharded roles, started on loopback: a jobs coordinator, and a shard of a
    two-shard map that forwards to it."""
    import time

    from foreshock.service import shardmap
    from foreshock.service.coordinator import CoordinatorSettings
    from foreshock.service.forwarder import ForwardSettings
    from foreshock.service.scoring import NullScorer
    from foreshock.service.server import Settings, build_server

    (base / "shards.toml").write_text('[shards.shard-0]\naddress = "127.0.0.1:1"\nleaves = ["leaf-a"]\n'
                                      '[shards.shard-1]\naddress = "127.0.0.1:2"\nleaves = ["leaf-b"]\n')
    coordinator = build_server(Settings.insecure_loopback(
        base / "coordinator", metrics_listen="127.0.0.1:0",
        coordinator=CoordinatorSettings(str(base / "lease"), lock_poll_seconds=0.05)))
    shard = None
    try:
        coordinator.start()
        deadline = time.monotonic() + 20
        while not coordinator.leading and time.monotonic() < deadline:
            time.sleep(0.05)
        shard = build_server(Settings.insecure_loopback(
            base / "shard", scorer=NullScorer(), metrics_listen="127.0.0.1:0", shard="shard-0",
            shard_map=shardmap.load(base / "shards.toml"),
            forward=ForwardSettings((coordinator.address,), "shard-0")))
        shard.start()
        yield shard, coordinator
    finally:
        if shard is not None:
            shard.stop(0)
        coordinator.stop(0)


def test_exported_names_come_from_both_components(exported):
    assert "foreshock_collector_source_success" in exported["collector"]
    assert "foreshock_collector_source_duration_seconds" in exported["collector"]
    assert "foreshock_node_failure_risk" in exported["service"]
    assert "foreshock_scoring_duration_seconds_bucket" in exported["service"]
    own = {n for n in exported["collector"] & exported["service"] if n.startswith("foreshock_")}
    assert not own, f"the two components' names overlap: {own}"


def test_both_components_export_the_standard_process_and_platform_metrics(exported):
    """process_*, python_info and python_gc_* on each /metrics scrape, as every Prometheus client's default
    registry exports them and the usual process dashboards and alerts expect."""
    for component in ("collector", "service"):
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                "process_start_time_seconds", "python_info", "python_gc_objects_collected_total",
                "python_gc_collections_total"} <= exported[component], component


def test_rules_use_only_exported_metrics(exported):
    """Foreshock's own rules and alerts read only what Foreshock exports; the join rules may read
    node_exporter's and dcgm-exporter's series too, and every one of those they are allowed is read."""
    known = exported["collector"] | exported["service"] | PROMETHEUS_OWN | recorded_names()
    own = {g["name"] for g in rule_groups()} - {JOIN_GROUP}
    for name, expr in rule_exprs(own):
        unknown = metric_names(expr) - known
        assert not unknown, f"rule {name} reads {sorted(unknown)}, which nothing exports"
    other = set()
    for name, expr in rule_exprs({JOIN_GROUP}):
        unknown = metric_names(expr) - known
        assert unknown <= set(OTHER_EXPORTERS), f"rule {name} reads {sorted(unknown)}, which nothing exports"
        other |= unknown
    assert other == set(OTHER_EXPORTERS), "an allowed series no join rule reads: drop it from OTHER_EXPORTERS"


def test_dashboard_uses_only_exported_metrics(exported):
    known = exported["collector"] | exported["service"] | PROMETHEUS_OWN | recorded_names()
    used = set()
    for where, expr in dashboard_exprs():
        names = metric_names(expr)
        used |= names
        unknown = names - known
        assert not unknown, f"dashboard {where} queries {sorted(unknown)}, which nothing exports"


@pytest.mark.parametrize("name, role", [("foreshock_shard_info", "shard"),
                                        ("foreshock_coordinator_leader", "coordinator"),
                                        ("foreshock_model_info", "shard")])
def test_the_sharded_roles_export_what_the_rules_read(name, role, exported):
    assert name in exported[role]


# -- a real Prometheus over the real exporters ----------------------------------------------------------
def _query(port: int, expr: str) -> list[dict]:
    import urllib.parse
    import urllib.request
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed (run tests/setup.sh)")
def test_rules_and_dashboard_on_a_real_prometheus(procfs_fixture, tmp_path):
    """deploy/prometheus/prometheus.yml and the rules, intervals shortened to 1 s, loaded by a real
    Prometheus that scrapes a real collector (procfs fixture, streaming to the control plane) and the real
    control plane: the scrape-time `node` label appears, the recording rules evaluate and are healthy,
    no Foreshock alert fires, and every dashboard query over collector metrics returns data."""
    from prometheus_client.parser import text_string_to_metric_families

    from foreshock.collectors import metrics

    with running_exporters(procfs_fixture, tmp_path) as (collector, plane):
        http, _thread = metrics.serve(collector, "127.0.0.1:0")
        try:
            _check_on_prometheus(tmp_path, http.server_port, plane.metrics_port,
                                 sample_names(text_string_to_metric_families(metrics.render(collector).decode())))
        finally:
            http.shutdown()


def _check_on_prometheus(tmp_path: Path, collector_port: int, serve_port: int, collector_names: set[str]) -> None:
    import time
    import urllib.request

    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "collectors.json").write_text(json.dumps([{"targets": [f"127.0.0.1:{collector_port}"]}]))
    config = yaml.safe_load((RULES.parent / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(tmp_path / "rules.yaml")]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["foreshock-serve"]["static_configs"] = [{"targets": [f"127.0.0.1:{serve_port}"]}]
    jobs["foreshock-collector"]["file_sd_configs"][0]["files"] = [str(tmp_path / "sd" / "*.json")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp_path / "prometheus.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 40
        ratio = []
        while time.monotonic() < deadline:
            try:
                ratio = _query(port, "foreshock:collector_source_success:ratio_avg5m")
                # rate() needs two samples in its range: wait for three scrapes of each job.
                if ratio and len(_query(port, 'count_over_time(up{job=~"foreshock-.*"}[1m]) >= 3')) == 2:
                    break
            except OSError:
                pass
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.5)
        assert ratio, "no recording-rule result in 40 s:\n" + log.read_text()[-2000:]
        assert {r["metric"]["node"] for r in ratio} == {"127.0.0.1"}, "the scrape-time node label"
        assert {r["metric"]["source"] for r in ratio} == {"rdma", "netdev", "host_net"}
        assert [float(r["value"][1]) for r in _query(port, "foreshock:collectors_up:count")] == [1.0]
        assert not _query(port, 'ALERTS{alertname=~"Foreshock.*"}'), "an alert fires on a healthy set-up"
        assert _query(port, "foreshock_evacuation_threshold"), "the control plane's series are scraped"
        checked = 0
        for where, expr in dashboard_exprs():
            names = metric_names(expr)
            # the sharded control plane's jobs are not scraped here (the test after this one has them)
            if names and names <= collector_names | {"up"} and not re.search("drop|error|foreshock-shard", expr):
                assert _query(port, grafana_to_promql(expr).replace("[5m]", "[1m]")), f"{where}: no data"
                checked += 1
        assert checked >= 5
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as resp:
            groups = json.load(resp)["data"]["groups"]
        assert all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# -- a real Prometheus over two running control planes, scraped as shards ------------------------------
SHARD_SCRAPE = RULES.parent / "prometheus-shards.yml"


@contextlib.contextmanager
def serve_processes(base: Path, count: int):
    """`count` real `foreshock serve --shard shard-I` processes on loopback (insecure, no model: what is
    checked here is what Prometheus makes of several targets, not the scores), shard-I owning leaf-I.
    Yields each one's (gRPC port, metrics port)."""
    import time

    shard_map = base / "shards.toml"
    shard_map.write_text("".join(f'[shards.shard-{i}]\naddress = "127.0.0.1:{i + 1}"\nleaves = ["leaf-{i}"]\n'
                                 for i in range(count)))
    procs, ports = [], []
    try:
        for i in range(count):
            log = base / f"serve-{i}.log"
            with open(log, "w") as out:
                procs.append((subprocess.Popen(
                    [sys.executable, "-m", "foreshock", "serve", "--insecure", "--no-model",
                     "--shard", f"shard-{i}", "--shard-map", str(shard_map),
                     "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--state", str(base / f"state-{i}")],
                    stdout=out, stderr=subprocess.STDOUT, env={**_clean_env(), "PYTHONUNBUFFERED": "1"}), log))
        deadline = time.monotonic() + 30
        for proc, log in procs:
            while not (m := re.search(r"listening on 127\.0\.0\.1:(\d+)(?: as shard \S+)?, metrics on 127\.0\.0\.1:(\d+)", log.read_text())):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)
            ports.append((int(m.group(1)), int(m.group(2))))
        yield ports
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait(timeout=30)


def _clean_env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith("FORESHOCK_")}


@contextlib.contextmanager
def collectors_on(procfs_fixture: Path, base: Path, service_port: int, nodes: list[str], leaf_switch: str):
    """Real collectors (procfs fixture) streaming to the control plane at `service_port`, one per node."""
    import time

    from foreshock.collectors import command
    from foreshock.config import resolve

    built = []
    try:
        for node in nodes:
            cfg = resolve("collect", command.DEFAULTS, env={}, flags={
                "sources": ["netdev"], "sysfs": str(procfs_fixture / "sys"), "procfs": str(base),
                "node": node, "out": str(base / f"out-{node}"), "metrics_listen": "",
                "service": f"127.0.0.1:{service_port}", "leaf_switch": leaf_switch})
            collector = command.build_collector(cfg)
            built.append(collector)
            collector.sweep_once()
        yield built
    finally:
        for collector in built:
            collector.close()
            if collector.uplink is not None:
                collector.uplink.close(2.0)


@pytest.mark.prometheus
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed (run tests/setup.sh)")
def test_shard_rules_aggregate_two_running_instances_on_a_real_prometheus(procfs_fixture, tmp_path):
    """Two real `foreshock serve --shard` processes scraped as the foreshock-shard job of
    deploy/prometheus/prometheus-shards.yml, with the rules loaded (intervals shortened to 1 s): `up` has
    both targets and the cross-shard recording rules are computed over both targets' series (one
    collector streams to the first, two to the second, and the cluster-wide sum is 3). Of Foreshock's
    alerts only "no coordinator leader" is pending, since shards run and no coordinator is scraped; the
    single control plane's "not scraped" alert stays quiet where shards run."""
    import time

    with serve_processes(tmp_path, 2) as ports, \
            collectors_on(procfs_fixture, tmp_path, ports[0][0], ["gpu-001"], "leaf-0"), \
            collectors_on(procfs_fixture, tmp_path, ports[1][0], ["gpu-101", "gpu-102"], "leaf-1"):
        rules = yaml.safe_load(RULES.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"
        (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
        config = yaml.safe_load(SHARD_SCRAPE.read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(tmp_path / "rules.yaml")]
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        targets = [f"127.0.0.1:{metrics}" for _, metrics in ports]
        jobs["foreshock-shard"]["static_configs"] = [{"targets": targets}]
        del jobs["foreshock-coordinator"]
        config["scrape_configs"] = list(jobs.values())
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = tmp_path / "prometheus.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 25
            total = []
            while time.monotonic() < deadline:
                try:
                    total = _query(port, "foreshock:connected_collectors:sum == 3")
                    # an alert group evaluated before the first scrapes sees no shard yet; wait for one after
                    others = _query(port, 'ALERTS{alertname=~"Foreshock.*", alertname!="ForeshockCoordinatorNoLeader"}')
                    if total and _query(port, "foreshock:shards_up:count == 2") and not others:
                        break
                except OSError:
                    pass
                assert proc.poll() is None, log.read_text()[-2000:]
                time.sleep(0.5)
            assert total, "no cross-shard sum of 3 in 25 s:\n" + \
                json.dumps(_query(port, 'foreshock_connected_collectors or up')) + log.read_text()[-2000:]
            up = _query(port, 'up{job="foreshock-shard"}')
            assert sorted(r["metric"]["instance"] for r in up) == sorted(targets)
            assert all(float(r["value"][1]) == 1 for r in up)
            per_target = {r["metric"]["instance"]: float(r["value"][1])
                          for r in _query(port, 'foreshock_connected_collectors{job="foreshock-shard"}')}
            assert per_target == {targets[0]: 1.0, targets[1]: 2.0}
            assert [float(r["value"][1]) for r in _query(port, "foreshock:shard_model_versions:count")] == [1.0]
            alerts = {(r["metric"]["alertname"], r["metric"]["alertstate"])
                      for r in _query(port, 'ALERTS{alertname=~"Foreshock.*"}')}
            assert alerts <= {("ForeshockCoordinatorNoLeader", "pending"), ("ForeshockCoordinatorNoLeader", "firing")}
            checked = 0
            for where, expr in dashboard_exprs():
                if 'job="foreshock-shard"' in expr:
                    # a rate needs two scrapes of its series: the first query may come after one
                    wait_until = time.monotonic() + 15
                    while not _query(port, grafana_to_promql(expr)) and time.monotonic() < wait_until:
                        time.sleep(0.5)
                    assert _query(port, grafana_to_promql(expr)), f"{where}: no data"
                    checked += 1
            assert checked >= 1
            import urllib.request
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as resp:
                groups = json.load(resp)["data"]["groups"]
            assert all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
        finally:
            proc.terminate()
            proc.wait(timeout=30)
