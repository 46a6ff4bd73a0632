"""Migrator: time from an evacuation directive to the first step completed in the new world.

A real job (4 gloo ranks + 1 warm spare, CPU, foreshock.migrator.example) trains an MLP with Adam;
the launcher publishes an evacuation of rank 1 in the job's store (the control plane's gRPC delivery is
measured by the service's own benchmark, so this times the migrator alone). Printed per model size:
directive -> first step done in the new world (the slowest of the surviving ranks and the spare), its
phases on the coordinating rank (agreement, plan, state transfer, group re-formation), the bytes moved,
how long the healthy ranks were paused, and an ordinary step for comparison.
Two kinds of job: `ddp` (every rank a replica; the coordinator sends the model and optimizer) and
`fsdp` (FSDP2, fully_shard per Linear; the leaving rank sends its own shards). What an evacuation costs
the job is the pause of the healthy ranks plus the first new-world step's excess over a usual step;
it is printed per case with the bytes moved and where they came from.
`--quick`: the small model only. `--sizes=2000,10000000`: choose the sizes. `--modes=ddp,fsdp`: the kinds.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

SIZES = (2_000, 10_000_000, 100_000_000)


def run_one(params: int, workdir: str, mode: str = "ddp") -> dict:
    from foreshock.migrator import Directive, DirectiveKind, publish_directive
    from foreshock.migrator.example import launch
    big = params >= 1_000_000
    steps_before = 4 if big else 30
    job = launch(f"bench-{mode}-{params}", ["n0", "n1", "n2", "n3"], ["n4"], steps=steps_before + (6 if big else 20),
                 out_dir=f"{workdir}/{mode}-{params}", params=params, step_sleep_s=0.0 if big else 0.005,
                 transfer_timeout_s=600.0, batch_size=16, mode=mode)
    try:
        job.wait_progress(steps_before, timeout=900)
        at = job.progress() + 1
        t0 = time.time()
        publish_directive(job.store, job.job_id, Directive("bench-1", DirectiveKind.EVACUATE, (1,), "n1", "n4",
                                                           at_step=at, reason="benchmark"))
        codes = job.wait(timeout=1800)
        ack_key = f"foreshock/{job.job_id}/directives/ack/bench-1/state_transferred"
        moved = json.loads(job.store.get(ack_key))["reason"] if job.store.check([ack_key]) else "?"
    finally:
        for p in job.processes.values():
            if p.is_alive():
                p.kill()
    results = job.results()
    if any(c != 0 for c in codes.values()):
        raise RuntimeError(f"job exit codes {codes}")
    changes = [(r, c) for r in results for c in r["changes"] if not c["leave"]]
    spare = next(r for r in results if r["role"] == "spare")
    firsts = [c["first_step_done_wall"] for _, c in changes] + [spare["first_step_done_wall"]]
    coord = next(c for _, c in changes if "total_to_first_step" in c["phases"] or c["rank"] == 0)
    coord_phases = next((r["final"]["history_phases"][0] for r in results
                         if r["exit"] == "finished" and r["final"]["history_phases"]
                         and "total_to_first_step" in r["final"]["history_phases"][0]), coord["phases"])
    pauses = [c["pause_s"] for _, c in changes]
    lead = next(r for r in results if r["name"] == "rank0")
    walls = [lead["walls"][str(s)] for s in range(1, steps_before) if str(s) in lead["walls"]]
    step_s = statistics.median(b - a for a, b in zip(walls, walls[1:])) if len(walls) > 1 else float("nan")
    excess = max(0.0, coord_phases.get("first_step", 0.0) - step_s)
    return {"params": params, "mode": mode, "directive_to_first_step_s": max(firsts) - t0,
            "phases": coord_phases, "pause_min_s": min(pauses), "pause_max_s": max(pauses),
            "reason": coord["reason"], "step_s": step_s, "cost_s": max(pauses) + excess,
            "moved": moved.partition(": ")[2] or moved}


def main(argv: list[str]) -> int:
    sizes, modes = SIZES, ("ddp", "fsdp")
    for a in argv:
        if a == "--quick":
            sizes = SIZES[:1]
        elif a.startswith("--sizes="):
            sizes = tuple(int(s) for s in a.split("=", 1)[1].split(","))
        elif a.startswith("--modes="):
            modes = tuple(a.split("=", 1)[1].split(","))
    print(f"load average at start: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print("job: 4 ranks + 1 warm spare, gloo on CPU (loopback), Adam + StepLR, evacuate rank 1 -> spare")
    print(f"{'job':>5} {'params':>12} {'cost':>7} {'directive->1st step':>20} {'agreement':>10} {'plan':>8} "
          f"{'transfer':>9} {'re-form':>8} {'1st step':>9} {'healthy paused':>16} {'usual step':>11}  moved")
    workdir = tempfile.mkdtemp(prefix="bench-migrator-")
    status = 0
    try:
        for params, mode in ((p, m) for p in sizes for m in modes):
            try:
                r = run_one(params, workdir, mode)
            except Exception as exc:  # noqa: BLE001 - report and go on with the next size
                print(f"{mode:>5} {params:>12} FAILED: {exc}")
                status = 1
                continue
            ph = r["phases"]
            print(f"{mode:>5} {params:>12,} {r['cost_s']:>6.3f}s "
                  f"{r['directive_to_first_step_s']:>19.3f}s {ph.get('agreement', 0):>9.3f}s "
                  f"{ph.get('plan', 0):>7.3f}s {ph.get('transfer', 0):>8.3f}s {ph.get('reform', 0):>7.3f}s "
                  f"{ph.get('first_step', 0):>8.3f}s {r['pause_min_s'] * 1e3:>9.0f}-{r['pause_max_s'] * 1e3:<4.0f} ms "
                  f"{r['step_s']:>10.3f}s  {r['moved']}",
                  flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print("cost = the healthy ranks' longest pause + the first new-world step's excess over a usual step; "
          "agreement = directive seen -> all ranks agree at the step boundary (up to one step of latency plus the wait "
          "for at_step; training goes on meanwhile); healthy paused = plan + transfer + re-form on each "
          "surviving rank; 1st step = the first step in the new world, whose all-reduce waits for the spare")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
