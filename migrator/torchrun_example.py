"""A plain DDP training script, run by torchrun, made evacuable with the lines marked `# foreshock`.

The unmarked lines are an ordinary torchrun script (it makes its own process group and its own
DistributedDataParallel wrapper); docs/migrator.md counts what the marked lines change. Run it:

    python -m torch.distributed.run --standalone --nproc-per-node=4 -m foreshock.migrator.torchrun_example

and a warm spare beside it, with the two values rank 0 logs at start (the store torchrun gives its
workers, MASTER_ADDR:MASTER_PORT, on a port chosen at start; the job id is torchrun's run id;
docs/migrator.md gives fixed commands with a c10d rendezvous endpoint):

    FORESHOCK_ROLE=spare FORESHOCK_JOB_ID=<run id> FORESHOCK_STORE=<host:port> FORESHOCK_NODE=<node> \\
        python -m foreshock.migrator.torchrun_example

FORESHOCK_EXAMPLE_STEPS (default 200) and FORESHOCK_EXAMPLE_STEP_SLEEP (seconds, default 0.02) set
its length; FORESHOCK_EXAMPLE_OUT, a folder, makes every
process write what it did there (pid, the steps it ran with their losses, a SHA-256 of the final
parameters), which is how the tests read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from foreshock.migrator import Migrator, init_process_group                  # foreshock


class DataPosition:
    def __init__(self) -> None:
        self.next_step = 0

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = int(state["next_step"])


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 1_009 + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def main() -> None:
    steps = int(os.environ.get("FORESHOCK_EXAMPLE_STEPS", "200"))
    pause = float(os.environ.get("FORESHOCK_EXAMPLE_STEP_SLEEP", "0.02"))
    torch.set_num_threads(1)
    init_process_group("gloo")                                                # foreshock: was dist.init_process_group
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model = DistributedDataParallel(net) if dist.is_initialized() else net   # foreshock: a spare has no group yet
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    position = DataPosition()
    mig = Migrator(model=model, optimizer=optimizer, per_rank={"data": position})   # foreshock
    record = {"pid": os.getpid(), "losses": {}, "ranks": {}, "joined": None, "exit": "released"}
    if not mig.start():                                                      # foreshock: a spare waits here
        return _write(record)
    record.update(joined=mig.step, exit="finished")
    while position.next_step < steps:                                        # foreshock: was for step in range(steps)
        step = position.next_step
        x, y = batch(step, dist.get_rank())
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(mig.model(x), y)                 # foreshock: was model(x)
        loss.backward()
        optimizer.step()
        position.next_step += 1
        record["losses"][step], record["ranks"][step] = loss.item(), dist.get_rank()
        if mig.end_step().leave:                                             # foreshock
            record["exit"] = "evacuated"
            break
        time.sleep(pause)
    record["hash"] = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
    mig.close(finished=record["exit"] == "finished")                         # foreshock: was destroy_process_group()
    _write(record)


def _write(record: dict) -> None:
    out = os.environ.get("FORESHOCK_EXAMPLE_OUT")
    if out:
        with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
