"""The example configuration in deploy/ is real configuration: each TOML file (deploy/systemd/foreshock.toml,
the ConfigMaps of deploy/kubernetes) resolves through `foreshock collect`'s and `foreshock serve`'s own
settings resolution (foreshock/config.py with each command's defaults), and its paths and ports agree
with the units and manifests that use it. The systemd example also drives a real `foreshock collect
--once` over the procfs fixture, with only the hardware paths overridden by flags.
"""

from __future__ import annotations

import configparser
import importlib
import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from foreshock import cli
from foreshock.config import ConfigError, resolve

REPO = Path(__file__).resolve().parents[1]
SYSTEMD = REPO / "deploy" / "systemd"
KUBE = REPO / "deploy" / "kubernetes"
COMMANDS = {"collect": "foreshock.collectors.command", "serve": "foreshock.service.command"}


def command_module(section: str):
    try:
        return importlib.import_module(COMMANDS[section])
    except ModuleNotFoundError as exc:
        if exc.name == COMMANDS[section]:
            pytest.xfail(f"{COMMANDS[section]} does not exist yet: `foreshock {section}` cannot resolve [{section}]")
        raise


def settings(section: str, file_data: dict) -> dict:
    """[section] resolved exactly as `foreshock <section>` resolves it, with no flags and no FORESHOCK_*
    environment (the command's own `_settings(args, file_data)` where it has one)."""
    module = command_module(section)
    args = cli.build_parser().parse_args([section])
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("FORESHOCK_")}
    try:
        if hasattr(module, "_settings"):
            return module._settings(args, file_data)
        return resolve(section, module.DEFAULTS, file_data=file_data, checks=getattr(module, "CHECKS", None))
    finally:
        os.environ.update(saved)


def configmap_toml(name: str, root: Path = KUBE) -> dict:
    doc = yaml.safe_load((root / name).read_text())
    return tomllib.loads(doc["data"]["foreshock.toml"])


def pod(name: str) -> dict:
    return yaml.safe_load((KUBE / name).read_text())["spec"]["template"]["spec"]


def mounts(pod_spec: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in pod_spec["containers"][0]["volumeMounts"]}


def port_of(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def unit(name: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("="))
    parser.optionxform = str
    parser.read_string((SYSTEMD / name).read_text())
    return parser["Service"]


SYSTEMD_TOML = tomllib.loads((SYSTEMD / "foreshock.toml").read_text())
SOURCES = {
    ("systemd", "collect"): SYSTEMD_TOML,
    ("systemd", "serve"): SYSTEMD_TOML,
    ("kubernetes", "collect"): configmap_toml("collector-configmap.yaml"),
    ("kubernetes", "serve"): configmap_toml("serve-configmap.yaml"),
}


@pytest.mark.parametrize("where,section", sorted(SOURCES))
def test_example_resolves_through_the_real_command(where, section):
    data = SOURCES[(where, section)]
    assert section in data, f"the {where} example has no [{section}]"
    resolved = settings(section, data)
    for key, value in data[section].items():
        assert resolved[key] == value, f"[{section}] {key}: {value!r} resolved to {resolved[key]!r}"


@pytest.mark.parametrize("section", sorted(COMMANDS))
def test_a_misspelt_key_is_refused(section):
    data = {section: {**SYSTEMD_TOML[section], "intervall": 1}}
    with pytest.raises(ConfigError, match="intervall"):
        settings(section, data)


@pytest.mark.parametrize("path", ["deploy/systemd/collect.env", "deploy/systemd/serve.env",
                                  "deploy/kubernetes/collector-daemonset.yaml",
                                  "deploy/kubernetes/serve-statefulset.yaml"])
def test_environment_variables_name_real_keys(path):
    text = (REPO / path).read_text()
    names = re.findall(r"\bFORESHOCK_(COLLECT|SERVE)_([A-Z0-9_]+)", text)
    for section, key in names:
        defaults = command_module(section.lower()).DEFAULTS
        assert key.lower() in defaults, f"{path}: FORESHOCK_{section}_{key} is no setting of [{section.lower()}]"


def test_kubernetes_collector_paths_and_port_match_the_daemonset():
    cfg = settings("collect", SOURCES[("kubernetes", "collect")])
    spec = pod("collector-daemonset.yaml")
    where = mounts(spec)
    assert cfg["sysfs"] == where["host-sys"] and cfg["out"] == where["spool"] and cfg["kmsg"] == where["kmsg"]
    assert Path(cfg["tls_ca"]).parent == Path(cfg["token_file"]).parent == Path(where["credentials"])
    ports = {p["name"]: p["containerPort"] for p in spec["containers"][0]["ports"]}
    assert port_of(cfg["metrics_listen"]) == ports["metrics"]
    assert cfg["service"] == "foreshock-serve.foreshock.svc:%d" % next(
        p["port"] for p in yaml.safe_load((KUBE / "serve-service.yaml").read_text())["spec"]["ports"]
        if p["name"] == "grpc")


def test_systemd_collector_paths_match_the_unit():
    cfg = settings("collect", SYSTEMD_TOML)
    service = unit("foreshock-collect.service")
    assert cfg["out"] == "/var/lib/" + service["StateDirectory"]
    credential = service["LoadCredential"].split(":")[0]
    assert cfg["token_file"] == f"/run/credentials/foreshock-collect.service/{credential}"
    assert port_of(cfg["metrics_listen"]) == port_of(settings("collect", SOURCES[("kubernetes", "collect")])["metrics_listen"])


def test_systemd_example_drives_a_real_collect_once(procfs_fixture, tmp_path, capsys):
    """The example config as an operator would run it by hand, hardware paths pointed at the fixture."""
    command_module("collect")
    config = tmp_path / "foreshock.toml"
    config.write_text((SYSTEMD / "foreshock.toml").read_text())
    (tmp_path / "proc").mkdir()   # the fixture has no procfs tree
    rc = cli.main(["--config", str(config), "collect", "--once", "--sources", "rdma,netdev,host_net",
                   "--sysfs", str(procfs_fixture / "sys"), "--procfs", str(tmp_path / "proc"),
                   "--node", "deploy-example", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "source rdma" in out and "FAILED" not in out, out
    assert list((tmp_path / "out").rglob("*.parquet")), "the sweep wrote no Parquet"


def test_kubernetes_serve_paths_and_ports_match_the_statefulset():
    cfg = settings("serve", SOURCES[("kubernetes", "serve")])
    spec = pod("serve-statefulset.yaml")
    where = mounts(spec)
    assert cfg["state"] == where["state"]
    assert Path(cfg["tls_cert"]).parent == Path(cfg["tls_key"]).parent == Path(where["tls"])
    assert Path(cfg["token_file"]).parent == Path(where["tokens"])
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert secrets["tls"] == "foreshock-serve-tls"  # kubernetes.io/tls: tls.crt and tls.key
    assert {Path(cfg["tls_cert"]).name, Path(cfg["tls_key"]).name} == {"tls.crt", "tls.key"}
    ports = {p["name"]: p["containerPort"] for p in spec["containers"][0]["ports"]}
    assert port_of(cfg["listen"]) == ports["grpc"] and port_of(cfg["metrics_listen"]) == ports["metrics"]
    assert not cfg["insecure"] and not cfg["tls_client_ca"]


def test_systemd_serve_paths_match_the_unit():
    cfg = settings("serve", SYSTEMD_TOML)
    text = (SYSTEMD / "foreshock-serve.service").read_text()
    credentials = dict(re.findall(r"^LoadCredential=([^:]+):(\S+)$", text, re.M))
    for key in ("tls_cert", "tls_key", "token_file"):
        directory, _, name = cfg[key].rpartition("/")
        assert directory == "/run/credentials/foreshock-serve.service" and name in credentials, key
    service = unit("foreshock-serve.service")
    assert cfg["state"] == "/var/lib/" + service["StateDirectory"]


SHARDED = REPO / "deploy" / "kubernetes-sharded"
# What deploy/ leaves between a process's own stop bound (past it, every thread's stack is written and it
# exits 1) and the init system's SIGKILL: time to write the stacks and exit on a loaded node, so that a
# stuck stop leaves its trace rather than racing the kill.
KILL_HEADROOM_SECONDS = 5.0


def _stop_and_kill(where: str, name: str) -> tuple[float, float]:
    """(the process's stop bound, seconds deploy/ gives it from SIGTERM to SIGKILL) for one deployed
    long-running process: a systemd unit or the pod of a Kubernetes workload, with the settings it runs."""
    collect = importlib.import_module(COMMANDS["collect"])
    serve = importlib.import_module(COMMANDS["serve"])
    section = "collect" if "collect" in name else "serve"
    if where == "systemd":
        kill = float(unit(name)["TimeoutStopSec"])
        cfg = settings(section, SYSTEMD_TOML)
    else:
        root = KUBE if where == "kubernetes" else SHARDED
        (workload,) = [d for d in yaml.safe_load_all((root / name).read_text()) if d]
        kill = float(workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
        configmap = {"collector-daemonset.yaml": "collector-configmap.yaml", "serve-statefulset.yaml":
                     "serve-configmap.yaml", "shard-statefulset.yaml": "shard-configmap.yaml",
                     "coordinator-deployment.yaml": "coordinator-configmap.yaml"}[name]
        env = {"FORESHOCK_SERVE_SHARD": "shard-0"} if name.startswith("shard") else {}
        module = collect if section == "collect" else serve
        cfg = resolve(section, module.DEFAULTS, file_data=configmap_toml(configmap, root), env=env,
                      checks=getattr(module, "CHECKS", None))
    bound = collect.SHUTDOWN_SECONDS if section == "collect" else serve.stop_bound_seconds(cfg)
    return bound, kill


@pytest.mark.parametrize("where,name", [
    ("systemd", "foreshock-collect.service"), ("systemd", "foreshock-serve.service"),
    ("kubernetes", "collector-daemonset.yaml"), ("kubernetes", "serve-statefulset.yaml"),
    ("kubernetes-sharded", "shard-statefulset.yaml"), ("kubernetes-sharded", "coordinator-deployment.yaml")])
def test_a_stuck_stop_writes_its_stacks_before_the_kill(where, name):
    """Every long-running process deploy/ starts bounds its own stop (the collector by SHUTDOWN_SECONDS,
    serve by its grace plus STOP_SECONDS_AFTER_GRACE) at least KILL_HEADROOM_SECONDS before the init
    system's SIGKILL, with the settings deploy/ gives it: a grace raised in a settings file without the
    kill's timeout fails here."""
    bound, kill = _stop_and_kill(where, name)
    assert bound + KILL_HEADROOM_SECONDS <= kill, (
        f"{where}/{name}: the stop is bounded at {bound:g} s and the kill comes at {kill:g} s; raise the kill's "
        f"timeout to at least {bound + KILL_HEADROOM_SECONDS:g} s or lower the grace")


@pytest.mark.parametrize("where", ["systemd", "kubernetes"])
def test_serve_example_starts_a_real_tls_server(where, tmp_path):
    """The [serve] example, secrets and addresses pointed at this test's files, serves TLS and /metrics."""
    import shutil
    import subprocess
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    module = command_module("serve")
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make a certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", "tls.key", "-out", "tls.crt", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=60)
    (tmp_path / "tokens").write_text("collector:gpu-001 0123456789abcdef0123\noperator ops-0123456789abcdef\n")
    cfg = resolve("serve", module.DEFAULTS, file_data=SOURCES[(where, "serve")], env={}, flags={
        "tls_cert": str(tmp_path / "tls.crt"), "tls_key": str(tmp_path / "tls.key"),
        "token_file": str(tmp_path / "tokens"), "state": str(tmp_path / "state"),
        "listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "no_model": True})
    from foreshock.service.server import build_server
    plane = build_server(module.settings_from(cfg))
    try:
        port = plane.start()
        credentials = grpc.ssl_channel_credentials((tmp_path / "tls.crt").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(f"http://127.0.0.1:{plane.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert "foreshock_evacuation_threshold" in text and "foreshock_node_failure_risk" in text
    finally:
        plane.stop(0)


@pytest.mark.parametrize("where", ["foreshock-collect.service", "foreshock-serve.service",
                                   "collector-daemonset.yaml", "serve-statefulset.yaml"])
def test_the_command_lines_parse_with_the_real_cli(where):
    if where.endswith(".service"):
        exec_start = unit(where)["ExecStart"].split()
        assert exec_start[0].endswith("/bin/foreshock")
        argv = exec_start[1:]
    else:
        (container,) = pod(where)["containers"]
        argv = container["args"]
    section = argv[-1]
    command_module(section)
    args = cli.build_parser().parse_args(argv)
    assert args.command == section and callable(args.run)
    assert args.run.__module__ == COMMANDS[section]
