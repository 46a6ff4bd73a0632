"""Helpers the tests share (conftest.py puts this folder on the import path): waiting on a condition
that a real process or thread brings about."""

from __future__ import annotations

import time


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
