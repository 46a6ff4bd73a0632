"""Helpers the tests share (conftest.py puts this folder on the import path): waiting on a condition
that a real process or thread brings about, a clock the test sets, and `foreshock serve` as a real
process. Fixtures the tests share (a control plane on a loopback port) are in conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request


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
