"""Helpers the tests share (conftest.py puts this folder on the import path): waiting on a condition
that a real process or thread brings about, a clock the test sets, a script's stop timed from its
SIGTERM, `foreshock serve` as a real process, a stand-in for `systemctl` that the systemd source runs,
a free loopback port and a two-shard map. Fixtures the tests share (a control plane on a loopback
port) are in conftest.py."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request


# Ports for services a test starts after choosing them: below the kernel's ephemeral range, where no
# outgoing connection and no bind to port 0 lands in the meantime, and a separate stretch per
# pytest-xdist worker, so two workers never hand out the same port.
PORTS_BELOW_EPHEMERAL = 12_000
_port_cursor: list[int] = []


def _port_stretch() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = max(1024, ephemeral_low - PORTS_BELOW_EPHEMERAL)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = (ephemeral_low - low) // workers
    return range(low + index % workers * width, low + (index % workers + 1) * width)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, from this worker's stretch, never the one
    handed out just before (its service may not have bound it yet)."""
    stretch = _port_stretch()
    if not _port_cursor:
        _port_cursor.append(stretch.start + os.getpid() % len(stretch))
    for _ in range(len(stretch)):
        port = stretch.start + (_port_cursor[0] - stretch.start + 1) % len(stretch)
        _port_cursor[0] = port
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {stretch.start}-{stretch.stop - 1}")


def two_shard_map(a: str, b: str, a_leaves=("leaf-01",), b_leaves=("leaf-02",)) -> str:
    """A shard map (service/shardmap.py) of shards a and b at addresses a and b, owning these leaves."""
    def leaves(xs):
        return ", ".join(f'"{x}"' for x in xs)
    return (f'[shards.a]\naddress = "{a}"\nleaves = [{leaves(a_leaves)}]\n'
            f'[shards.b]\naddress = "{b}"\nleaves = [{leaves(b_leaves)}]\n')


def stop_stuck_script(script: str, *args: str, ready) -> tuple[int, str, float]:
    """Run `python -c script args`, wait for its first stdout line to satisfy `ready`, SIGTERM it, and
    wait at most 60 s for it to exit by itself: (exit status, its stderr, seconds from the signal)."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert ready(line), f"not ready: {line!r}"
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def wait_until(pred, timeout: float = 15.0, step: float = 0.05):
    """Poll `pred` every `step` seconds until it returns something true (returned) or `timeout` seconds
    pass (False): the deadline is the test's, the time it took is no assertion of speed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(step)
    return False


class Clock:
    """A clock that stands still until the test moves it: calling it returns `now` (ns since the epoch)."""

    def __init__(self, now: int):
        self.now = now

    def __call__(self) -> int:
        return self.now


class Serve:
    """`foreshock serve` as a process, insecure on loopback, no model, with /metrics on a free port."""

    def __init__(self, state, *extra):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "foreshock.cli", "serve", "--insecure", "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--no-model", "--state", str(state), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise AssertionError(f"serve did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.banner = line
        self.address = line.split("listening on ")[1].split(",")[0].split(" ")[0]
        self.metrics = line.split("metrics on ")[1].split(" ")[0] if "metrics on " in line else None

    def metric(self, name: str, timeout: float = 10.0) -> float:
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=timeout).read().decode()
        got = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " ")]
        assert got, f"{name} not exported"
        return got[0]

    def ready(self) -> int:
        """GET /readyz's status: 200 serving (a coordinator: leading), 503 not."""
        try:
            return urllib.request.urlopen(f"http://{self.metrics}/readyz", timeout=10).status
        except urllib.error.HTTPError as exc:
            return exc.code

    def term(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# A stand-in for systemctl: `show ... -- UNIT...` prints each unit's block from $DIR/<unit>, or a
# not-found one; $DIR/behaviour, when there is one, runs first (an exit, a sleep).
FAKE_SYSTEMCTL = """#!/bin/sh
DIR="$(dirname "$0")"
echo "$*" >> "$DIR/calls"
[ -f "$DIR/behaviour" ] && . "$DIR/behaviour"
first=1
seen=0
for a in "$@"; do
  if [ "$seen" = 1 ]; then
    [ "$first" = 1 ] || echo
    first=0
    if [ -f "$DIR/$a" ]; then cat "$DIR/$a"; else sed "s/{unit}/$a/" "$DIR/not-found"; fi
  fi
  [ "$a" = "--" ] && seen=1
done
exit 0
"""
# `systemctl show` blocks, in systemctl's own order of the properties (not the order asked for).
UNIT_RUNNING = "Result=success\nNRestarts=0\nId={unit}\nLoadState=loaded\nActiveState=active\nSubState=running\n"
UNIT_FAILED = "Result=exit-code\nNRestarts=5\nId={unit}\nLoadState=loaded\nActiveState=failed\nSubState=failed\n"
UNIT_NOT_FOUND = "Result=success\nNRestarts=0\nId={unit}\nLoadState=not-found\nActiveState=inactive\nSubState=dead\n"


class FakeSystemctl:
    """FAKE_SYSTEMCTL in `directory` (created): `path` to run, `unit(name, block)` sets what a unit shows
    (`block` formatted with the unit's name; None: not installed), `behaviour(script)`, `calls()`."""

    def __init__(self, directory):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        exe = self.dir / "systemctl"
        exe.write_text(FAKE_SYSTEMCTL)
        (self.dir / "not-found").write_text(UNIT_NOT_FOUND)
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        self.path = str(exe)

    def unit(self, name: str, block: str | None) -> None:
        if block is None:
            (self.dir / name).unlink(missing_ok=True)
        else:
            (self.dir / name).write_text(block.format(unit=name))

    def behaviour(self, script: str) -> None:
        (self.dir / "behaviour").write_text(script)

    def calls(self) -> list[str]:
        p = self.dir / "calls"
        return p.read_text().splitlines() if p.exists() else []
