"""The systemd source: fabric services' state through a fake `systemctl` on PATH, and this machine's own."""

from __future__ import annotations

import shutil

import pytest

from foreshock import fabric
from foreshock.collectors.base import ParseError
from foreshock.collectors.registry import SourceConfig, build_sources
from foreshock.collectors.systemd import SystemdSource, parse_systemctl_show, unit_row
from support import UNIT_FAILED, UNIT_NOT_FOUND, UNIT_RUNNING, FakeSystemctl

S = 1_000_000_000
FM, IMEX = fabric.FABRIC_MANAGER, fabric.IMEX

RUNNING, FAILED, NOT_FOUND = UNIT_RUNNING, UNIT_FAILED, UNIT_NOT_FOUND


@pytest.fixture
def systemctl(tmp_path):
    return FakeSystemctl(tmp_path / "bin")


def _rows(src, ts):
    out = src.sweep(ts)
    return out["systemd_unit"].to_pylist() if out else None


def test_an_installed_unit_is_a_row_and_one_not_installed_is_none(systemctl):
    systemctl.unit(FM, RUNNING)
    src = SystemdSource("hgx-01", systemctl=systemctl.path)
    (row,) = _rows(src, 0)
    assert {k: row[k] for k in ("node", "unit", "load_state", "active_state", "sub_state", "result", "n_restarts")} \
        == {"node": "hgx-01", "unit": FM, "load_state": "loaded", "active_state": "active", "sub_state": "running",
            "result": "success", "n_restarts": 0}
    assert systemctl.calls() == [f"show --no-pager --property=Id,LoadState,ActiveState,SubState,Result,NRestarts "
                                 f"-- {FM} {IMEX}"]
    assert src.errors == 0 and not src.absent


def test_a_failed_fabric_manager_and_its_restarts(systemctl):
    systemctl.unit(FM, FAILED)
    systemctl.unit(IMEX, RUNNING)
    rows = _rows(SystemdSource("n", systemctl=systemctl.path), 0)
    assert [(r["unit"], r["active_state"], r["result"], r["n_restarts"]) for r in rows] == [
        (FM, "failed", "exit-code", 5), (IMEX, "active", "success", 0)]


def test_systemctl_runs_once_per_interval_not_every_sweep(systemctl):
    systemctl.unit(FM, RUNNING)
    src = SystemdSource("n", systemctl=systemctl.path, interval_s=10)
    assert _rows(src, 0) is not None
    assert _rows(src, 1 * S) is None and _rows(src, 9 * S) is None
    assert _rows(src, 10 * S) is not None
    assert len(systemctl.calls()) == 2


def test_no_fabric_services_is_absent_for_now_and_asked_again(systemctl):
    src = SystemdSource("n", systemctl=systemctl.path, interval_s=10)
    assert src.sweep(0) == {} and src.absent and src.errors == 0
    systemctl.unit(IMEX, RUNNING)  # installed later
    (row,) = _rows(src, 10 * S)
    assert row["unit"] == IMEX and not src.absent


def test_without_systemd_as_init_the_source_is_absent_and_stops_asking(systemctl):
    systemctl.behaviour('echo "System has not been booted with systemd as init system (PID 1). Can\'t operate." >&2\n'
                        'echo "Failed to connect to bus: Host is down" >&2\nexit 1\n')
    src = SystemdSource("n", systemctl=systemctl.path, interval_s=10)
    assert src.sweep(0) == {} and src.sweep(10 * S) == {}
    assert src.absent and src.errors == 0 and len(systemctl.calls()) == 1


def test_no_systemctl_is_absent(tmp_path):
    src = SystemdSource("n", systemctl=str(tmp_path / "no-such-systemctl"))
    assert src.sweep(0) == {} and src.absent and src.errors == 0


def test_a_systemctl_that_hangs_is_killed_at_the_deadline_and_counted(systemctl):
    systemctl.behaviour("sleep 30\n")
    systemctl.unit(FM, RUNNING)
    src = SystemdSource("n", systemctl=systemctl.path, interval_s=10, timeout_s=0.3)
    assert src.sweep(0) == {} and src.errors == 1 and not src.absent
    systemctl.behaviour("")
    assert _rows(src, 10 * S)[0]["unit"] == FM  # the next poll tries again


@pytest.mark.parametrize("behaviour,message", [
    ("echo 'Failed to get properties: Access denied' >&2\nexit 1\n", "exit status 1"),
    ("echo 'this is not systemctl output'\nexit 0\n", "Property=value"),
    ("head -c 200000 /dev/zero | tr '\\\\0' 'x'\nexit 0\n", "longer than"),
])
def test_a_failed_or_garbled_answer_is_an_error_naming_the_command(systemctl, caplog, behaviour, message):
    systemctl.behaviour(behaviour)
    src = SystemdSource("n", systemctl=systemctl.path)
    with caplog.at_level("WARNING", "foreshock.collectors"):
        assert src.sweep(0) == {}
    assert src.errors == 1 and not src.absent
    assert message in caplog.text and "show nvidia-fabricmanager.service" in caplog.text


def test_parse_systemctl_show():
    text = (RUNNING.format(unit=FM) + "\n" + "Id=old.service\nLoadState=loaded\nActiveState=active\n"
            "SubState=running\nResult=success\n")  # a systemd older than 235: no NRestarts
    a, b = map(unit_row, parse_systemctl_show(text))
    assert a["n_restarts"] == 0 and b["unit"] == "old.service" and b["n_restarts"] is None
    assert unit_row(parse_systemctl_show(NOT_FOUND.format(unit=IMEX))[0]) is None
    with pytest.raises(ParseError, match="NRestarts"):
        unit_row({"Id": FM, "LoadState": "loaded", "NRestarts": "-1"})
    with pytest.raises(ParseError, match="without Id"):
        parse_systemctl_show("LoadState=loaded\n")
    assert parse_systemctl_show("") == []


def test_this_machines_systemctl_gives_rows_or_absent_never_an_error():
    if shutil.which("systemctl") is None:
        pytest.skip("no systemctl here")
    src = SystemdSource("n")
    out = src.sweep(0)
    assert src.errors == 0
    assert src.absent or all(r["unit"] in (FM, IMEX) for r in out["systemd_unit"].to_pylist())


def test_the_source_is_registered_by_name():
    (src,) = build_sources(["systemd"], SourceConfig(node="n"))
    assert isinstance(src, SystemdSource) and src.tables == ("systemd_unit",)
