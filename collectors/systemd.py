"""Source `systemd`: the state of the NVLink fabric's services (nvidia-fabricmanager, nvidia-imex) into `systemd_unit`.

Reads `systemctl show --property=Id,LoadState,ActiveState,SubState,Result,NRestarts -- UNIT...`, whose
output format is systemctl(1)'s `show`: for each unit named, one `Property=value` line per property
(org.freedesktop.systemd1.Unit and .Service, systemd.directives(7)), the units' blocks separated by an
empty line. A unit that is not installed still has a block, with `LoadState=not-found`: it gets no row
(no data, not an error). `NRestarts` exists from systemd 235 on; older ones omit it and it is null.

Which units and why, and who may judge them (IMEX only while a compute domain uses the node):
foreshock/fabric.py, FABRIC_SERVICES. This source only records the state.

systemctl runs at most every `interval_s` (default 10 s, not every sweep: a service's state changes
seldom and a fork per second would cost more than every other source), under a deadline (`timeout_s`,
default 2 s) after which it is killed and the poll counted as an error; its output is read up to
`MAX_OUTPUT` bytes. Outcomes: no systemctl, or systemd not running as init (a container) -> hardware
absent, said once, never asked again; none of the units installed -> absent for now, asked again at
the next poll; a non-zero exit, a deadline passed or output that does not parse -> an error counted and
logged with the command, and the next poll tries again.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time

import pyarrow as pa

from foreshock import fabric
from foreshock import schema as sch

from .base import ParseError, Source

PROPERTIES = ("Id", "LoadState", "ActiveState", "SubState", "Result", "NRestarts")
# systemd property -> systemd_unit column
COLUMNS = {"LoadState": "load_state", "ActiveState": "active_state", "SubState": "sub_state",
           "Result": "result", "NRestarts": "n_restarts"}
MAX_OUTPUT = 64 * 1024
# systemctl's words when there is no systemd to ask (PID 1 is something else; no bus).
_NO_SYSTEMD = ("not been booted with systemd", "Failed to connect to bus", "System has not been booted")


def parse_systemctl_show(text: str) -> list[dict[str, str]]:
    """`systemctl show` output (blocks of `Property=value` lines, blank-line separated) -> one dict per unit.

    A non-empty line without `=` is a ParseError quoting it; a block without `Id` too (every block of
    this source's command has one)."""
    units, block = [], {}
    for line in text.splitlines():
        if not line.strip():
            if block:
                units.append(block)
                block = {}
            continue
        key, sep, value = line.partition("=")
        if not sep or not key or not key.isalnum():
            raise ParseError(f"systemctl show line is not Property=value: {line[:80]!r}")
        block[key] = value
    if block:
        units.append(block)
    for b in units:
        if not b.get("Id"):
            raise ParseError(f"systemctl show block without Id: {sorted(b)[:6]}")
    return units


def unit_row(props: dict[str, str]) -> dict | None:
    """One unit's properties -> a `systemd_unit` row (without ts/node); None for a unit not installed."""
    if props.get("LoadState") == "not-found":
        return None
    row: dict = {"unit": props["Id"]}
    for prop, column in COLUMNS.items():
        value = props.get(prop) or None
        if column == "n_restarts" and value is not None:
            if not value.isdigit() or int(value) >= 1 << 32:
                raise ParseError(f"{props['Id']}: NRestarts is not a count: {value[:40]!r}")
            value = int(value)
        row[column] = value
    return row


def run_bounded(argv: list[str], timeout_s: float, limit: int = MAX_OUTPUT) -> tuple[int, str, str]:
    """Run a command with a deadline, keeping at most `limit` bytes of each output (the rest is read
    and dropped); returns (exit status, stdout, stderr). Raises subprocess.TimeoutExpired after killing
    it, OSError when it cannot start, ParseError when stdout was cut."""
    deadline = time.monotonic() + timeout_s
    # Its own process group, so that the deadline kills whatever it started too.
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env={**os.environ, "LC_ALL": "C", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"},
                          start_new_session=True) as proc:
        out, err, cut = bytearray(), bytearray(), False
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    _kill(proc)
                    raise subprocess.TimeoutExpired(argv, timeout_s)
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 8192)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf = key.data
                    room = limit - len(buf)
                    if len(chunk) > room and buf is out:
                        cut = True
                    buf += chunk[:max(room, 0)]
        try:
            rc = proc.wait(max(deadline - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise
    if cut:
        raise ParseError(f"{' '.join(argv[:2])}: output longer than {limit} bytes")
    return rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class SystemdSource(Source):
    name = "systemd"
    tables = ("systemd_unit",)

    def __init__(self, node: str, *, units: tuple[str, ...] = tuple(fabric.FABRIC_SERVICES),
                 systemctl: str = "systemctl", interval_s: float = 10.0, timeout_s: float = 2.0):
        super().__init__(node)
        self.units = tuple(units)
        self.systemctl = systemctl
        self.interval_ns = int(interval_s * 1e9)
        self.timeout_s = timeout_s
        self._next_ns: int | None = None
        self._unavailable = False

    def _argv(self) -> list[str]:
        return [self.systemctl, "show", "--no-pager", "--property=" + ",".join(PROPERTIES), "--", *self.units]

    def sweep(self, ts_ns: int) -> dict[str, pa.Table]:
        if self._unavailable or not self.units:
            return {}
        if self._next_ns is not None and ts_ns < self._next_ns:
            return {}
        self._next_ns = ts_ns + self.interval_ns
        what = f"{self.systemctl} show {' '.join(self.units)}"
        try:
            rc, out, err = run_bounded(self._argv(), self.timeout_s)
        except FileNotFoundError:
            self._unavailable = True
            return self.hardware_absent("no %s: the fabric services' state is not read", self.systemctl)
        except subprocess.TimeoutExpired:
            self.error(what, f"no answer within {self.timeout_s:g} s (killed)")
            return {}
        except (OSError, ParseError) as exc:
            self.error(what, exc)
            return {}
        if rc != 0:
            if any(s in err for s in _NO_SYSTEMD):
                self._unavailable = True
                return self.hardware_absent("systemd is not running here (%s)", err.strip().splitlines()[0][:120])
            self.error(what, f"exit status {rc}: {err.strip()[:200]!r}")
            return {}
        try:
            rows = [r for r in map(unit_row, parse_systemctl_show(out)) if r is not None]
        except ParseError as exc:
            self.error(what, exc)
            return {}
        if not rows:
            return self.hardware_absent("none of %s is installed", ", ".join(self.units))
        self.absent = False
        for r in rows:
            r.update(ts=ts_ns, node=self.node)
        return {"systemd_unit": sch.to_table("systemd_unit", rows)}
