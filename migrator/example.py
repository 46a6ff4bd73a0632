"""A complete data-parallel training job that embeds the migrator, and a launcher for it.

`run_worker(spec)` is one process of the job (a rank or a warm spare): it trains a small MLP with
dropout (so RNG state matters) and Adam with a step LR schedule on synthetic data whose batch is a
pure function of (seed, step, rank), so an undisturbed run and a migrated one see the same data order.
It writes what it did to `<out_dir>/<role>-<name>-<pid>.json`: its pid, the steps it ran with their
losses, a SHA-256 of the parameters after every world change and at the end, and the world changes.

`launch(...)` hosts the job's TCPStore in the launcher (so the store is on no node that may be
evacuated), starts the ranks and spares with multiprocessing's forkserver (torch imported once), waits
for them and returns their results. The demo and the proof tests use it; from a shell:

    python -m foreshock.migrator.example --service 127.0.0.1:50051 --job-id demo \
        --nodes node-00,node-01,node-02,node-03 --spares node-04 --steps 400 --out /tmp/demo-job

Each process gets its identity the way torchrun passes it (FORESHOCK_RANK, FORESHOCK_NODE, ...; see
foreshock.migrator.config), so the same `run_worker` also works under a real launcher.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("foreshock.migrator.example")


class DataPosition:
    """The data loader's position: which step's batch comes next. Per rank (not replicated)."""

    def __init__(self) -> None:
        self.next_step = 0
        self.samples_seen = 0

    def state_dict(self) -> dict:
        return {"next_step": self.next_step, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = int(state["next_step"])
        self.samples_seen = int(state["samples_seen"])


def hidden_for(params: int, inputs: int = 32, outputs: int = 8) -> int:
    # 3 layers: in*h + h + h*h + h + h*out + out ~= params
    a, b, c = 1.0, inputs + outputs + 2.0, outputs - params
    return max(4, int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))


def build(params: int, seed: int, inputs: int = 32, outputs: int = 8, lr: float = 1e-3):
    import torch
    torch.manual_seed(seed)
    h = hidden_for(params, inputs, outputs)
    model = _mlp(h, inputs, outputs)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=25, gamma=0.9)
    return model, optimizer, scheduler


def _mlp(h: int, inputs: int, outputs: int):
    import torch
    return torch.nn.Sequential(torch.nn.Linear(inputs, h), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, outputs))


def shard(params: int, mesh, seed: int | None = None, inputs: int = 32, outputs: int = 8):
    """The same MLP with FSDP2: each Linear is its own unit, the root holds the rest. With a seed the
    values are the seed's (every rank builds the full model, then keeps its shard); without one it is
    built on the meta device and only allocated (the migrator's `reshard`: every value is overwritten)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    h = hidden_for(params, inputs, outputs)
    if seed is not None:
        torch.manual_seed(seed)
        model = _mlp(h, inputs, outputs)
    else:
        with torch.device("meta"):
            model = _mlp(h, inputs, outputs)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if seed is None:
        model.to_empty(device=mesh.device_type)
    return model


def batch(seed: int, step: int, rank: int, size: int = 16, inputs: int = 32, outputs: int = 8):
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(size, inputs, generator=g)
    y = torch.randn(size, outputs, generator=g)
    return x, y


def param_hash(model) -> str:
    """SHA-256 of the parameters this process holds (its shards, for FSDP2)."""
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _fault(config, step: int) -> None:
    """FORESHOCK_MIGRATOR_FAULT=rank_dies_at_step:R:N: rank R SIGKILLs itself during step N's forward
    pass (the prediction missed: no directive, no goodbye). For the proof tests only."""
    fault = os.environ.get("FORESHOCK_MIGRATOR_FAULT", "")
    if fault.startswith("rank_dies_at_step:") and config.role == "rank":
        _, rank, at = fault.split(":")
        if int(rank) == config.rank and step == int(at):
            import signal
            os.kill(os.getpid(), signal.SIGKILL)


def run_worker(spec: dict) -> int:
    """One process of the demo job. `spec`: env (FORESHOCK_* for this process), steps, out_dir,
    params, seed, step_sleep_s, slow_nodes (node -> extra seconds of compute a step: a fail-slow
    node), progress (write the lead's step to the store)."""
    os.environ.update(spec.get("env", {}))
    logging.basicConfig(level=spec.get("log_level", "WARNING"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    import torch
    torch.set_num_threads(1)
    from foreshock.migrator import Migrator, MigratorConfig

    log.info("worker up: %.2fs CPU since fork", time.process_time())
    config = MigratorConfig.from_env()
    seed, steps = int(spec.get("seed", 0)), int(spec["steps"])
    params = int(spec.get("params", 2000))
    model, optimizer, scheduler = build(params, seed)
    mode = spec.get("mode", "ddp")     # ddp: the migrator makes the group; adopt / fsdp: the script does
    reshard = None
    if mode in ("adopt", "fsdp", "hsdp"):
        import torch.distributed as dist
        from foreshock.migrator import init_process_group
        from datetime import timedelta
        # the script's own group, env:// as under torchrun (a no-op on a spare)
        init_process_group("gloo", timeout=timedelta(seconds=config.transfer_timeout_s))
        if mode in ("fsdp", "hsdp"):
            from torch.distributed.device_mesh import init_device_mesh
            reshard = functools.partial(shard, params)
            if config.role == "rank":
                world = dist.get_world_size()
                # hsdp: two replicas of a shard group of world / 2 ranks
                mesh = (init_device_mesh("cpu", (world,)) if mode == "fsdp" else
                        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
                model = shard(params, mesh, seed=seed)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=25, gamma=0.9)
        elif config.role == "rank":
            model = torch.nn.parallel.DistributedDataParallel(model)
    position = DataPosition()
    # rank-local RNG (dropout masks differ per rank); a spare inherits its predecessor's
    torch.manual_seed(seed + 7919 * max(config.rank, 0) + 1)
    batch_size = int(spec.get("batch_size", 16))
    loss_fn = torch.nn.MSELoss()

    def warmup(module):
        # a spare's throw-away step, so its first real step is not its first step ever
        x, y = batch(seed, 0, 0, batch_size)
        loss_fn(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    mig = Migrator(config, model=model, optimizer=optimizer, scheduler=scheduler,
                   per_rank={"data": position}, warmup=None if reshard else warmup, reshard=reshard,
                   backend=spec.get("backend"))
    name = f"rank{config.rank}" if config.role == "rank" else f"spare-{config.node}"
    record: dict[str, Any] = {"pid": os.getpid(), "role": config.role, "node": config.node, "name": name,
                              "losses": {}, "walls": {}, "hashes": {}, "changes": [], "exit": "", "ranks": {}}
    out = Path(spec["out_dir"]) / f"{config.role}-{name}-{os.getpid()}.json"
    progress_key = f"foreshock/{config.job_id}/progress"
    stop_key = f"foreshock/{config.job_id}/stop_at"  # Job.request_stop: every rank ends at that step
    release_key = f"foreshock/{config.job_id}/release"  # Job.release: the ranks held at hold_at go on
    hold_at = spec.get("hold_at")
    code = 0
    try:
        if not mig.start():
            record["exit"] = "released"
            return 0
        record["joined_at_step"] = mig.step
        if config.role == "spare":
            record["joined_wall"] = time.time()
            record["hashes"][str(mig.step)] = param_hash(mig.module)
        sleep = float(spec.get("step_sleep_s", 0.0))
        # between forward and backward, before the gradient all-reduce: this node computes slowly
        slow = float(spec.get("slow_nodes", {}).get(config.node, 0.0))
        pending_first = record if config.role == "spare" else None
        while mig.step < steps:
            if position.next_step != mig.step:
                raise RuntimeError(f"data position {position.next_step} != step {mig.step}")
            step, rank = mig.step, mig.rank
            with mig.guard():
                x, y = batch(seed, step, mig.rank, batch_size)
                optimizer.zero_grad(set_to_none=True)
                _fault(config, step)
                loss = loss_fn(mig.model(x), y)
                if slow:
                    time.sleep(slow)
                loss.backward()
                optimizer.step()
                scheduler.step()
                position.next_step += 1
                position.samples_seen += x.shape[0]
                mig.end_step()
            change = mig.last_change
            if mig.step > step:      # the step completed (a healed one runs again)
                record["losses"][str(step)] = loss.item()
                record["ranks"][str(step)] = rank
                record["walls"][str(step)] = time.time()
            if pending_first is not None:
                pending_first["first_step_done_wall"] = time.time()
                pending_first = None
            if change:
                record["changes"].append({"kind": change.kind, "directive": change.directive_id,
                                          "step": mig.step, "leave": change.leave, "rank": change.rank,
                                          "world": change.world_size, "generation": change.generation,
                                          "phases": change.phases, "reason": change.reason,
                                          "pause_s": mig.last_pause_s, "checkpoint": change.checkpoint})
                record["changes"][-1]["done_wall"] = time.time()
                pending_first = record["changes"][-1]
                record["hashes"][str(mig.step)] = param_hash(mig.module)
                if change.leave:
                    record["exit"] = change.kind
                    # 3: the launcher restarts the job from the checkpoint without the failing node
                    code = 3 if change.kind == "checkpoint_exit" else 0
                    return code
            if spec.get("progress") and mig.is_lead:
                mig._store.set(progress_key, str(mig.step))
                mig._store.set(progress_key + "_loss", repr(loss.item()))
            if spec.get("progress") and mig._store.check([stop_key]):
                steps = min(steps, int(mig._store.get(stop_key)))
            if hold_at is not None and mig.step == hold_at:
                # every rank reaches this boundary after the same agreed step, so they all wait here
                while not mig._store.check([release_key]):
                    time.sleep(0.02)
            if sleep:
                time.sleep(sleep)
        record["hashes"][str(mig.step)] = param_hash(mig.module)
        record["exit"] = "finished"
        record["final"] = {"rank": mig.rank, "world": mig.world_size, "generation": mig.generation,
                           "redelivered": mig.book.redelivered, "agreements": mig.agreement_counts,
                           "history_phases": [c.phases for c in mig.history]}
        if mig._client is not None:
            record["final"]["deliveries"] = mig._client.deliveries
            record["final"]["service_healthy"] = mig._client.healthy
            record["final"]["step_times"] = {"sent": mig._client.sent_step_times,
                                             "dropped": mig._client.dropped_step_times}
        return 0
    finally:
        try:
            mig.close(finished=record["exit"] == "finished")
        finally:
            record["finished_at"] = time.time()
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(out)


def _worker_entry(spec: dict) -> None:
    sys.exit(run_worker(spec))


class Job:
    """A launched job: its processes, the store it hosts, and where results go."""

    def __init__(self, store, processes: dict[str, Any], out_dir: Path, job_id: str) -> None:
        self.store, self.processes, self.out_dir, self.job_id = store, processes, out_dir, job_id

    def progress(self) -> int:
        key = f"foreshock/{self.job_id}/progress"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def loss(self) -> float | None:
        key = f"foreshock/{self.job_id}/progress_loss"
        return float(self.store.get(key)) if self.store.check([key]) else None

    def request_stop(self, steps_ahead: int = 20) -> int:
        """Ask every rank to end cleanly at progress + steps_ahead (far enough ahead that every rank
        reads it before getting there); returns that step."""
        at = self.progress() + steps_ahead
        self.store.set(f"foreshock/{self.job_id}/stop_at", str(at))
        return at

    def release(self) -> None:
        """Let the ranks held at `hold_at` (see `launch`) go on."""
        self.store.set(f"foreshock/{self.job_id}/release", "1")

    def wait_progress(self, step: int, timeout: float = 60.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            p = self.progress()
            if p >= step:
                return p
            if all(not p.is_alive() for p in self.processes.values()):
                break
            time.sleep(0.01)
        raise TimeoutError(f"job {self.job_id} did not reach step {step} (at {self.progress()})")

    def wait(self, timeout: float = 120.0) -> dict[str, int]:
        end = time.monotonic() + timeout
        for p in self.processes.values():
            p.join(max(0.0, end - time.monotonic()))
        codes = {}
        for name, p in self.processes.items():
            if p.is_alive():
                p.kill()
                p.join(5)
            codes[name] = p.exitcode
        return codes

    def stop(self, grace: float = 10.0) -> dict[str, int]:
        """End the job early: tell the spares to leave, terminate the ranks, wait `grace` seconds."""
        try:
            self.store.set(f"foreshock/{self.job_id}/released", "1")
        except Exception:  # noqa: BLE001 - the job may be gone already
            pass
        for p in self.processes.values():
            if p.is_alive():
                p.terminate()
        return self.wait(timeout=grace)

    def results(self) -> list[dict]:
        """What each process of this job wrote (files of earlier runs in the same folder are skipped)."""
        pids = {p.pid for p in self.processes.values()}
        records = [json.loads(f.read_text()) for f in sorted(self.out_dir.glob("*.json"))]
        return [r for r in records if r.get("pid") in pids]


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        # torch._dynamo: the first optimizer a process builds imports it (3 s of CPU here); pay once
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "foreshock.migrator.world",
                                     "foreshock.migrator.example", "foreshock.migrator.client"])
    return _CTX


def launch(job_id: str, nodes: list[str], spares: list[str], *, steps: int, out_dir: str | os.PathLike,
           service: str = "", token: str = "", params: int = 2000, seed: int = 0, step_sleep_s: float = 0.0,
           fallback: str = "shrink", env: dict[str, str] | None = None,
           spare_env: dict[str, str] | None = None, transfer_timeout_s: float = 30.0,
           log_level: str = "WARNING", batch_size: int = 16,
           registered_spares: list[str] | None = None, mode: str = "ddp", hold_at: int | None = None,
           slow_nodes: dict[str, float] | None = None, spare_backend: str | None = None) -> Job:
    """Start a job of len(nodes) ranks (rank i on nodes[i]) and one warm spare per entry of `spares`
    (`registered_spares`: the spare nodes told to the service, by default `spares`). `mode`: "ddp" (the
    migrator makes the group and wraps DDP), "adopt" (the script makes both, env:// as under torchrun),
    "fsdp" (the script makes the group and shards the model with FSDP2) or "hsdp" (FSDP2 on a 2-D
    mesh: two replicas of a shard group of half the ranks). `hold_at`: every rank waits after step
    hold_at - 1 (progress == hold_at) until `Job.release()`, so a test can act on a job at a known step
    however slowly or quickly the machine runs it. `slow_nodes`: node -> seconds each process on it
    sleeps between its forward and backward passes (a fail-slow node; a spare that takes over elsewhere
    is not slowed). `spare_backend`: the backend each spare's Migrator is given (default: its own
    choice, NCCL where CUDA is); on joining, the job's backend wins."""
    import torch.distributed as dist
    from datetime import timedelta
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=transfer_timeout_s))
    common = {"FORESHOCK_JOB_ID": job_id, "FORESHOCK_STORE": f"127.0.0.1:{store.port}",
              "FORESHOCK_WORLD_SIZE": str(len(nodes)), "FORESHOCK_SERVICE": service,
              "FORESHOCK_TOKEN": token, "FORESHOCK_SPARE_NODES": ",".join(spares if registered_spares is None else registered_spares),
              "FORESHOCK_FALLBACK": fallback, "FORESHOCK_CHECKPOINT_DIR": str(out / "checkpoints"),
              "FORESHOCK_TRANSFER_TIMEOUT_S": str(transfer_timeout_s),
              "FORESHOCK_REPORT_INTERVAL_S": "0.1", "FORESHOCK_SPARE_HEARTBEAT_S": "0.2",
              "FORESHOCK_STANDBY_POLL_S": "10", **(env or {})}
    base = {"steps": steps, "out_dir": str(out), "params": params, "seed": seed,
            "step_sleep_s": step_sleep_s, "progress": True, "log_level": log_level, "batch_size": batch_size,
            "mode": mode, "hold_at": hold_at, "slow_nodes": dict(slow_nodes or {})}
    ctx = _context()
    procs = {}
    for i, node in enumerate(spares):
        e = {**common, "FORESHOCK_ROLE": "spare", "FORESHOCK_NODE": node, "FORESHOCK_RANK": "-1",
             **(spare_env or {})}
        key = f"spare-{node}" if spares.count(node) == 1 else f"spare-{node}-{i}"
        procs[key] = ctx.Process(target=_worker_entry, args=({**base, "env": e, "backend": spare_backend},),
                                 name=f"{job_id}-{key}")
    for rank, node in enumerate(nodes):
        e = {**common, "FORESHOCK_ROLE": "rank", "FORESHOCK_NODE": node, "FORESHOCK_RANK": str(rank),
             # what torchrun gives its workers, for the modes where the script makes the group (env://)
             "RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        procs[f"rank{rank}"] = ctx.Process(target=_worker_entry, args=({**base, "env": e},),
                                           name=f"{job_id}-rank{rank}")
    for p in procs.values():
        p.start()
    return Job(store, procs, out, job_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m foreshock.migrator.example", description=__doc__.split("\n")[0])
    ap.add_argument("--service", default=os.environ.get("FORESHOCK_SERVICE", ""))
    ap.add_argument("--token", default=os.environ.get("FORESHOCK_TOKEN", ""))
    ap.add_argument("--job-id", default="demo")
    ap.add_argument("--nodes", default="node-00,node-01,node-02,node-03")
    ap.add_argument("--spares", default="node-04")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--params", type=int, default=2000)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--fallback", choices=["shrink", "checkpoint_exit"], default="shrink")
    ap.add_argument("--out", default="foreshock-demo-job")
    args = ap.parse_args(argv)
    job = launch(args.job_id, args.nodes.split(","), [s for s in args.spares.split(",") if s],
                 steps=args.steps, out_dir=args.out, service=args.service, token=args.token,
                 params=args.params, step_sleep_s=args.step_sleep, fallback=args.fallback, log_level="INFO")
    codes = job.wait(timeout=24 * 3600)
    for r in job.results():
        print(f"{r['name']:>16} pid {r['pid']:>7} exit {r['exit']:<16} steps "
              f"{min(map(int, r['losses']), default='-')}..{max(map(int, r['losses']), default='-')}")
    return 0 if all(c in (0, 3) for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
