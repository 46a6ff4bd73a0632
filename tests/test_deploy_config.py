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
        return resolve(section, module.DEFAULTS, file_data=file_data)
    finally:
        os.environ.update(saved)


def configmap_toml(name: str) -> dict:
    doc = yaml.safe_load((KUBE / name).read_text())
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
    rc = cli.main(["--config", str(config), "collect", "--once", "--sources", "rdma,netdev,host_net",
                   "--sysfs", str(procfs_fixture / "sys"), "--procfs", str(procfs_fixture / "proc"),
                   "--node", "deploy-example", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "source rdma" in out and "FAILED" not in out, out
    assert list((tmp_path / "out").rglob("*.parquet")), "the sweep wrote no Parquet"
