"""A rank that dies unannounced (SIGKILL during a step's forward pass, the prediction missed): real gloo
jobs on CPU, 4 ranks + 1 warm spare each, run side by side.

- `ddp`: every rank holds a replica, so the survivors (same processes) find the dead rank through the
  store, a healthy replica hands the full state to the spare, and the failed step runs again in the
  new world: no restart, every step once per rank, all replicas equal at the end;
- `fsdp`: the dead rank's shards exist nowhere else, so every survivor ends with checkpoint_exit
  (exit status 3) and says why, within the deadline, instead of hanging in a collective;
- `leaving`: an evacuation of rank 1 whose leaving rank dies in the transfer group before it sends its
  own state: the switch is aborted, the old world goes on, its next collective fails, and the
  survivors heal from a replica with the same spare.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from foreshock.migrator import Directive, DirectiveKind, example, publish_directive  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

STEPS = 24
DIES_AT = 10
NODES = ["h0", "h1", "h2", "h3"]
SPARE = "h4"


@pytest.fixture(scope="module")
def killed_jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migrator-heal")
    fault = {"FORESHOCK_MIGRATOR_FAULT": f"rank_dies_at_step:2:{DIES_AT}"}
    jobs = {mode: example.launch(f"heal-{mode}", NODES, [SPARE], steps=STEPS, out_dir=tmp / mode, seed=3,
                                 step_sleep_s=0.02, transfer_timeout_s=10.0, mode=mode, env=fault)
            for mode in ("ddp", "fsdp")}
    jobs["leaving"] = example.launch("heal-leaving", NODES, [SPARE], steps=STEPS, out_dir=tmp / "leaving", seed=3,
                                     step_sleep_s=0.02, transfer_timeout_s=10.0, hold_at=6,
                                     env={"FORESHOCK_MIGRATOR_FAULT": "leaving_dies_in_transfer"})
    try:
        jobs["leaving"].wait_progress(6, timeout=180)
        publish_directive(jobs["leaving"].store, "heal-leaving",
                          Directive("lv", DirectiveKind.EVACUATE, (1,), NODES[1], SPARE,
                                    at_step=jobs["leaving"].progress() + 2, reason="test: leaving dies"))
        jobs["leaving"].release()
        # bounded: a hang would show as processes killed here (exit -9 on a survivor)
        codes = {mode: job.wait(timeout=150) for mode, job in jobs.items()}
        yield {"codes": codes, "results": {m: {r["name"]: r for r in j.results()} for m, j in jobs.items()},
               "procs": {m: j.processes for m, j in jobs.items()}}
    finally:
        for job in jobs.values():
            job.wait(timeout=1)


def _steps(rec):
    return sorted(int(s) for s in rec["losses"])


def test_ddp_survivors_heal_from_a_replica_with_the_spare_no_restart(killed_jobs):
    codes = killed_jobs["codes"]["ddp"]
    assert codes["rank2"] == -9 and all(codes[n] == 0 for n in ("rank0", "rank1", "rank3", f"spare-{SPARE}")), codes
    res, procs = killed_jobs["results"]["ddp"], killed_jobs["procs"]["ddp"]
    assert "rank2" not in res                       # killed: it wrote nothing
    for r in (0, 1, 3):
        rec = res[f"rank{r}"]
        assert rec["pid"] == procs[f"rank{r}"].pid and rec["exit"] == "finished"
        assert _steps(rec) == list(range(STEPS)) and set(rec["ranks"].values()) == {r}
        (change,) = rec["changes"]
        assert change["kind"] == "heal" and change["step"] == DIES_AT and not change["leave"]
        assert "rank(s) [2] died unannounced" in change["reason"]
    spare = res[f"spare-{SPARE}"]
    # the spare took rank 2 from the failed step on: that step ran once, in the new world
    assert spare["joined_at_step"] == DIES_AT and _steps(spare) == list(range(DIES_AT, STEPS))
    assert set(spare["ranks"].values()) == {2}
    assert len({rec["hashes"][str(STEPS)] for rec in res.values()}) == 1
    # the replica it got is the survivors' state when the step failed
    assert spare["hashes"][str(DIES_AT)] == res["rank0"]["hashes"][str(DIES_AT)]


def test_fsdp_without_a_replica_takes_the_checkpoint_exit_path_and_says_so(killed_jobs):
    codes = killed_jobs["codes"]["fsdp"]
    assert codes["rank2"] == -9, codes
    assert all(codes[f"rank{r}"] == 3 for r in (0, 1, 3)), codes    # 3: restart me without the node
    assert codes[f"spare-{SPARE}"] == 0                              # released, not left waiting
    res = killed_jobs["results"]["fsdp"]
    for r in (0, 1, 3):
        rec = res[f"rank{r}"]
        assert _steps(rec) == list(range(DIES_AT)) and rec["exit"] == "checkpoint_exit"
        (change,) = rec["changes"]
        assert change["leave"] and change["checkpoint"] == ""
        assert "their FSDP shards have no replica" in change["reason"], change["reason"]
    assert res[f"spare-{SPARE}"]["exit"] == "released"


def test_a_leaving_rank_that_dies_in_the_transfer_aborts_the_switch_then_the_replica_heals(killed_jobs):
    codes = killed_jobs["codes"]["leaving"]
    assert codes["rank1"] == -9 and all(codes[n] == 0 for n in ("rank0", "rank2", "rank3", f"spare-{SPARE}")), codes
    res = killed_jobs["results"]["leaving"]
    for r in (0, 2, 3):
        rec = res[f"rank{r}"]
        assert _steps(rec) == list(range(STEPS)) and set(rec["ranks"].values()) == {r}
        assert [c["kind"] for c in rec["changes"]] == ["failed", "heal"], rec["changes"]
        assert "refused the state" in rec["changes"][0]["reason"]
    spare = res[f"spare-{SPARE}"]
    k = spare["joined_at_step"]
    assert k == res["rank0"]["changes"][1]["step"] and _steps(spare) == list(range(k, STEPS))
    assert set(spare["ranks"].values()) == {1}
    assert len({rec["hashes"][str(STEPS)] for rec in res.values()}) == 1
