"""deploy/kubernetes: every manifest validates against the Kubernetes schemas, and the pieces fit together.

Built-in kinds are validated by kubernetes-validate in strict mode (unknown fields are errors) against the
oldest and newest Kubernetes versions we support. ServiceMonitor and PrometheusRule are
prometheus-operator CRDs, outside those schemas: they are validated by jsonschema against
deploy/schemas/{servicemonitor,prometheusrule}-monitoring-v1.json, strict subsets written from the CRDs'
openAPIV3Schema (each $comment says which version), and the PrometheusRule must carry exactly the
rule file deploy/prometheus tests with promtool. Then the wiring:
kustomization.yaml lists exactly the directory's manifests, selectors match pod labels, named ports exist,
referenced ConfigMaps and ServiceAccounts exist, no Secret is committed, and the security contexts and
RBAC are least privilege, and the ServiceMonitors and the PrometheusRule get kube-prometheus-stack's
`release` label from one patch. Where kubectl is installed, its built-in kustomize renders the layout and
the rendering is validated too.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml


REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "deploy" / "kubernetes"
# prometheus-operator CRDs, outside kubernetes-validate's schemas: strict subsets of the CRDs' schemas.
CRD_SCHEMAS = {kind: REPO / "deploy" / "schemas" / f"{kind.lower()}-monitoring-v1.json"
               for kind in ("ServiceMonitor", "PrometheusRule")}
RULES = REPO / "deploy" / "prometheus" / "foreshock-rules.yaml"
VERSIONS = ("1.28.0", "1.37.0")  # oldest and newest supported; both ship with kubernetes-validate
NAMESPACE = "foreshock"


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


ALL_DOCS = [(path.name, i, doc) for path in manifest_files() for i, doc in enumerate(load_docs(path))]


def objects(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, _, doc in ALL_DOCS if doc["kind"] == kind}


def validate(doc: dict, version: str) -> None:
    """Raise on an invalid object; an object of a kind nobody can validate is a failure too."""
    if doc.get("kind") in CRD_SCHEMAS:
        schema = json.loads(CRD_SCHEMAS[doc["kind"]].read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.Draft202012Validator(schema).validate(doc)
        return
    kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_every_manifest_and_nothing_else():
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "a resource is listed twice"
    assert set(resources) == {p.name for p in manifest_files()}
    assert set(kustomization) <= {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches"}
    assert kustomization["namespace"] == NAMESPACE
    images = {image["name"] for image in kustomization["images"]}
    used = {c["image"] for _, _, doc in ALL_DOCS if doc["kind"] in ("DaemonSet", "StatefulSet")
            for c in doc["spec"]["template"]["spec"]["containers"]}
    assert used == images == {"foreshock"}, "every workload uses the one image kustomize sets"


SHARDED = REPO / "deploy" / "kubernetes-sharded"


def sharded_files() -> list[Path]:
    """The sharded layout's own objects; patch-*.yaml are patches of ../kubernetes, checked rendered."""
    return sorted(p for p in SHARDED.glob("*.yaml") if p.name != "kustomization.yaml" and not p.name.startswith("patch-"))


SHARDED_DOCS = [(path.name, i, doc) for path in sharded_files() for i, doc in enumerate(load_docs(path))]
ARCHIVE = REPO / "deploy" / "kubernetes-archive"


def archive_files() -> list[Path]:
    """The archive layout's own objects; patch-*.yaml are patches of ../kubernetes, checked rendered."""
    return sorted(p for p in ARCHIVE.glob("*.yaml") if p.name != "kustomization.yaml" and not p.name.startswith("patch-"))


ARCHIVE_DOCS = [(path.name, i, doc) for path in archive_files() for i, doc in enumerate(load_docs(path))]
EVERY_DOC = [(f"kubernetes/{n}", i, d) for n, i, d in ALL_DOCS] + \
    [(f"kubernetes-sharded/{n}", i, d) for n, i, d in SHARDED_DOCS] + \
    [(f"kubernetes-archive/{n}", i, d) for n, i, d in ARCHIVE_DOCS]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name,index,doc", EVERY_DOC, ids=[f"{n}#{i}" for n, i, _ in EVERY_DOC])
def test_manifest_validates(name, index, doc, version):
    try:
        validate(doc, version)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name}#{index} ({doc['kind']}) at {'.'.join(map(str, exc.path))}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{name}#{index}: {exc.message}")
    except jsonschema.ValidationError as exc:
        pytest.fail(f"{name}#{index} ({doc['kind']}) at {'.'.join(map(str, exc.path))}: {exc.message}")


def _daemonset():
    return copy.deepcopy(objects("DaemonSet")["foreshock-collector"])


def _servicemonitor():
    return copy.deepcopy(objects("ServiceMonitor")["foreshock-serve"])


def _prometheusrule():
    return copy.deepcopy(objects("PrometheusRule")["foreshock"])


def _record_and_alert(d):
    d["spec"]["groups"][0]["rules"][0]["alert"] = "Both"


def _bad_for(d):
    d["spec"]["groups"][1]["rules"][0]["for"] = "2 minutes"


def _bad_security_field(d):
    d["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True


def _bad_mount_flag(d):
    d["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] = "yes"  # not a boolean


def _bad_endpoint_field(d):
    d["spec"]["endpoints"][0]["intervall"] = "15s"


def _bad_interval(d):
    d["spec"]["endpoints"][0]["interval"] = "15 seconds"


def _no_selector(d):
    del d["spec"]["selector"]


@pytest.mark.parametrize("make,mutate", [
    (_daemonset, _bad_security_field), (_daemonset, _bad_mount_flag),
    (_servicemonitor, _bad_endpoint_field), (_servicemonitor, _bad_interval), (_servicemonitor, _no_selector),
    (_prometheusrule, _record_and_alert), (_prometheusrule, _bad_for),
])
def test_validation_rejects_a_broken_manifest(make, mutate):
    doc = make()
    validate(doc, VERSIONS[-1])  # valid before
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate(doc, VERSIONS[-1])


MONITORING_GROUP = "monitoring.coreos.com"


def release_patch(kustomization: dict) -> str:
    """The `release` label value the kustomization's one patch puts on every prometheus-operator object."""
    (patch,) = [p for p in kustomization.get("patches", []) if p["target"].get("group") == MONITORING_GROUP]
    assert patch["target"] == {"group": MONITORING_GROUP}, "every ServiceMonitor and PrometheusRule, by group"
    (op,) = yaml.safe_load(patch["patch"])
    assert (op["op"], op["path"]) == ("add", "/metadata/labels/release")
    return op["value"]


def test_monitoring_objects_get_the_release_label_kube_prometheus_stack_selects():
    """kube-prometheus-stack's Prometheus selects ServiceMonitors and PrometheusRules by
    `release: <Helm release name>`; the kustomization adds it to every object of the operator's group,
    and only to those, from one value (deploy/README.md says how to set it)."""
    release = release_patch(yaml.safe_load((KUBE / "kustomization.yaml").read_text()))
    assert release == "kube-prometheus-stack", "the chart's usual release name is the default"
    monitoring = [doc for _, _, doc in ALL_DOCS if doc["apiVersion"].split("/")[0] == MONITORING_GROUP]
    assert sorted(doc["kind"] for doc in monitoring) == ["PrometheusRule", "ServiceMonitor", "ServiceMonitor"]
    for doc in monitoring:
        # a JSON-patch add under /metadata/labels needs the map to exist
        assert isinstance(doc["metadata"]["labels"], dict), doc["metadata"]["name"]
        assert "release" not in doc["metadata"]["labels"], "the kustomization's patch is the one place"


def test_no_secret_is_committed_and_every_referenced_object_exists():
    assert not objects("Secret"), "TLS secrets are created at install time, never committed"
    configmaps, accounts = objects("ConfigMap"), objects("ServiceAccount")
    for _, _, doc in ALL_DOCS:
        assert doc["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding") or \
            doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]
    secrets = set()
    for kind in ("DaemonSet", "StatefulSet"):
        for name, workload in objects(kind).items():
            pod = workload["spec"]["template"]["spec"]
            assert pod["serviceAccountName"] in accounts, name
            for volume in pod["volumes"]:
                if "configMap" in volume:
                    assert volume["configMap"]["name"] in configmaps, volume
                if "secret" in volume:
                    secrets.add(volume["secret"]["secretName"])
    assert secrets == {"foreshock-serve-tls", "foreshock-serve-tokens", "foreshock-collector-credentials"}


def _ports(pod_spec: dict) -> set[str]:
    return {p["name"] for c in pod_spec["containers"] for p in c.get("ports", [])}


def test_services_and_servicemonitors_select_real_pods_and_ports():
    workloads = {**objects("DaemonSet"), **objects("StatefulSet")}
    for name, service in objects("Service").items():
        selector = service["spec"]["selector"]
        matched = [w for w in workloads.values()
                   if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} workloads"
        pod = matched[0]["spec"]["template"]["spec"]
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in _ports(pod), f"Service {name}: no container port {port['targetPort']}"
    for w in workloads.values():
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    statefulset = objects("StatefulSet")["foreshock-serve"]
    assert objects("Service")[statefulset["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    for name, monitor in objects("ServiceMonitor").items():
        wanted = monitor["spec"]["selector"]["matchLabels"]
        scraped = [s for s in objects("Service").values()
                   if wanted.items() <= s["metadata"]["labels"].items()
                   and any(p["name"] == e["port"] for p in s["spec"]["ports"] for e in monitor["spec"]["endpoints"])]
        assert [s["metadata"]["name"] for s in scraped] == [name], \
            f"ServiceMonitor {name} must scrape exactly its Service (the job label the alerts match)"


def test_collector_daemonset_on_gpu_nodes_with_read_only_host_paths():
    pod = objects("DaemonSet")["foreshock-collector"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["hostNetwork"] is True and pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    host = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert host["host-sys"] == {"path": "/sys", "type": "Directory"} and mounts["host-sys"]["readOnly"] is True
    assert host["kmsg"] == {"path": "/dev/kmsg", "type": "CharDevice"} and mounts["kmsg"]["readOnly"] is True
    writable = {name for name, m in mounts.items() if name in host and not m.get("readOnly")}
    assert writable == {"spool"}, "only the spool is a writable host path"
    env = {e["name"]: e for e in container["env"]}
    assert env["FORESHOCK_COLLECT_NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}


@pytest.mark.parametrize("kind,name", [("DaemonSet", "foreshock-collector"), ("StatefulSet", "foreshock-serve")])
def test_containers_are_locked_down_and_bounded(kind, name):
    pod = objects(kind)[name]["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert set(container["resources"]["requests"]) == {"cpu", "memory"}
        assert set(container["resources"]["limits"]) == {"cpu", "memory"}


def test_control_plane_is_non_root_with_durable_state():
    statefulset = objects("StatefulSet")["foreshock-serve"]
    pod = statefulset["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    (container,) = pod["containers"]
    assert "add" not in container["securityContext"]["capabilities"]
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/var/lib/foreshock/serve"
    assert statefulset["spec"]["replicas"] == 1


def test_node_action_rbac_is_least_privilege_and_its_token_is_off_like_the_action():
    """get and patch nodes, patch nodes/status: the requests of the Kubernetes node action
    (tests/test_service_actions_kubernetes.py checks each one it makes against these rules)."""
    (role,) = objects("ClusterRole").values()
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                             {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}]
    assert not objects("Role") and not objects("RoleBinding")
    (binding,) = objects("ClusterRoleBinding").values()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "foreshock-serve", "namespace": NAMESPACE}]
    pod = objects("StatefulSet")["foreshock-serve"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "foreshock-serve"
    # The action is off by default (kubernetes_taint), and so is the token that would carry its rights.
    config = tomllib.loads(objects("ConfigMap")["foreshock-serve-config"]["data"]["foreshock.toml"])
    assert not config["serve"].get("kubernetes_taint", False)
    assert pod["automountServiceAccountToken"] is False
    for _, _, doc in ALL_DOCS:
        if doc["kind"] == "ServiceAccount":
            assert doc["automountServiceAccountToken"] is False, doc["metadata"]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_kustomize_renders_the_layout_and_the_rendering_validates():
    """`kubectl kustomize` (kustomize built into kubectl) renders the layout as `kubectl apply -k` would;
    what it renders is validated again, since kustomize adds labels and rewrites the image."""
    proc = subprocess.run(["kubectl", "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rendered = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == \
        sorted((d["kind"], d["metadata"]["name"]) for _, _, d in ALL_DOCS)
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    release = release_patch(kustomization)
    for doc in rendered:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "foreshock", doc["metadata"]["name"]
        if doc["kind"] in CRD_SCHEMAS:
            assert doc["metadata"]["labels"]["release"] == release, doc["metadata"]["name"]
        else:
            assert "release" not in doc["metadata"]["labels"], doc["metadata"]["name"]
        for version in VERSIONS:
            validate(doc, version)
        if doc["kind"] in ("DaemonSet", "StatefulSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                assert container["image"] == f"{image['newName']}:{image['newTag']}"
            # the selector is immutable after creation: kustomize's labels must not have touched it
            assert "app.kubernetes.io/part-of" not in doc["spec"]["selector"]["matchLabels"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_the_release_label_is_set_in_one_place(tmp_path):
    """Changing the patch's value, as deploy/README.md says, relabels both ServiceMonitors and the rule."""
    shutil.copytree(KUBE, tmp_path / "k")
    path = tmp_path / "k" / "kustomization.yaml"
    text = path.read_text()
    assert text.count("value: kube-prometheus-stack") == 1
    path.write_text(text.replace("value: kube-prometheus-stack", "value: monitoring"))
    proc = subprocess.run(["kubectl", "kustomize", str(tmp_path / "k")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    labelled = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(proc.stdout)
                      if d and d["metadata"]["labels"].get("release") == "monitoring")
    assert labelled == [("PrometheusRule", "foreshock"), ("ServiceMonitor", "foreshock-collector"),
                        ("ServiceMonitor", "foreshock-serve")]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_kustomize_refuses_a_listed_file_that_does_not_exist(tmp_path):
    shutil.copytree(KUBE, tmp_path / "k")
    (tmp_path / "k" / "serve-networkpolicy.yaml").unlink()
    proc = subprocess.run(["kubectl", "kustomize", str(tmp_path / "k")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "serve-networkpolicy.yaml" in proc.stderr


def test_prometheusrule_carries_exactly_the_tested_rule_file():
    """The rules the operator deploys are the rules promtool checks and unit-tests (deploy/prometheus)."""
    assert objects("PrometheusRule")["foreshock"]["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


# -- the sharded control plane: deploy/kubernetes-sharded (issue 19) -----------------------------------
def sharded(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, _, doc in SHARDED_DOCS if doc["kind"] == kind}


def _toml(configmap: dict, key: str = "foreshock.toml") -> dict:
    return tomllib.loads(configmap["data"][key])


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _mount_of(workload: dict, volume: str) -> str:
    (path,) = [m["mountPath"] for m in _container(workload)["volumeMounts"] if m["name"] == volume]
    return path


def _grpc_port(service: dict) -> int:
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
    return port


SHARD_MAP = _toml(sharded("ConfigMap")["foreshock-shards"], "shards.toml") if SHARDED.exists() else {}


def test_sharded_kustomization_lists_every_manifest_on_the_single_layout():
    kustomization = yaml.safe_load((SHARDED / "kustomization.yaml").read_text())
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "a resource is listed twice"
    assert set(resources) == {"../kubernetes"} | {p.name for p in sharded_files()}
    assert {p["path"] for p in kustomization["patches"] if "path" in p} == \
        {p.name for p in SHARDED.glob("patch-*.yaml")}
    assert "images" not in kustomization, "the image is set once, in ../kubernetes"
    for _, _, doc in SHARDED_DOCS:
        cluster_scoped = doc["kind"] in ("ClusterRole", "ClusterRoleBinding")
        assert doc["metadata"].get("namespace") == (None if cluster_scoped else NAMESPACE), doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "foreshock"


def test_one_shard_pod_per_shard_of_the_map_at_the_address_the_map_gives():
    """Pod foreshock-shard-N is shard-N (its ordinal, from the pod-index label), and the map's address
    for shard-N is that pod's name under the StatefulSet's headless Service."""
    statefulset = sharded("StatefulSet")["foreshock-shard"]
    shards = SHARD_MAP["shards"]
    assert statefulset["spec"]["replicas"] == len(shards)
    assert sorted(shards) == [f"shard-{i}" for i in range(len(shards))]
    service = sharded("Service")[statefulset["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    for i in range(len(shards)):
        assert shards[f"shard-{i}"]["address"] == \
            f"{statefulset['metadata']['name']}-{i}.{service['metadata']['name']}.{NAMESPACE}.svc:{_grpc_port(service)}"
    leaves = [leaf for shard in shards.values() for leaf in shard["leaves"]]
    assert len(leaves) == len(set(leaves)), "a leaf switch in two shards"
    env = {e["name"]: e for e in _container(statefulset)["env"]}
    assert env["POD_INDEX"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert env["FORESHOCK_SERVE_SHARD"]["value"] == "shard-$(POD_INDEX)"
    names = [e["name"] for e in _container(statefulset)["env"]]
    assert names.index("POD_INDEX") < names.index("FORESHOCK_SERVE_SHARD"), "$(VAR) expands earlier variables only"


def _projected_configmaps(pod: dict, volume: str) -> list[str]:
    (vol,) = [v for v in pod["volumes"] if v["name"] == volume]
    return [s["configMap"]["name"] for s in vol["projected"]["sources"]]


def test_the_map_is_one_configmap_mounted_live_beside_each_settings_file():
    """Shards and collectors read the one map at /etc/foreshock/shards.toml, from a projected volume
    (a subPath mount would never see a changed map)."""
    statefulset = sharded("StatefulSet")["foreshock-shard"]
    pod = statefulset["spec"]["template"]["spec"]
    assert _projected_configmaps(pod, "config") == ["foreshock-shard-config", "foreshock-shards"]
    assert _mount_of(statefulset, "config") == "/etc/foreshock"
    assert _toml(sharded("ConfigMap")["foreshock-shard-config"])["serve"]["shard_map"] == "/etc/foreshock/shards.toml"
    patch = yaml.safe_load((SHARDED / "patch-collector-shard-map.yaml").read_text())
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    daemonset = objects("DaemonSet")["foreshock-collector"]
    assert env["FORESHOCK_COLLECT_SHARD_MAP"] == _mount_of(daemonset, "config") + "/shards.toml"
    assert env["FORESHOCK_COLLECT_SERVICE"] == ""
    assert _projected_configmaps(patch["spec"]["template"]["spec"], "config") == \
        ["foreshock-collector-config", "foreshock-shards"]
    for _, _, doc in SHARDED_DOCS:
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            assert all("subPath" not in m for m in container["volumeMounts"])
    maps = [d for d in sharded("ConfigMap").values() if "shards.toml" in d["data"]]
    assert len(maps) == 1


def test_coordinator_leader_and_standby_share_the_lease_volume_and_only_the_leader_is_served():
    deployment = sharded("Deployment")["foreshock-coordinator"]
    assert deployment["spec"]["replicas"] == 2
    # a rollout that waited for a new pod to be ready would wait for a lock the old leader holds
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == "100%"
    pod = deployment["spec"]["template"]["spec"]
    (claim_volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    claim = sharded("PersistentVolumeClaim")[claim_volume["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    shared = _mount_of(deployment, claim_volume["name"])
    config = _toml(sharded("ConfigMap")["foreshock-coordinator-config"])["serve"]
    assert config["coordinator"] is True
    assert config["lease_file"] == "/var/lib/foreshock-coordinator/lease"
    assert Path(config["lease_file"]).parent == Path(config["state"]).parent == Path(shared)
    container = _container(deployment)
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    leader = sharded("Service")["foreshock-coordinator-leader"]
    assert leader["spec"]["type"] == "ClusterIP" and not leader["spec"].get("publishNotReadyAddresses")
    assert [p["name"] for p in leader["spec"]["ports"]] == ["grpc"], "the standby is not served, nor scraped here"
    scraped = sharded("Service")["foreshock-coordinator"]
    assert scraped["spec"]["publishNotReadyAddresses"] is True, "the standby is scraped too"
    shard_config = _toml(sharded("ConfigMap")["foreshock-shard-config"])["serve"]
    assert shard_config["coordinator_address"] == \
        f"{leader['metadata']['name']}.{NAMESPACE}.svc:{_grpc_port(leader)}"


def test_sharded_services_and_servicemonitors_select_real_pods_and_ports():
    workloads = {**sharded("StatefulSet"), **sharded("Deployment")}
    services = sharded("Service")
    for name, service in services.items():
        selector = service["spec"]["selector"]
        matched = [w for w in workloads.values()
                   if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} workloads"
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in _ports(matched[0]["spec"]["template"]["spec"]), name
    for w in workloads.values():
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    jobs = set()
    for name, monitor in sharded("ServiceMonitor").items():
        wanted = monitor["spec"]["selector"]["matchLabels"]
        scraped = [s for s in services.values()
                   if wanted.items() <= s["metadata"]["labels"].items()
                   and any(p["name"] == e["port"] for p in s["spec"]["ports"] for e in monitor["spec"]["endpoints"])]
        assert [s["metadata"]["name"] for s in scraped] == [name], \
            f"ServiceMonitor {name} must scrape exactly its Service (the job label the alerts match)"
        jobs.add(name)
    rules = RULES.read_text()
    for job in jobs:
        assert f'job="{job}"' in rules, f"no rule watches job {job}"


@pytest.mark.parametrize("kind,name", [("StatefulSet", "foreshock-shard"), ("Deployment", "foreshock-coordinator")])
def test_shards_and_coordinators_are_locked_down_and_bounded(kind, name):
    workload = sharded(kind)[name]
    pod = workload["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["serviceAccountName"] in sharded("ServiceAccount")
    for container in pod["containers"]:
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False and security["privileged"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert set(container["resources"]["requests"]) == {"cpu", "memory"}
        assert set(container["resources"]["limits"]) == {"cpu", "memory"}
        assert "hostPath" not in str(pod["volumes"]) and not pod.get("hostNetwork")
    for volume in pod["volumes"]:
        sources = volume.get("projected", {}).get("sources", [])
        for ref in [volume.get("configMap")] + [s.get("configMap") for s in sources]:
            if ref:
                assert ref["name"] in sharded("ConfigMap"), ref


def test_sharded_layout_commits_no_secret_and_no_api_rights_but_reading_nodes():
    """The one API right: the collectors' init container reads its node's leaf-switch label."""
    assert not sharded("Secret")
    assert not (sharded("Role") or sharded("RoleBinding"))
    assert [r["rules"] for r in sharded("ClusterRole").values()] == \
        [[{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]]
    assert [b["subjects"][0]["name"] for b in sharded("ClusterRoleBinding").values()] == ["foreshock-collector"]
    for account in sharded("ServiceAccount").values():
        assert account["automountServiceAccountToken"] is False
    secrets = {v["secret"]["secretName"] for w in [*sharded("StatefulSet").values(), *sharded("Deployment").values()]
               for v in w["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert secrets == {"foreshock-shard-tls", "foreshock-shard-tokens", "foreshock-shard-coordinator-credentials",
                       "foreshock-coordinator-tls", "foreshock-coordinator-tokens"}


def _selects(policy: dict, labels: dict) -> bool:
    selector = policy["spec"]["podSelector"]
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []) if e["operator"] == "In")


def test_network_policies_let_through_only_the_planned_flows():
    """collectors -> shards, shards -> coordinator, jobs -> coordinator, Prometheus -> metrics; shards and
    coordinators reach only each other and DNS."""
    policies = sharded("NetworkPolicy")
    workloads = {"shard": sharded("StatefulSet")["foreshock-shard"],
                 "coordinator": sharded("Deployment")["foreshock-coordinator"]}
    for component, workload in workloads.items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in policies.values() if _selects(p, labels)]
        assert {"Ingress", "Egress"} <= {t for p in mine for t in p["spec"]["policyTypes"]}, component
        ports = _ports(workload["spec"]["template"]["spec"])
        allowed = {port["port"] for p in mine for rule in p["spec"].get("ingress", []) for port in rule["ports"]}
        assert allowed == ports == {"grpc", "metrics"}, component
        for p in mine:
            for rule in p["spec"].get("egress", []):
                for port in rule["ports"]:
                    assert port["port"] in ("grpc", 53), (p["metadata"]["name"], port)
    metrics = [p for p in policies.values()
               if any(port["port"] == "metrics" for rule in p["spec"].get("ingress", []) for port in rule["ports"])]
    (prometheus,) = metrics
    (rule,) = prometheus["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    coordinator_in = policies["foreshock-coordinator"]["spec"]["ingress"]
    (rule,) = coordinator_in
    assert rule["from"] and {"shard"} == {f["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                                          for f in rule["from"] if "podSelector" in f}


@pytest.mark.parametrize("configmap,kind,name", [("foreshock-shard-config", "StatefulSet", "foreshock-shard"),
                                                  ("foreshock-coordinator-config", "Deployment", "foreshock-coordinator")])
def test_sharded_settings_paths_and_ports_match_their_pods(configmap, kind, name):
    """Every path a shard's or a coordinator's settings name is on a mount of its pod: the secrets on
    read-only secret volumes, the state (and the lease) on the writable one; the ports are the pod's."""
    cfg = _toml(sharded("ConfigMap")[configmap])["serve"]
    workload = sharded(kind)[name]
    pod = workload["spec"]["template"]["spec"]
    container = _container(workload)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}

    def volume_at(path: str) -> tuple[dict, dict]:
        (mount,) = [m for where, m in mounts.items() if Path(path).is_relative_to(where) and where != "/tmp"]
        return mount, volumes.get(mount["name"], {})

    for key in ("tls_cert", "tls_key", "token_file", "forward_tls_ca", "forward_token_file"):
        if key in cfg:
            mount, volume = volume_at(cfg[key])
            assert mount.get("readOnly") is True and "secret" in volume, key
    for key in ("state", "lease_file"):
        if key in cfg:
            mount, volume = volume_at(cfg[key])
            assert not mount.get("readOnly") and ("persistentVolumeClaim" in volume or mount["name"] in claims), key
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(cfg["listen"].rpartition(":")[2]) == ports["grpc"]
    assert int(cfg["metrics_listen"].rpartition(":")[2]) == ports["metrics"]


def _sharded_settings(section: str, configmap: str, env: dict[str, str]) -> dict:
    from foreshock.config import resolve

    module = importlib.import_module({"serve": "foreshock.service.command", "collect": "foreshock.collectors.command"}[section])
    doc = sharded("ConfigMap").get(configmap) or objects("ConfigMap")[configmap]
    return resolve(section, module.DEFAULTS, file_data=_toml(doc), env=env, checks=getattr(module, "CHECKS", None))


@pytest.mark.parametrize("section,configmap,env", [
    ("serve", "foreshock-shard-config", {"FORESHOCK_SERVE_SHARD": "shard-0"}),
    ("serve", "foreshock-coordinator-config", {}),
    # the collectors' settings of ../kubernetes with the environment patch-collector-shard-map.yaml adds
    ("collect", "foreshock-collector-config", {"FORESHOCK_COLLECT_SHARD_MAP": "/etc/foreshock/shards.toml",
                                               "FORESHOCK_COLLECT_LEAF_SWITCH": "leaf-01",
                                               "FORESHOCK_COLLECT_SERVICE": ""}),
])
def test_sharded_settings_resolve_through_the_real_command(section, configmap, env):
    """The settings resolve as the commands resolve them: a key the command does not have, or a value
    out of its range, is a ConfigError naming it."""
    _sharded_settings(section, configmap, env)


def _render(path: Path) -> list[dict]:
    proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_kustomize_renders_the_sharded_layout_on_the_single_one():
    """The sharded rendering is ../kubernetes without its single control plane, with the shards and the
    coordinators; the image, the `release` label and the part-of label are the base's, on every object."""
    rendered = _render(SHARDED)
    single = _render(KUBE)
    base_kept = {(d["kind"], d["metadata"]["name"]) for d in single
                 if d["metadata"]["labels"].get("app.kubernetes.io/component") != "control-plane"
                 and d["kind"] not in ("ClusterRole", "ClusterRoleBinding")}
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == \
        sorted(base_kept | {(d["kind"], d["metadata"]["name"]) for _, _, d in SHARDED_DOCS})
    assert not [d for d in rendered if "serve" in d["metadata"]["name"] or "node-actions" in d["metadata"]["name"]]
    (image,) = {c["image"] for d in single if d["kind"] == "DaemonSet" for c in d["spec"]["template"]["spec"]["containers"]}
    release = release_patch(yaml.safe_load((KUBE / "kustomization.yaml").read_text()))
    for doc in rendered:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "foreshock", doc["metadata"]["name"]
        if doc["kind"] in CRD_SCHEMAS:
            assert doc["metadata"]["labels"]["release"] == release, doc["metadata"]["name"]
        else:
            assert "release" not in doc["metadata"]["labels"], doc["metadata"]["name"]
        for version in VERSIONS:
            validate(doc, version)
        if doc["kind"] in ("DaemonSet", "StatefulSet", "Deployment"):
            assert {c["image"] for c in doc["spec"]["template"]["spec"]["containers"]} == {image}
            assert "app.kubernetes.io/part-of" not in doc["spec"]["selector"]["matchLabels"]
    (daemonset,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    assert _projected_configmaps(pod, "config") == ["foreshock-collector-config", "foreshock-shards"]
    assert not [v for v in pod["volumes"] if v["name"] == "config" and "configMap" in v]
    assert {c["image"] for c in pod["initContainers"]} == {image}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_collectors_take_their_leaf_switch_from_their_nodes_label():
    """The downward API gives no node labels: an init container, the only one with an API token, reads
    the node's foreshock.io/leaf-switch into a file the collector's entrypoint puts in its environment;
    its service account may get nodes and nothing more."""
    rendered = _render(SHARDED)
    (daemonset,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (collector,) = pod["containers"]
    script = init["command"][-1]
    compile(script, "leaf-switch", "exec")
    assert "foreshock.io/leaf-switch" in script and "_request_timeout" in script
    (written,) = re.findall(r'pathlib.Path\("([^"]+)"\)', script)
    assert f'FORESHOCK_COLLECT_LEAF_SWITCH="$(cat {written})" exec foreshock collect' in collector["command"][-1]
    assert "args" not in collector
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert Path(written).parent.as_posix() == mounts["placement"]["mountPath"]
    assert "emptyDir" in volumes["placement"]
    assert pod["automountServiceAccountToken"] is False
    assert "api-token" in mounts and "api-token" not in {m["name"] for m in collector["volumeMounts"]}
    (role,) = [d for d in rendered if d["kind"] == "ClusterRole"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    (binding,) = [d for d in rendered if d["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": daemonset["metadata"]["namespace"]}]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_the_image_and_release_label_set_in_the_single_layout_reach_the_sharded_one(tmp_path):
    shutil.copytree(KUBE, tmp_path / "kubernetes")
    shutil.copytree(SHARDED, tmp_path / "kubernetes-sharded")
    path = tmp_path / "kubernetes" / "kustomization.yaml"
    text = path.read_text()
    path.write_text(text.replace("value: kube-prometheus-stack", "value: monitoring").replace("newTag: 0.1.0", "newTag: 9.9.9"))
    rendered = _render(tmp_path / "kubernetes-sharded")
    assert sorted(d["metadata"]["name"] for d in rendered if d["metadata"]["labels"].get("release") == "monitoring") == \
        ["foreshock", "foreshock-collector", "foreshock-coordinator", "foreshock-shard"]
    images = {c["image"] for d in rendered if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment")
              for c in d["spec"]["template"]["spec"]["containers"] + d["spec"]["template"]["spec"].get("initContainers", [])}
    assert images == {"registry.example.com/foreshock/foreshock:9.9.9"}


def archived(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, _, doc in ARCHIVE_DOCS if doc["kind"] == kind}


def test_archive_kustomization_lists_every_manifest_on_the_single_layout():
    kustomization = yaml.safe_load((ARCHIVE / "kustomization.yaml").read_text())
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "a resource is listed twice"
    assert set(resources) == {"../kubernetes"} | {p.name for p in archive_files()}
    assert {p["path"] for p in kustomization["patches"]} == {p.name for p in ARCHIVE.glob("patch-*.yaml")}
    assert "images" not in kustomization, "the image is set once, in ../kubernetes"
    for _, _, doc in ARCHIVE_DOCS:
        assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "foreshock"


def test_archive_upkeep_runs_as_the_control_plane_with_only_the_archive_writable(monkeypatch):
    """Compact, then prune, in one pod: the control plane's uid (its files), a read-only root, no
    capabilities, no API token, no network; writable only the archive volume and a small /tmp; the
    command lines parse with the real CLI and the settings resolve through the real command."""
    from foreshock import cli
    from foreshock.service import archive_command

    cron = archived("CronJob")["foreshock-archive-maintenance"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid" and cron["spec"]["timeZone"] == "Etc/UTC"
    job = cron["spec"]["jobTemplate"]["spec"]
    pod = job["template"]["spec"]
    serve_pod = objects("StatefulSet")["foreshock-serve"]["spec"]["template"]["spec"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["seccompProfile"] == {"type": "RuntimeDefault"}
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        assert security[key] == serve_pod["securityContext"][key], key
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert archived("ServiceAccount")[pod["serviceAccountName"]]["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] == "Never"
    (init,), (main,) = pod["initContainers"], pod["containers"]
    assert [init["args"], main["args"]] == [["archive", "compact"], ["archive", "prune"]]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["archive"]["persistentVolumeClaim"]["claimName"] in archived("PersistentVolumeClaim")
    assert "emptyDir" in volumes["tmp"] and volumes["config"]["configMap"]["name"] in objects("ConfigMap")
    for container in (init, main):
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
        assert set(container["resources"]["requests"]) == set(container["resources"]["limits"]) == {"cpu", "memory"}
        writable = {m["name"] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"archive", "tmp"}, writable
        args = cli.build_parser().parse_args(container["args"])
        assert callable(args.run) and args.run.__module__ == archive_command.__name__
        for var in container["env"]:
            monkeypatch.setenv(var["name"], var["value"])
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        config = tomllib.loads(objects("ConfigMap")[volumes["config"]["configMap"]["name"]]["data"]["foreshock.toml"])
        cfg = archive_command._settings(args, config)
        assert cfg["archive"] == mounts["archive"]
        assert cfg["keep_days"] == 90 and cfg["table_keep_days"] == ["incidents=0", "decisions=730"]
    (policy,) = archived("NetworkPolicy").values()
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= job["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in policy["spec"] and "egress" not in policy["spec"]
    # the ReadWriteOnce volume is where the control plane runs: the upkeep goes there
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"].items() <= \
        objects("StatefulSet")["foreshock-serve"]["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_kustomize_renders_the_archive_layout_on_the_single_one():
    """../kubernetes with the archive volume on the control plane, where [serve] archive names it, and
    the upkeep on the same claim with the base's image; every rendered object validates."""
    rendered = _render(ARCHIVE)
    single = _render(KUBE)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == \
        sorted({(d["kind"], d["metadata"]["name"]) for d in single}
               | {(d["kind"], d["metadata"]["name"]) for _, _, d in ARCHIVE_DOCS})
    (statefulset,) = [d for d in rendered if d["kind"] == "StatefulSet"]
    (cron,) = [d for d in rendered if d["kind"] == "CronJob"]
    serve = _container(statefulset)
    env = {e["name"]: e["value"] for e in serve.get("env", []) if "value" in e}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in statefulset["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    mounts = {m["name"]: m["mountPath"] for m in serve["volumeMounts"]}
    (archive_volume,) = [name for name, claim in claims.items() if claim == "foreshock-archive"]
    assert env["FORESHOCK_SERVE_ARCHIVE"] == mounts[archive_volume]
    assert env["NUMBA_CACHE_DIR"] and serve["args"] == ["serve"]   # the base's container, patched, not replaced
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert {c["image"] for c in pod["initContainers"] + pod["containers"]} == {serve["image"]} != {"foreshock"}
    for doc in rendered:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "foreshock", doc["metadata"]["name"]
        for version in VERSIONS:
            validate(doc, version)
