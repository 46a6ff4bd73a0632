"""A jobs coordinator (ControlPlane, insecure on loopback) in a process of its own that kills itself with
SIGKILL in the middle of its first directive, for tests/test_service_coordinator.py:

    python tests/coordinator_child.py STATE LEASE after_commit|before_commit|after_job_ack

after_commit: the shard's batch and the directive it led to are committed (and announced to watchers),
and the process dies before the shard hears the ack. before_commit: it dies once the policy has issued
the directive inside the batch's transaction, which is never committed. after_job_ack: it dies once the
job's ACCEPTED ack of the directive is committed, before the job hears the answer. It prints
`listening on 127.0.0.1:PORT` once it serves, then `leader` once it holds the lease.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from foreshock.service import coordinator as coordinator_mod
from foreshock.service import jobs as jobs_mod
from foreshock.service import policy as policy_mod
from foreshock.service.coordinator import CoordinatorSettings
from foreshock.service.server import Settings, build_server


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main(state: str, lease: str, when: str) -> None:
    if when == "after_commit":
        receive = coordinator_mod.Coordinator.receive

        def receive_then_die(self, *args, **kwargs):
            before = len(self.store.directives())
            acked = receive(self, *args, **kwargs)
            if len(self.store.directives()) > before:
                die()
            return acked
        coordinator_mod.Coordinator.receive = receive_then_die
    elif when == "before_commit":
        evaluate = policy_mod.EvacuationPolicy.evaluate

        def evaluate_then_die(self, *args, **kwargs):
            issued = evaluate(self, *args, **kwargs)
            if issued:
                die()
            return issued
        policy_mod.EvacuationPolicy.evaluate = evaluate_then_die
    elif when == "after_job_ack":
        ack = jobs_mod.JobDirectory.ack

        def ack_then_die(self, *args, **kwargs):
            ack(self, *args, **kwargs)
            die()
        jobs_mod.JobDirectory.ack = ack_then_die
    else:
        raise SystemExit(f"unknown moment {when!r}")
    plane = build_server(Settings.insecure_loopback(state, coordinator=CoordinatorSettings(lease, lock_poll_seconds=0.1),
                                                    threshold=0.5, policy={"stale_seconds": 3600.0}))
    port = plane.start()
    print(f"listening on 127.0.0.1:{port}", flush=True)
    while not plane.leading:
        time.sleep(0.02)
    print("leader", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
