"""Node actions against the Kubernetes API, as the official client makes them: a small HTTP server on
loopback stands in for the API server, records each request, and applies it to its nodes the way the
API server would (JSON patch; strategic merge by the list's merge key). Every request body is checked
against the API's published schemas (kubernetes-validate's strict Node schema, and the client's own
models), and the content types against the patch strategy the schema declares for each list."""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes extra is not installed (make installs it)")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from kubernetes.client import V1NodeCondition, V1Taint  # noqa: E402

from foreshock.service.actions import CONDITION_TYPE, ActionSettings, KubernetesBackend  # noqa: E402
from foreshock.service.decisions import read_decisions  # noqa: E402
from foreshock.service.nodes import FatalEvent  # noqa: E402
from foreshock.service.scoring import NullScorer  # noqa: E402
from foreshock.service.server import Settings, build_server  # noqa: E402

K8S_VERSION = "1.37.0"
SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
TOKEN = "t0ken-for-tests"
KEY = "foreshock.io/failure-risk"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def _node(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "resourceVersion": "100", "uid": f"uid-{name}",
                         "labels": {"nvidia.com/gpu.present": "true"}},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute",
                                 "timeAdded": "2026-12-01T00:00:00Z"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "message": "kubelet is posting ready status",
                                       "lastHeartbeatTime": "2026-12-01T00:00:00Z",
                                       "lastTransitionTime": "2026-12-01T00:00:00Z"}]}}


ROLE = Path(__file__).parent.parent / "deploy" / "kubernetes" / "serve-clusterrole-node-actions.yaml"


def assert_rbac_allows(requests: list[dict]) -> None:
    """Every request is one the control plane's ClusterRole grants (deploy/kubernetes)."""
    import yaml
    rules = yaml.safe_load(ROLE.read_text())["rules"]
    for r in requests:
        verb = {"GET": "get", "PATCH": "patch"}[r["method"]]
        resource = "nodes/status" if r["sub"] == "status" else "nodes"
        assert any("" in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
                   for rule in rules), f"{verb} {resource}: not granted by {ROLE.name}"


def validate_node(doc: dict) -> None:
    """The API's published Node schema, strict: unknown fields and wrong types are errors."""
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


class FakeApiServer:
    """An HTTP server on loopback with the API server's node routes. It is the fake at the boundary:
    everything on Foreshock's side (the client, its configuration, the patches) is real."""

    def __init__(self, names):
        self.nodes = {n: _node(n) for n in names}
        self.requests: list[dict] = []
        self.conflict_once: set[str] = set()     # nodes changed by someone else between a GET and a PATCH
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:3] != ["api", "v1", "nodes"] or len(parts) not in (4, 5):
                    return None, None
                return parts[3], (parts[4] if len(parts) == 5 else "")

            def do_GET(self):
                self._handle("GET", b"")

            def do_PATCH(self):
                self._handle("PATCH", self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def _handle(self, method, raw):
                name, sub = self._route()
                body = json.loads(raw) if raw else None
                with outer.lock:
                    outer.requests.append({"method": method, "path": self.path, "sub": sub, "node": name,
                                           "content_type": self.headers.get("Content-Type"),
                                           "authorization": self.headers.get("Authorization"), "body": body})
                    node = outer.nodes.get(name)
                    if node is None:
                        return self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                 "reason": "NotFound", "code": 404,
                                                 "message": f'nodes "{name}" not found'})
                    if method == "GET":
                        if name in outer.conflict_once:      # someone else writes the node right after
                            outer.conflict_once.discard(name)
                            reply = copy.deepcopy(node)
                            node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                            node["spec"]["taints"].append({"key": "example.com/maintenance", "effect": "NoSchedule"})
                            return self._reply(200, reply)
                        return self._reply(200, node)
                    try:
                        new = outer.apply(node, sub, self.headers.get("Content-Type"), body)
                    except Conflict as exc:   # as the API server answers a failed test op (kubernetes#68838)
                        return self._reply(422, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                 "reason": "Invalid", "code": 422, "message": str(exc)})
                    except Exception as exc:   # a bad op, or a node the strict schema refuses: 4xx, as the API
                        return self._reply(415 if "content type" in str(exc) else 422,
                                           {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                            "code": 422, "message": str(exc)})
                    new["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                    outer.nodes[name] = new
                    return self._reply(200, new)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def apply(node: dict, sub: str, content_type: str, body) -> dict:
        new = copy.deepcopy(node)
        if sub == "" and content_type == JSON_PATCH:
            for op in body:
                path = op["path"].strip("/").split("/")
                if op["op"] == "test":
                    target = new
                    for p in path:
                        target = target[p]
                    if target != op["value"]:
                        raise Conflict(f"Testing value {op['path']} failed")
                elif op["op"] in ("add", "replace") and path == ["spec", "taints"]:
                    new["spec"]["taints"] = op["value"]
                else:
                    raise ValueError(f"unsupported op {op}")
        elif sub == "status" and content_type == STRATEGIC:
            # NodeStatus.conditions: patch strategy merge, merge key type (the published schema says so)
            merged = {c["type"]: c for c in new["status"]["conditions"]}
            for c in body["status"]["conditions"]:
                merged[c["type"]] = {**merged.get(c["type"], {}), **c}
            new["status"]["conditions"] = list(merged.values())
        else:
            raise ValueError(f"content type {content_type} for {sub or 'the node'}: not what this route takes")
        validate_node(new)
        return new

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Conflict(Exception):
    pass


@pytest.fixture
def api(tmp_path):
    server = FakeApiServer([f"gpu{i:02d}" for i in range(1, 41)])
    yield server
    server.close()


def _kubeconfig(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({   # JSON is YAML: the client reads it as a kubeconfig
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "loop", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "foreshock", "user": {"token": TOKEN}}],
        "contexts": [{"name": "test", "context": {"cluster": "loop", "user": "foreshock"}}]}))
    return path


def _backend(tmp_path, port, **kw) -> KubernetesBackend:
    return KubernetesBackend(kubeconfig=str(_kubeconfig(tmp_path, port)), taint_key=KEY,
                             taint_effect=kw.pop("effect", "NoSchedule"), timeout=kw.pop("timeout", 5.0), **kw)


def test_the_schema_says_taints_are_replaced_whole_and_conditions_merge_by_type():
    """Why the two patches differ: the published schema's patch strategy for each list."""
    spec = json.loads((SCHEMAS / "nodespec-v1.json").read_text())["properties"]["taints"]
    status = json.loads((SCHEMAS / "nodestatus-v1.json").read_text())["properties"]["conditions"]
    assert spec["x-kubernetes-list-type"] == "atomic" and "x-kubernetes-patch-strategy" not in spec
    assert status["x-kubernetes-patch-strategy"] == "merge" and status["x-kubernetes-patch-merge-key"] == "type"


def test_taint_and_condition_requests_match_the_node_schema(api, tmp_path):
    now = [1_800_000_000.0]
    backend = _backend(tmp_path, api.port, clock=lambda: now[0])
    result = backend.take("gpu03", "fatal Xid 79 on GPU 0 (fallen off the bus)", fatal=True)
    assert result.ok, result.detail
    get, patch, status = api.requests
    assert all(r["authorization"] == f"Bearer {TOKEN}" for r in api.requests)
    assert (get["method"], get["path"]) == ("GET", "/api/v1/nodes/gpu03")

    # The taint: a JSON patch (the list is atomic), guarded by the resourceVersion it was computed from.
    assert (patch["method"], patch["path"], patch["content_type"]) == ("PATCH", "/api/v1/nodes/gpu03", JSON_PATCH)
    test_op, add_op = patch["body"]
    assert test_op == {"op": "test", "path": "/metadata/resourceVersion", "value": "100"}
    assert (add_op["op"], add_op["path"]) == ("add", "/spec/taints")
    validate_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu03"},
                   "spec": {"taints": add_op["value"]}})
    taints = [V1Taint.from_dict(t) for t in add_op["value"]]
    assert [(t.key, t.value, t.effect) for t in taints] == [      # the existing ones kept as they were
        ("nvidia.com/gpu", "present", "NoSchedule"), ("node.kubernetes.io/unreachable", None, "NoExecute"),
        (KEY, "true", "NoSchedule")]
    assert add_op["value"][1]["timeAdded"].startswith("2026-12-01T00:00:00")   # NoExecute's clock untouched

    # The condition: a strategic merge patch of the status subresource, merged by type.
    assert (status["method"], status["path"], status["content_type"]) == \
        ("PATCH", "/api/v1/nodes/gpu03/status", STRATEGIC)
    validate_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu03"}, **status["body"]})
    assert set(status["body"]) == {"status"} and set(status["body"]["status"]) == {"conditions"}
    (raw,) = status["body"]["status"]["conditions"]
    condition = V1NodeCondition.from_dict(raw)
    assert (condition.type, condition.status, condition.reason) == (CONDITION_TYPE, "True", "FatalEvent")
    assert "Xid 79" in condition.message
    assert condition.last_transition_time is not None and condition.last_heartbeat_time is not None

    node = api.nodes["gpu03"]
    validate_node(node)
    assert [c["type"] for c in node["status"]["conditions"]] == ["Ready", CONDITION_TYPE]   # Ready untouched

    assert_rbac_allows(api.requests)

    # Idempotent: the taint is there, so a second take patches no taint, only the condition's heartbeat
    # (its status has not changed, so neither does its transition time).
    api.requests.clear()
    now[0] += 60
    assert backend.take("gpu03", "fatal Xid 79", fatal=True).ok
    assert [(r["method"], r["sub"]) for r in api.requests] == [("GET", ""), ("PATCH", "status")]
    assert sum(t["key"] == KEY for t in api.nodes["gpu03"]["spec"]["taints"]) == 1
    (again,) = [c for c in api.nodes["gpu03"]["status"]["conditions"] if c["type"] == CONDITION_TYPE]
    assert again["lastHeartbeatTime"] != raw["lastHeartbeatTime"]
    assert again["lastTransitionTime"].startswith(raw["lastTransitionTime"].rstrip("Z"))
    validate_node(api.nodes["gpu03"])


def test_a_node_changed_between_read_and_patch_is_read_again_and_nothing_is_lost(api, tmp_path):
    api.conflict_once.add("gpu04")
    assert _backend(tmp_path, api.port).take("gpu04", "risk 0.7 above threshold 0.4").ok
    methods = [(r["method"], r["sub"]) for r in api.requests]
    assert methods == [("GET", ""), ("PATCH", ""), ("GET", ""), ("PATCH", ""), ("PATCH", "status")]
    keys = [t["key"] for t in api.nodes["gpu04"]["spec"]["taints"]]
    assert keys == ["nvidia.com/gpu", "node.kubernetes.io/unreachable", "example.com/maintenance", KEY]
    (cond,) = [c for c in api.nodes["gpu04"]["status"]["conditions"] if c["type"] == CONDITION_TYPE]
    assert cond["reason"] == "RiskAboveThreshold"


def test_unknown_node_and_silent_api_server(api, tmp_path):
    assert _backend(tmp_path, api.port).take("gpu99", "fatal").result == "unknown_node"
    # An API server that accepts connections and never answers: one request per call (urllib3's own
    # retries are off), ended by the deadline.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    accepted = []

    def accept():
        silent.settimeout(5)
        try:
            while True:
                conn, _ = silent.accept()
                accepted.append(conn)
        except OSError:
            pass
    threading.Thread(target=accept, daemon=True).start()
    try:
        backend = _backend(tmp_path, silent.getsockname()[1], timeout=0.5)
        t0 = time.monotonic()
        result = backend.take("gpu05", "fatal")
        assert result.result == "timeout", result
        assert time.monotonic() - t0 < 5
        assert len(accepted) == 1
    finally:
        silent.close()
        for conn in accepted:
            conn.close()


def test_a_bad_kubeconfig_or_missing_service_account_is_a_clear_settings_error(tmp_path):
    from foreshock.service.server import SettingsError
    for kubeconfig, words in (("", "in-cluster service account"), (str(tmp_path / "missing"), "missing")):
        with pytest.raises(SettingsError, match="kubernetes actions: cannot configure the client") as info:
            build_server(Settings.insecure_loopback(tmp_path / "s", scorer=NullScorer(), actions=ActionSettings(
                kubernetes=True, kubeconfig=kubeconfig)))
        assert words in str(info.value)
    for bad in ({"taint_effect": "Evict"}, {"taint_key": "not a key"}, {"max_fraction": 0.0},
                {"max_fraction": 1.5}, {"timeout_seconds": float("nan")}, {"max_attempts": 0}):
        with pytest.raises(ValueError, match=f"actions {next(iter(bad))}"):
            ActionSettings(**bad)


def test_the_control_plane_taints_a_fatal_node_and_says_so_when_an_operator_untaints_it(api, tmp_path):
    settings = ActionSettings(kubernetes=True, kubeconfig=str(_kubeconfig(tmp_path, api.port)), recheck_seconds=0.2)
    plane = build_server(Settings.insecure_loopback(tmp_path / "state", scorer=NullScorer(),
                                                    decision_flush_seconds=0.0, actions=settings))
    plane.start()
    try:
        now = time.time_ns()
        plane.nodes.record_fatal(FatalEvent("gpu06", now, "xid", "Xid 48 on GPU 2 (double-bit ECC)", now))
        deadline = time.monotonic() + 20
        while plane.actions.counts()["taken"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plane.actions.rows["gpu06"].state == "taken"
        assert any(t["key"] == KEY for t in api.nodes["gpu06"]["spec"]["taints"])
        with api.lock:     # an operator removes the taint (kubectl taint nodes gpu06 KEY-)
            api.nodes["gpu06"]["spec"]["taints"] = [t for t in api.nodes["gpu06"]["spec"]["taints"] if t["key"] != KEY]
        while plane.actions.rows["gpu06"].state != "released" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plane.actions.rows["gpu06"].state == "released"
        (cond,) = [c for c in api.nodes["gpu06"]["status"]["conditions"] if c["type"] == CONDITION_TYPE]
        assert (cond["status"], cond["reason"]) == ("False", "TaintRemoved")
        validate_node(api.nodes["gpu06"])
        assert plane.registry.get_sample_value("foreshock_node_action_calls_total", {
            "backend": "kubernetes", "call": "take", "result": "ok"}) == 1
        assert_rbac_allows(api.requests)      # the take, the rechecks and the condition's reset
    finally:
        plane.stop(0)
    kinds = [r["kind"] for r in read_decisions(tmp_path / "state" / "decisions").to_pylist()]
    assert kinds.count("node_action_taken") == 1 and kinds.count("node_action_released") == 1
