"""Node actions without a scheduler: the breaker's cap over the fleet, and the `[serve]` settings that
turn the actions on (declared once in service/actions.py, range-checked by `foreshock serve`'s own
settings resolution). The calls themselves are tested against a real Slurm
(test_service_actions_slurm.py) and the Kubernetes API's schemas (test_service_actions_kubernetes.py)."""

from __future__ import annotations

import pytest

from foreshock import config
from foreshock.service import command
from foreshock.service.actions import ActionSettings, NodeActions
from foreshock.service.decisions import DecisionLog
from foreshock.service.nodes import NodeBook
from foreshock.service.store import StateStore


@pytest.mark.parametrize("fleet, fraction, cap", [
    (40, 0.05, 2), (39, 0.05, 1), (10, 0.05, 1), (1, 0.05, 1), (1024, 0.05, 51), (100, 0.25, 25), (20, 1.0, 20)])
def test_the_cap_is_a_share_of_the_nodes_the_service_knows_and_at_least_one(tmp_path, fleet, fraction, cap):
    nodes = NodeBook()
    for i in range(fleet):
        nodes.seen(f"n{i}", 0)
    store = StateStore(tmp_path / "state.sqlite3")
    try:
        actions = NodeActions(ActionSettings(max_fraction=fraction), [], store, nodes,
                              DecisionLog(tmp_path / "decisions", fsync=False))
        assert (actions.fleet(), actions.limit()) == (fleet, cap)
        fixed = NodeActions(ActionSettings(max_fraction=fraction, fleet_size=2000), [], store, nodes,
                            DecisionLog(tmp_path / "decisions2", fsync=False))
        assert fixed.fleet() == 2000
    finally:
        store.close()


def _serve(env: dict[str, str], file_data=None) -> dict:
    return config.resolve("serve", command.DEFAULTS, file_data=file_data, env=env, checks=command.CHECKS)


def test_actions_are_off_by_default_and_every_serve_key_maps_onto_their_settings():
    cfg = _serve({})
    settings = ActionSettings(**{name: cfg[key] for key, name in command.ACTION_KEYS.items()})
    assert settings == ActionSettings() and not settings.enabled
    assert set(command.ACTION_KEYS.values()) == {f for f in ActionSettings.__dataclass_fields__}
    cfg = _serve({"FORESHOCK_SERVE_SLURM_DRAIN": "true", "FORESHOCK_SERVE_ACTION_MAX_FRACTION": "0.1"},
                 {"serve": {"slurm_conf": "/etc/slurm/slurm.conf", "action_fleet_size": 512}})
    settings = ActionSettings(**{name: cfg[key] for key, name in command.ACTION_KEYS.items()})
    assert (settings.slurm, settings.max_fraction, settings.slurm_conf, settings.fleet_size) == \
        (True, 0.1, "/etc/slurm/slurm.conf", 512)


@pytest.mark.parametrize("key, value, words", [
    ("ACTION_MAX_FRACTION", "0", "must be in (0, 1]"),
    ("ACTION_MAX_FRACTION", "1.5", "must be in (0, 1]"),
    ("ACTION_MAX_FRACTION", "nan", "finite"),
    ("ACTION_TIMEOUT_SECONDS", "120", "must be in (0, 60] seconds"),
    ("ACTION_MAX_ATTEMPTS", "0", "must be in [1, 20]"),
    ("ACTION_FLEET_SIZE", "-1", "must be >= 0"),
    ("KUBERNETES_TAINT_EFFECT", "Evict", "NoSchedule, PreferNoSchedule, NoExecute"),
    ("KUBERNETES_TAINT_KEY", "two words", "label key"),
    ("SLURM_DRAIN", "maybe", "expected a boolean"),
])
def test_a_setting_out_of_range_names_its_key_and_origin(key, value, words):
    with pytest.raises(config.ConfigError) as info:
        _serve({f"FORESHOCK_SERVE_{key}": value})
    assert key.lower() in str(info.value) and f"FORESHOCK_SERVE_{key}" in str(info.value)
    assert words in str(info.value)


def test_serve_with_kubernetes_taint_and_no_credentials_stops_at_start_saying_why(tmp_path):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORESHOCK_", "KUBERNETES_SERVICE"))}
    proc = subprocess.run(
        [sys.executable, "-m", "foreshock.cli", "serve", "--insecure", "--listen", "127.0.0.1:0", "--metrics-listen",
         "", "--no-model", "--state", str(tmp_path / "state"), "--kubernetes-taint"],
        capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "kubernetes actions: cannot configure the client from the in-cluster service account" in proc.stderr


def test_a_held_node_is_admitted_when_the_fleet_grows_and_the_rows_survive_a_restart(tmp_path):
    """The bookkeeping alone (no backend configured: an admitted node is taken at its first attempt)."""
    from foreshock.service.actions import Due
    S = 1_000_000_000
    nodes = NodeBook()
    for i in range(20):
        nodes.seen(f"n{i:02d}", 0)
    store = StateStore(tmp_path / "state.sqlite3")
    log = DecisionLog(tmp_path / "decisions", fsync=False)
    actions = NodeActions(ActionSettings(), [], store, nodes, log, clock=lambda: 100 * S)
    due = {"n01": Due("fatal Xid 79", 90 * S, True), "n02": Due("risk 0.9 above threshold 0.5", 95 * S, False)}
    actions.sync(due, 100 * S)
    assert (actions.limit(), actions.rows["n01"].state, actions.rows["n02"].state) == (1, "pending", "held")
    actions.run_once()
    assert actions.rows["n01"].state == "taken" and actions.rows["n02"].state == "held"
    actions.sync(due, 101 * S)                     # still due: nothing new, nothing twice
    assert actions.stats.held == 1
    for i in range(20, 40):                        # collectors of 20 more nodes report: the cap is 2
        nodes.seen(f"n{i:02d}", 0)
    actions.run_once()
    assert actions.rows["n02"].state == "taken" and actions.in_slots() == 2
    restarted = NodeActions(ActionSettings(), [], store, NodeBook(), log)
    assert restarted.counts()["taken"] == 2 and restarted.rows["n01"].reason == "fatal Xid 79"
    assert restarted.fleet() == 2 and restarted.limit() == 1   # until the collectors are back
    store.close()


def test_slurm_drains_without_scontrol_or_with_a_missing_slurm_conf_stop_the_service_at_start(tmp_path):
    from foreshock.service.scoring import NullScorer
    from foreshock.service.server import Settings, SettingsError, build_server
    for actions, words in ((ActionSettings(slurm=True, scontrol=str(tmp_path / "no-scontrol")), "not an executable"),
                           (ActionSettings(slurm=True, scontrol="sh", slurm_conf=str(tmp_path / "slurm.conf")),
                            "is not a file")):
        with pytest.raises(SettingsError, match=words):
            build_server(Settings.insecure_loopback(tmp_path / "state", scorer=NullScorer(), actions=actions))
