"""Migrator proof: real gloo jobs (4 ranks + 1 warm spare) driven by the real control plane in-process.

Each job is foreshock.migrator.example (a small MLP with dropout, Adam, StepLR, data a pure function of
(seed, step, rank)). To stay inside the time budget, the jobs of one group run concurrently, each
against its own in-process control plane, and every test asserts on the group's results:

- group "swap": job `swap` is drained (DrainNode on rank 2's node) mid-run; job `outage` loses its
  control plane mid-run and is otherwise undisturbed, so it is also the reference loss curve;
- group "faults": job `spare-dies` (its spare is SIGKILLed by itself mid-transfer), job `shrink` (no
  spare, fallback shrink: the service issues SHRINK), job `checkpoint` (the service believes a spare is
  there but none is in standby; fallback checkpoint_exit).
"""

from __future__ import annotations

import json
import logging
import time

import pytest

torch = pytest.importorskip("torch")

from foreshock.migrator import example  # noqa: E402
from foreshock.migrator.transfer import load_checkpoint  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

STEPS = 60
NODES = ["node-a", "node-b", "node-c", "node-d"]
SPARE = "node-e"
SEED = 11


def _plane(tmp_path, name):
    from foreshock.service.scoring import NullScorer
    from foreshock.service.server import Settings, build_server
    plane = build_server(Settings.insecure_loopback(
        tmp_path / f"state-{name}", scorer=NullScorer(), decision_flush_seconds=0.5,
        policy={"lead_seconds": 0.3, "min_steps_ahead": 6, "stale_seconds": 3600.0}))
    port = plane.start()
    return plane, f"127.0.0.1:{port}"


def _drain(address, node, reason):
    import grpc
    from foreshock.v1 import jobs_pb2, jobs_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        resp = jobs_pb2_grpc.JobsStub(ch).DrainNode(jobs_pb2.DrainNodeRequest(node=node, reason=reason),
                                                     timeout=10)
    assert len(resp.directives) == 1, resp
    return resp.directives[0]


def _wait_registered(plane, job_id, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if plane.store.find_job(job_id) is not None and plane.jobs.watchers().get(job_id, 0) >= 1:
            return
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} never registered")


def _by_name(results):
    out = {}
    for r in results:
        assert r["name"] not in out, f"{r['name']} ran twice"
        out[r["name"]] = r
    return out


def _steps(record):
    return sorted(int(s) for s in record["losses"])


def _launch(job_id, address, tmp_path, spares, **kw):
    return example.launch(job_id, NODES, spares, steps=STEPS, out_dir=tmp_path / job_id, service=address,
                          seed=SEED, step_sleep_s=0.02, transfer_timeout_s=20.0, **kw)


@pytest.fixture(scope="module")
def swap_group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migrator-swap")
    plane_s, addr_s = _plane(tmp, "swap")
    plane_o, addr_o = _plane(tmp, "outage")
    jobs = {}
    try:
        jobs["swap"] = _launch("swap", addr_s, tmp, [SPARE])
        jobs["outage"] = _launch("outage", addr_o, tmp, [SPARE])
        _wait_registered(plane_s, "swap")
        jobs["swap"].wait_progress(8, timeout=90)
        directive = _drain(addr_s, NODES[2], "test: evacuate rank 2")
        jobs["outage"].wait_progress(12, timeout=90)
        plane_o.stop(grace=0.2)
        codes = {name: job.wait(timeout=120) for name, job in jobs.items()}
        listed = plane_s.jobs.list("swap")
        acks = plane_s.store.acks(directive.directive_id)
        yield {"codes": codes, "results": {n: _by_name(j.results()) for n, j in jobs.items()},
               "directive": directive, "listed": listed, "acks": acks, "procs": jobs["swap"].processes}
    finally:
        for job in jobs.values():
            job.wait(timeout=1)
        plane_s.stop(grace=0.2)
        plane_o.stop(grace=0.2)


def test_swap_no_healthy_rank_restarted_and_steps_continue(swap_group):
    assert all(c == 0 for c in swap_group["codes"]["swap"].values()), swap_group["codes"]
    res = swap_group["results"]["swap"]
    procs = swap_group["procs"]
    for r in (0, 1, 3):
        rec = res[f"rank{r}"]
        assert rec["pid"] == procs[f"rank{r}"].pid and rec["exit"] == "finished"
        assert _steps(rec) == list(range(STEPS)), f"rank {r} did not run every step in one process"
        assert set(rec["ranks"].values()) == {r}
        assert [c["kind"] for c in rec["changes"]] == ["evacuate"]
    leaving, spare = res["rank2"], res[f"spare-{SPARE}"]
    assert leaving["exit"] == "evacuate" and leaving["changes"][0]["leave"]
    assert spare["pid"] == procs[f"spare-{SPARE}"].pid and spare["exit"] == "finished"
    k = spare["joined_at_step"]
    assert 8 < k < STEPS
    assert _steps(leaving) == list(range(k)), "leaving rank must stop exactly where the spare starts"
    assert _steps(spare) == list(range(k, STEPS))
    assert set(spare["ranks"].values()) == {2}
    assert all(rec["changes"][0]["step"] == k for rec in (res["rank0"], res["rank1"], res["rank3"], leaving))


def test_swap_parameters_bit_identical_after_the_switch(swap_group):
    res = swap_group["results"]["swap"]
    spare = res[f"spare-{SPARE}"]
    k = str(spare["joined_at_step"])
    at_switch = {name: rec["hashes"][k] for name, rec in res.items() if k in rec["hashes"]}
    assert set(at_switch) == {"rank0", "rank1", "rank2", "rank3", f"spare-{SPARE}"}
    assert len(set(at_switch.values())) == 1, at_switch
    final = {name: rec["hashes"][str(STEPS)] for name, rec in res.items() if rec["exit"] == "finished"}
    assert len(final) == 4 and len(set(final.values())) == 1, final


def test_swap_loss_curve_matches_the_undisturbed_run(swap_group):
    swap, ref = swap_group["results"]["swap"], swap_group["results"]["outage"]
    curve = {}
    for rec in swap.values():
        for step, loss in rec["losses"].items():
            key = (rec["ranks"][step], int(step))
            assert key not in curve, f"step {key} ran twice"
            curve[key] = loss
    ref_curve = {(rec["ranks"][s], int(s)): loss for rec in ref.values() for s, loss in rec["losses"].items()}
    assert set(curve) == set(ref_curve) == {(r, s) for r in range(4) for s in range(STEPS)}
    for key in sorted(curve):
        assert curve[key] == pytest.approx(ref_curve[key], rel=1e-6, abs=1e-9), key
    # and they really train: a flat curve would match trivially
    assert ref_curve[(0, STEPS - 1)] != ref_curve[(0, 0)]


def test_swap_acknowledged_each_phase_and_acted_on_once(swap_group):
    did = swap_group["directive"].directive_id
    (d,) = [d for d in swap_group["listed"] if d.directive_id == did]
    assert d.state.name == "COMPLETED"
    phases = [a.phase.name for a in swap_group["acks"]]
    assert phases[:3] == ["ACCEPTED", "STATE_TRANSFERRED", "COMPLETED"], phases
    completed = next(a for a in swap_group["acks"] if a.phase.name == "COMPLETED")
    assert "transfer=" in completed.reason and "reform=" in completed.reason and completed.phase_seconds > 0
    res = swap_group["results"]["swap"]
    # the service sends the directive again with each state change (and to the spare's new watch):
    # every delivery after the switch is recognised and ignored
    assert any(did in rec["final"]["redelivered"] for rec in res.values() if rec.get("final"))
    assert all(len(rec["changes"]) <= 1 for rec in res.values())
    assert all(rec["final"]["generation"] == 1 for rec in res.values() if rec.get("final"))
    pauses = [c["pause_s"] for rec in res.values() for c in rec["changes"] if not c["leave"]]
    assert pauses and max(pauses) < 10.0


def test_outage_training_continues(swap_group):
    assert all(c == 0 for c in swap_group["codes"]["outage"].values()), swap_group["codes"]
    ref = swap_group["results"]["outage"]
    for r in range(4):
        rec = ref[f"rank{r}"]
        assert rec["exit"] == "finished" and _steps(rec) == list(range(STEPS)) and not rec["changes"]
        assert rec["final"]["service_healthy"] is False     # it noticed the service had gone
    assert ref[f"spare-{SPARE}"]["exit"] == "released"


@pytest.fixture(scope="module")
def fault_group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migrator-faults")
    planes = {n: _plane(tmp, n) for n in ("spare-dies", "shrink", "checkpoint")}
    registrations = []
    shrink_jobs = planes["shrink"][0].jobs
    original_register = shrink_jobs.register

    def recording_register(job_id, ranks, *args, **kwargs):
        registrations.append(sorted((r, n) for r, n, _ in ranks))
        return original_register(job_id, ranks, *args, **kwargs)

    shrink_jobs.register = recording_register
    jobs = {}
    try:
        jobs["spare-dies"] = _launch("spare-dies", planes["spare-dies"][1], tmp, [SPARE],
                                     spare_env={"FORESHOCK_MIGRATOR_FAULT": "spare_dies_in_transfer"})
        jobs["shrink"] = _launch("shrink", planes["shrink"][1], tmp, [], fallback="shrink")
        jobs["checkpoint"] = _launch("checkpoint", planes["checkpoint"][1], tmp, [], registered_spares=[SPARE],
                                     fallback="checkpoint_exit")
        directives = {}
        for name, job in jobs.items():
            _wait_registered(planes[name][0], name)
            job.wait_progress(8, timeout=90)
            directives[name] = _drain(planes[name][1], NODES[1], f"test: {name}")
        codes = {name: job.wait(timeout=120) for name, job in jobs.items()}
        listed = {n: {d.directive_id: d for d in p.jobs.list(n)} for n, (p, _) in planes.items()}
        acks = {n: p.store.acks(directives[n].directive_id) for n, (p, _) in planes.items()}
        yield {"codes": codes, "results": {n: _by_name(j.results()) for n, j in jobs.items()},
               "directives": directives, "listed": listed, "acks": acks, "out": tmp,
               "registrations": registrations}
    finally:
        for job in jobs.values():
            job.wait(timeout=1)
        for plane, _ in planes.values():
            plane.stop(grace=0.2)


def test_spare_dies_in_transfer_leaving_rank_stays(fault_group):
    codes = fault_group["codes"]["spare-dies"]
    assert codes[f"spare-{SPARE}"] == -9 and all(codes[f"rank{r}"] == 0 for r in range(4)), codes
    res = fault_group["results"]["spare-dies"]
    for r in range(4):
        rec = res[f"rank{r}"]
        assert rec["exit"] == "finished" and _steps(rec) == list(range(STEPS)), r
        assert [c["kind"] for c in rec["changes"]] == ["failed"]
        assert "stopped during the transfer" in rec["changes"][0]["reason"]
    assert len({res[f"rank{r}"]["hashes"][str(STEPS)] for r in range(4)}) == 1
    d = fault_group["listed"]["spare-dies"][fault_group["directives"]["spare-dies"].directive_id]
    assert d.state.name == "FAILED"
    failed = [a for a in fault_group["acks"]["spare-dies"] if a.phase.name == "FAILED"]
    assert failed and "stay" in failed[0].reason and failed[0].phase_seconds > 0


def test_no_spare_shrinks_the_world(fault_group):
    assert all(c == 0 for c in fault_group["codes"]["shrink"].values())
    d = fault_group["directives"]["shrink"]
    assert d.kind == 2   # DIRECTIVE_KIND_SHRINK: the service saw no spare
    res = fault_group["results"]["shrink"]
    leaving = res["rank1"]
    k = leaving["changes"][0]["step"]
    assert leaving["exit"] == "shrink" and _steps(leaving) == list(range(k))
    for old, new in ((0, 0), (2, 1), (3, 2)):
        rec = res[f"rank{old}"]
        assert _steps(rec) == list(range(STEPS)) and rec["final"]["world"] == 3 and rec["final"]["rank"] == new
        assert {rec["ranks"][str(s)] for s in range(k, STEPS)} == {new}
    assert len({res[f"rank{r}"]["hashes"][str(STEPS)] for r in (0, 2, 3)}) == 1
    assert fault_group["listed"]["shrink"][d.directive_id].state.name == "COMPLETED"
    # the lead re-registered the renumbered placement after the COMPLETED ack
    assert fault_group["registrations"] == [[(0, NODES[0]), (1, NODES[1]), (2, NODES[2]), (3, NODES[3])],
                                            [(0, NODES[0]), (1, NODES[2]), (2, NODES[3])]]


def test_no_spare_in_standby_checkpoints_and_exits(fault_group):
    codes = fault_group["codes"]["checkpoint"]
    assert all(c == 3 for c in codes.values()), codes       # 3: restart me without the node
    d = fault_group["directives"]["checkpoint"]
    assert d.kind == 1 and d.to_node == SPARE                # the service thought a spare was there
    res = fault_group["results"]["checkpoint"]
    steps = {rec["changes"][0]["step"] for rec in res.values()}
    assert len(steps) == 1
    (k,) = steps
    paths = {rec["changes"][0]["checkpoint"] for rec in res.values()}
    assert len(paths) == 1
    (path,) = paths
    state = load_checkpoint(path)
    assert state["migrator"]["step"] == k
    model, _, _ = example.build(2000, SEED)
    model.load_state_dict(state["model"])
    assert example.param_hash(model) == res["rank0"]["hashes"][str(k)]
    local = load_checkpoint(f"{path}.rank1")
    assert local["objects"]["data"]["next_step"] == k
    assert fault_group["listed"]["checkpoint"][d.directive_id].state.name == "COMPLETED"
    done = [a for a in fault_group["acks"]["checkpoint"] if a.phase.name == "COMPLETED"]
    assert "no spare in standby" in done[0].reason
