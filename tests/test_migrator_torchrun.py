"""Drop-in integration under a real torchrun: an ordinary DDP script (foreshock.migrator.torchrun_example)
that makes its own process group and DDP wrapper, launched as docs/migrator.md says (c10d rendezvous
on an endpoint, FORESHOCK_STORE set to it, the run id as the job id), and a warm spare started beside
it with the documented command. An evacuation directive published in that store moves rank 1 to the
spare mid-run. In-process: a group and a DDP wrapper the script made are adopted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from support import free_port

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.slow]

STEPS = 30
RANKS = 3


def _wait_for(pattern, path: Path, proc, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = re.search(pattern, path.read_text(errors="replace")) if path.exists() else None
        if m:
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in torchrun's output:\n{path.read_text(errors='replace')[-3000:]}")


def test_a_torchrun_ddp_script_adopts_its_group_and_hands_a_rank_to_a_spare(tmp_path):
    import torch.distributed as dist
    from foreshock.migrator import Directive, DirectiveKind, publish_directive
    out = tmp_path / "records"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "FORESHOCK_EXAMPLE_OUT": str(out), "FORESHOCK_EXAMPLE_STEPS": str(STEPS),
           "FORESHOCK_EXAMPLE_STEP_SLEEP": "0.4", "FORESHOCK_STORE": endpoint,
           "FORESHOCK_SPARE_NODES": "spare-node", "FORESHOCK_TRANSFER_TIMEOUT_S": "30",
           "FORESHOCK_SPARE_HEARTBEAT_S": "0.2", "FORESHOCK_STANDBY_POLL_S": "5", "OMP_NUM_THREADS": "1"}
    env.pop("FORESHOCK_JOB_ID", None)
    log = tmp_path / "torchrun.log"
    with open(log, "w") as logf:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                                f"--nproc-per-node={RANKS}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                                "--rdzv-id=tr-job", "-m", "foreshock.migrator.torchrun_example"],
                               env=env, stdout=logf, stderr=subprocess.STDOUT)
    # the spare, with the documented command, at the same time as the job
    spare = subprocess.Popen([sys.executable, "-m", "foreshock.migrator.torchrun_example"],
                             env={**env, "FORESHOCK_ROLE": "spare", "FORESHOCK_JOB_ID": "tr-job",
                                  "FORESHOCK_NODE": "spare-node"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # rank 0 says how spares join; the values are the documented ones
        _wait_for(rf"FORESHOCK_JOB_ID=tr-job FORESHOCK_STORE={re.escape(endpoint)}", log, job, timeout=90)
        host, port = endpoint.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        # the spare is in standby once it has a heartbeat slot
        end = time.monotonic() + 60
        while not store.check(["foreshock/tr-job/standby/spare-node/0/beat"]):
            assert time.monotonic() < end, "the spare never reached standby"
            time.sleep(0.1)
        publish_directive(store, "tr-job", Directive("move-1", DirectiveKind.EVACUATE, (1,), "", "spare-node",
                                                     at_step=0, reason="test: torchrun"))
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert spare.wait(timeout=60) == 0
    finally:
        for p in (job, spare):
            if p.poll() is None:
                p.kill()
                p.wait()
    records = [json.loads(f.read_text()) for f in out.glob("*.json")]
    assert len(records) == RANKS + 1
    (spare_rec,) = [r for r in records if r["pid"] == spare.pid]
    (leaving,) = [r for r in records if r["exit"] == "evacuated"]
    staying = [r for r in records if r["exit"] == "finished" and r["pid"] != spare.pid]
    assert len(staying) == RANKS - 1
    # staying ranks: one process each ran every step, in one rank
    for r in staying:
        assert sorted(map(int, r["losses"])) == list(range(STEPS))
        assert len(set(r["ranks"].values())) == 1 and r["joined"] == 0
    # the spare continued rank 1's stream exactly where the leaving process stopped
    k = spare_rec["joined"]
    assert 0 < k < STEPS
    assert sorted(map(int, leaving["losses"])) == list(range(k))
    assert sorted(map(int, spare_rec["losses"])) == list(range(k, STEPS))
    assert set(spare_rec["ranks"].values()) == set(leaving["ranks"].values()) == {1}
    # every finishing process holds the same parameters
    assert len({r["hash"] for r in staying + [spare_rec]}) == 1


def test_a_group_and_ddp_made_by_the_script_are_adopted_and_a_spare_skips_init(tmp_path, monkeypatch):
    """In this process: a one-rank world the script made itself, its own DDP wrapper, a directive."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from foreshock.migrator import (Directive, DirectiveKind, LocalDirectiveSource, Migrator, MigratorConfig,
                                    init_process_group)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("FORESHOCK_ROLE", "spare")
    init_process_group("gloo", store=store, rank=0, world_size=1)
    assert not dist.is_initialized()             # a spare joins a world only when it takes a rank
    monkeypatch.setenv("FORESHOCK_ROLE", "rank")
    init_process_group("gloo", store=dist.PrefixStore("script/", store), rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        net = torch.nn.Linear(4, 2)
        ddp = DistributedDataParallel(net, bucket_cap_mb=1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        source = LocalDirectiveSource()
        cfg = MigratorConfig.from_env({}, job_id="adopt", rank=0, world_size=1, node="n0",
                                      store=f"127.0.0.1:{store.port}", checkpoint_dir=str(tmp_path))
        mig = Migrator(cfg, model=ddp, optimizer=opt, source=source, store=store)
        assert mig.start() and mig.adopted and mig.model is ddp and mig.module is net
        assert mig.ddp_kwargs["bucket_cap_mb"] == 1
        source.push(Directive("ck", DirectiveKind.CHECKPOINT_EXIT, (0,), "n0", "", at_step=3, reason="test"))
        while True:
            with mig.guard():
                opt.zero_grad()
                mig.model(torch.ones(2, 4)).sum().backward()
                opt.step()
                mig.end_step()
            if mig.last_change.leave:
                break
        # the agreement rode in the script's own DDP all-reduce, and the adopted world acted on it
        assert mig.step == 3 and mig.agreement_counts == {"piggybacked": 3, "separate": 0}
        assert mig.last_change.kind == "checkpoint_exit" and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
