"""The local process pool of offline feature building (predictor/executors.py ProcessExecutor): its
workers do not outlive the process that started them, however that process ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from support import wait_until

PARENT = textwrap.dedent("""
    import os, sys, time
    from foreshock.predictor import executors
    ex = executors.ProcessExecutor(2)
    pids = sorted(set(ex.map(os.getpid, [()] * 8)))
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"     # a zombie has ended, only its entry waits
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_pool_workers_end_with_a_parent_killed_without_cleanup(sig):
    # stderr kept here: the killed parent's multiprocessing resource tracker outlives it, removes the
    # semaphores of its pool's queues and says so ("leaked semaphore objects"), as it should for a
    # process killed without cleanup; the suite's own output stays for warnings that are not meant.
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert pids and os.getpid() not in pids and all(_alive(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        assert wait_until(lambda: not any(_alive(p) for p in pids), 20), [p for p in pids if _alive(p)]
    finally:
        parent.kill()
        parent.communicate(timeout=30)
