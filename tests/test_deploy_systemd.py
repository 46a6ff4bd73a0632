"""deploy/systemd: the unit files pass `systemd-analyze verify` and `systemd-analyze security --offline`.

verify loads each unit the way systemd does; it reports unknown keys and unparsable values as warnings
on stderr and still exits 0, so the test fails on any line it prints about our unit as well as on its
exit status. ExecStart is pointed at this checkout's real `foreshock` entry point (verify checks that the
binary exists), in a copy of the unit in a temporary directory. A second test breaks a copy on purpose
to prove the check catches it.
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SYSTEMD = REPO / "deploy" / "systemd"
UNITS = ("foreshock-collect.service", "foreshock-serve.service")
MAINTENANCE = "foreshock-archive-maintenance.service"   # a oneshot its timer starts, beside the two daemons
TIMER = "foreshock-archive-maintenance.timer"
INSTALLED_BINARY = "/opt/foreshock/venv/bin/foreshock"
LOCAL_BINARY = REPO / ".venv" / "bin" / "foreshock"
# systemd-analyze security rates exposure 0 (locked down) to 10 (unprotected); "OK" is below 4.
MAX_EXPOSURE = {"foreshock-collect.service": 2.5, "foreshock-serve.service": 1.8, MAINTENANCE: 1.0}

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze is not installed (tests/setup.sh installs it)")


def render(unit: str, tmp_path: Path, *replacements: tuple[str, str]) -> Path:
    text = (SYSTEMD / unit).read_text()
    assert INSTALLED_BINARY in text, f"{unit} no longer runs {INSTALLED_BINARY}"
    text = text.replace(INSTALLED_BINARY, str(LOCAL_BINARY))
    for old, new in replacements:
        assert old in text, f"{old!r} not in {unit}"
        text = text.replace(old, new)
    path = tmp_path / unit
    path.write_text(text)
    return path


def verify(path: Path) -> tuple[int, list[str]]:
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=path.parent)
    lines = (proc.stdout + proc.stderr).splitlines()
    # Other units on this machine may draw warnings of their own; only ours count.
    ours = [line for line in lines if path.name in line or str(path) in line]
    return proc.returncode, ours


def unit_sections(unit: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # systemd keys are case-sensitive
    # systemd allows repeated keys; configparser keeps the last, which is enough for these checks.
    parser.read_string((SYSTEMD / unit).read_text())
    return parser


@pytest.mark.parametrize("unit", UNITS + (MAINTENANCE,))
def test_unit_verifies_cleanly(unit, tmp_path):
    assert LOCAL_BINARY.exists(), "the foreshock entry point is not installed in .venv"
    rc, ours = verify(render(unit, tmp_path))
    assert rc == 0 and not ours, "\n".join(ours)


@pytest.mark.parametrize("broken", [
    ("ProtectSystem=strict", "ProtectSystem=stirct"),          # a value systemd cannot parse
    ("Restart=always", "Restrat=always"),                      # an unknown key
    ("RestrictAddressFamilies=AF_UNIX", "RestrictAddressFamilies=AF_UNIXX"),
])
def test_verify_catches_a_broken_unit(broken, tmp_path):
    rc, ours = verify(render("foreshock-collect.service", tmp_path, broken))
    assert rc != 0 or ours, f"systemd-analyze verify did not notice {broken[1]!r}"


def test_verify_catches_a_missing_binary(tmp_path):
    path = tmp_path / "foreshock-serve.service"
    path.write_text((SYSTEMD / "foreshock-serve.service").read_text())  # ExecStart left at /opt/...
    if Path(INSTALLED_BINARY).exists():
        pytest.skip(f"{INSTALLED_BINARY} exists on this machine")
    rc, ours = verify(path)
    assert rc != 0 and any("not executable" in line for line in ours), ours


@pytest.mark.parametrize("unit", UNITS + (MAINTENANCE,))
def test_security_exposure_is_low(unit, tmp_path):
    path = render(unit, tmp_path)
    proc = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", proc.stdout)
    assert match, proc.stdout[-2000:] + proc.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE[unit], proc.stdout


def test_collector_gets_its_devices_and_nothing_else():
    text = (SYSTEMD / "foreshock-collect.service").read_text()
    devices = re.findall(r"^DeviceAllow=(.+)$", text, re.M)
    assert sorted(devices) == ["/dev/kmsg r", "char-nvidia-caps r", "char-nvidia-frontend rw", "char-nvidiactl rw"]
    service = unit_sections("foreshock-collect.service")["Service"]
    assert service["DevicePolicy"] == "closed"
    assert service["CapabilityBoundingSet"] == "CAP_SYSLOG"
    assert service["ProtectSystem"] == "strict" and service["ProtectKernelTunables"] == "yes"  # /sys read-only
    assert "ProtectKernelLogs" not in service, "ProtectKernelLogs would hide /dev/kmsg from the collector"
    assert "PrivateDevices" not in service, "PrivateDevices would hide /dev/nvidia* from the collector"


@pytest.mark.parametrize("unit", UNITS)
def test_unit_sandbox_and_restart(unit):
    service = unit_sections(unit)["Service"]
    for key, value in {"DynamicUser": "yes", "NoNewPrivileges": "yes", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "Restart": "always"}.items():
        assert service.get(key) == value, f"{unit}: {key}={service.get(key)}"
    state = "/var/lib/" + service["StateDirectory"]
    assert service["ReadWritePaths"] == state, "the only writable path is the unit's own state directory"
    assert service["EnvironmentFile"].startswith("-/etc/foreshock/")
    env = re.findall(r"^Environment=(.+)$", (SYSTEMD / unit).read_text(), re.M)
    assert env[0] == "FORESHOCK_CONFIG=/etc/foreshock/foreshock.toml"
    if "CacheDirectory" in service:   # the serve unit's compiled-kernel cache: systemd's own cache dir
        assert env[1:] == ["NUMBA_CACHE_DIR=/var/cache/" + service["CacheDirectory"]]
    else:
        assert env[1:] == []
    assert set(service["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}


def test_the_timer_verifies_with_the_service_it_starts(tmp_path):
    render(MAINTENANCE, tmp_path)
    timer = tmp_path / TIMER
    timer.write_text((SYSTEMD / TIMER).read_text())
    rc, ours = verify(timer)
    assert rc == 0 and not ours, "\n".join(ours)
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str
    parser.read_string(timer.read_text())
    assert "Unit" not in parser["Timer"], "the timer starts the service of its own name"
    assert parser["Timer"]["Persistent"] == "true" and parser["Install"]["WantedBy"] == "timers.target"


def test_archive_maintenance_is_the_services_user_with_only_the_archive_writable():
    """Compact, then prune, as foreshock-serve.service's own dynamic user (the files are that user's),
    with the archive the one writable path, no network and no capabilities."""
    text = (SYSTEMD / MAINTENANCE).read_text()
    service = unit_sections(MAINTENANCE)["Service"]
    assert re.findall(r"^ExecStart=(.+)$", text, re.M) == [f"{INSTALLED_BINARY} archive compact",
                                                           f"{INSTALLED_BINARY} archive prune"]
    assert service["Type"] == "oneshot" and "Restart" not in service
    serve = unit_sections("foreshock-serve.service")["Service"]
    assert serve["DynamicUser"] == "yes" and "User" not in serve   # its user is named after the unit
    for key, value in {"DynamicUser": "yes", "User": "foreshock-serve", "Group": "foreshock-serve",
                       "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "PrivateNetwork": "yes", "CapabilityBoundingSet": "",
                       "RestrictAddressFamilies": "AF_UNIX"}.items():
        assert service.get(key) == value, f"{key}={service.get(key)}"
    assert service["StateDirectory"] == "foreshock/archive"
    assert service["ReadWritePaths"] == "/var/lib/foreshock/archive" == service["WorkingDirectory"]
    env = re.findall(r"^Environment=(.+)$", text, re.M)
    assert env == ["FORESHOCK_CONFIG=/etc/foreshock/foreshock.toml"]
    # the path the service is told to write, in the example configuration and the drop-in of operations.md
    assert 'archive = "/var/lib/foreshock/archive"' in (SYSTEMD / "foreshock.toml").read_text()
    assert "StateDirectory=foreshock/archive" in (REPO / "docs" / "operations.md").read_text()
