"""One rank of a job, as the migrator's ServiceClient runs in it, in a process of its own, for
tests/test_e2e_sharded.py:

    python tests/e2e_rank.py SERVICE RANK NODE0,NODE1,... SPARE0,SPARE1,...

SERVICE is the migrator's FORESHOCK_SERVICE (the coordinator, then its standby). Rank 0 registers the
job (rank r on NODEr); every rank watches its directives and prints `directive ID FROM TO` once per
directive id (a directive sent again after a reconnect is printed once). Rank 0 acknowledges each
one ACCEPTED then COMPLETED, as a finished switch does (the control plane then has the rank on the
spare), so the job may be evacuated again. It runs until stdin closes.
"""

from __future__ import annotations

import sys
import threading
import time

from foreshock.migrator import Ack, AckPhase, MigratorConfig, ServiceClient
from foreshock.migrator.directives import DirectiveBook


def main(service: str, rank: str, nodes: str, spares: str) -> None:
    r, placement = int(rank), dict(enumerate(nodes.split(",")))
    config = MigratorConfig.from_env({}, job_id="e2e", rank=r, world_size=len(placement), node=placement[r],
                                     store="127.0.0.1:1", service=service, rpc_timeout_s=2.0)
    client = ServiceClient(config, backoff_initial_s=0.05, backoff_max_s=0.5)
    if r == 0:
        client.register(placement, spares.split(","), current_step=1)
    client.watch(r)
    print("watching", flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    book = DirectiveBook()
    while not done.wait(0.05):
        for d in client.poll():
            if book.offer(d) and not d.cancelled:   # cancelled: finished (COMPLETED included), withdrawn
                print(f"directive {d.directive_id} {d.from_node} {d.to_node}", flush=True)
                if r == 0:
                    client.ack(Ack(d.directive_id, r, AckPhase.ACCEPTED))
                    time.sleep(0.1)
                    client.ack(Ack(d.directive_id, r, AckPhase.COMPLETED))
    client.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
