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
import json
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


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name,index,doc", ALL_DOCS, ids=[f"{n}#{i}" for n, i, _ in ALL_DOCS])
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
