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

import time

import pytest

torch = pytest.importorskip("torch")

from foreshock.migrator import example  # noqa: E402
from foreshock.migrator import Directive, DirectiveKind, publish_directive  # noqa: E402
from foreshock.migrator.transfer import load_checkpoint  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

STEPS = 60
NODES = ["node-a", "node-b", "node-c", "node-d"]
SPARE = "node-e"
SEED = 11
MULTI_NODES = ["node-a", "node-a", "node-b", "node-b"]


def _plane(tmp_path, name, lead_seconds=0.3):
    from foreshock.service.scoring import NullScorer
    from foreshock.service.server import Settings, build_server
    plane = build_server(Settings.insecure_loopback(
        tmp_path / f"state-{name}", scorer=NullScorer(), decision_flush_seconds=0.5,
        policy={"lead_seconds": lead_seconds, "min_steps_ahead": 6, "stale_seconds": 3600.0}))
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


def _wait_registered(plane, job_id, timeout=180.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if plane.store.find_job(job_id) is not None and plane.jobs.watchers().get(job_id, 0) >= 1:
            return
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} never registered")


def _by_name(results, dup_ok=False):
    out = {}
    for r in results:
        name = r["name"]
        if dup_ok and name in out:      # two spares on one node
            name = f"{name}-{r['pid']}"
        assert name not in out, f"{name} ran twice"
        out[name] = r
    return out


def _steps(record):
    return sorted(int(s) for s in record["losses"])


def _launch(job_id, address, tmp_path, spares, nodes=NODES, **kw):
    return example.launch(job_id, nodes, spares, steps=STEPS, out_dir=tmp_path / job_id, service=address,
                          seed=SEED, step_sleep_s=0.02, transfer_timeout_s=20.0, **kw)


@pytest.fixture(scope="module")
def swap_group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migrator-swap")
    plane_s, addr_s = _plane(tmp, "swap")
    plane_o, addr_o = _plane(tmp, "outage")
    plane_m, addr_m = _plane(tmp, "multi")
    jobs = {}
    try:
        # the drained jobs wait at step 8 (hold_at) until drained: on a loaded machine a 60-step job can
        # otherwise finish before the test gets to it
        jobs["swap"] = _launch("swap", addr_s, tmp, [SPARE], hold_at=8)
        # the outage job waits at step 12 while its control plane stops: a fast machine otherwise
        # finishes the remaining steps before the migrator has seen the service go
        jobs["outage"] = _launch("outage", addr_o, tmp, [SPARE], hold_at=12)
        # two ranks per node, the lead's node drained: two spares take over ranks 0 and 1
        jobs["multi"] = _launch("multi", addr_m, tmp, [SPARE, SPARE], nodes=MULTI_NODES,
                                registered_spares=[SPARE], hold_at=8)
        _wait_registered(plane_s, "swap")
        jobs["swap"].wait_progress(8, timeout=180)
        directive = _drain(addr_s, NODES[2], "test: evacuate rank 2")
        jobs["swap"].release()
        _wait_registered(plane_m, "multi")
        jobs["multi"].wait_progress(8, timeout=180)
        multi_directive = _drain(addr_m, MULTI_NODES[0], "test: evacuate the lead's node")
        jobs["multi"].release()
        jobs["outage"].wait_progress(12, timeout=90)
        plane_o.stop(grace=0.2)
        jobs["outage"].release()
        codes = {name: job.wait(timeout=120) for name, job in jobs.items()}
        listed = plane_s.jobs.list("swap")
        acks = plane_s.store.acks(directive.directive_id)
        multi_state = plane_m.store.directive(multi_directive.directive_id).state.name
        yield {"codes": codes, "results": {n: _by_name(j.results(), dup_ok=n == "multi") for n, j in jobs.items()},
               "directive": directive, "listed": listed, "acks": acks, "procs": jobs["swap"].processes,
               "multi_state": multi_state}
    finally:
        for job in jobs.values():
            job.wait(timeout=1)
        for plane in (plane_s, plane_o, plane_m):
            plane.stop(grace=0.2)


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
    assert all(res[f"rank{r}"]["final"]["deliveries"] >= 3 for r in (0, 1, 3))
    # the agreement rode in the gradient all-reduce on every step, never a collective of its own
    for r in (0, 1, 3):
        assert res[f"rank{r}"]["final"]["agreements"] == {"piggybacked": STEPS, "separate": 0}
    assert res[f"spare-{SPARE}"]["final"]["agreements"]["separate"] == 0
    assert all(len(rec["changes"]) <= 1 for rec in res.values())
    assert all(rec["final"]["generation"] == 1 for rec in res.values() if rec.get("final"))
    pauses = [c["pause_s"] for rec in res.values() for c in rec["changes"] if not c["leave"]]
    assert pauses and max(pauses) < 10.0


def test_two_ranks_of_the_lead_node_move_to_two_spares(swap_group):
    assert all(c == 0 for c in swap_group["codes"]["multi"].values()), swap_group["codes"]["multi"]
    res = swap_group["results"]["multi"]
    spares = [r for r in res.values() if r["role"] == "spare"]
    assert sorted(set(r["ranks"].values()).pop() for r in spares) == [0, 1]
    k = spares[0]["joined_at_step"]
    assert all(r["joined_at_step"] == k for r in spares)
    for old in (0, 1):
        assert res[f"rank{old}"]["exit"] == "evacuate" and _steps(res[f"rank{old}"]) == list(range(k))
    for r in (2, 3):
        assert _steps(res[f"rank{r}"]) == list(range(STEPS))
    assert len({r["hashes"][str(STEPS)] for r in res.values() if r["exit"] == "finished"}) == 1
    # same data and seeds per rank as the undisturbed run: the same curve
    ref = swap_group["results"]["outage"]
    ref_curve = {(rec["ranks"][s], int(s)): loss for rec in ref.values() for s, loss in rec["losses"].items()}
    curve = {(rec["ranks"][s], int(s)): loss for rec in res.values() for s, loss in rec["losses"].items()}
    assert curve.keys() == ref_curve.keys()
    assert all(curve[k_] == pytest.approx(ref_curve[k_], rel=1e-6, abs=1e-9) for k_ in curve)
    assert swap_group["multi_state"] == "COMPLETED"


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
    planes["cancel"] = _plane(tmp, "cancel", lead_seconds=3600.0)    # at_step far beyond the run
    registrations = []
    shrink_jobs = planes["shrink"][0].jobs
    original_register = shrink_jobs.register

    def recording_register(job_id, ranks, *args, **kwargs):
        registrations.append(sorted((r, n) for r, n, _ in ranks))
        return original_register(job_id, ranks, *args, **kwargs)

    shrink_jobs.register = recording_register
    jobs = {}
    try:
        # each job waits at a known step (hold_at) until its directive is out: on a loaded machine a
        # 60-step job can otherwise finish before the test gets to it
        jobs["spare-dies"] = _launch("spare-dies", planes["spare-dies"][1], tmp, [SPARE], hold_at=8,
                                     spare_env={"FORESHOCK_MIGRATOR_FAULT": "spare_dies_in_transfer"})
        jobs["shrink"] = _launch("shrink", planes["shrink"][1], tmp, [], fallback="shrink", hold_at=8)
        jobs["checkpoint"] = _launch("checkpoint", planes["checkpoint"][1], tmp, [], registered_spares=[SPARE],
                                     fallback="checkpoint_exit", hold_at=8)
        jobs["cancel"] = _launch("cancel", planes["cancel"][1], tmp, [SPARE], hold_at=8)
        # no control plane: directives published in the job's own store
        jobs["local"] = _launch("local", "", tmp, [SPARE], hold_at=5)
        directives = {}
        local = jobs["local"]
        local.wait_progress(5, timeout=180)
        publish_directive(local.store, "local", Directive("bogus", DirectiveKind.EVACUATE, (7,), "nowhere", SPARE,
                                                          at_step=0, reason="test: stale placement"))
        publish_directive(local.store, "local", Directive("expired", DirectiveKind.EVACUATE, (3,), NODES[3], SPARE,
                                                          at_step=0, reason="test: too late",
                                                          deadline=time.time() - 1.0))
        local.release()
        local.wait_progress(15, timeout=90)
        publish_directive(local.store, "local", Directive("good", DirectiveKind.EVACUATE, (3,), NODES[3], SPARE,
                                                          at_step=local.progress() + 2, reason="test: local"))
        for name, job in jobs.items():
            if name == "local":
                continue
            _wait_registered(planes[name][0], name)
            job.wait_progress(8, timeout=180)
            directives[name] = _drain(planes[name][1], NODES[1], f"test: {name}")
            job.release()
        cancel_plane = planes["cancel"][0]
        cancel_id = directives["cancel"].directive_id
        end = time.monotonic() + 30
        while cancel_plane.store.directive(cancel_id).state.name != "ACCEPTED" and time.monotonic() < end:
            time.sleep(0.02)       # every rank has heard of it and agreed; its step is still far off
        cancel_plane.jobs.cancel(cancel_id, "test: risk cleared")
        codes = {name: job.wait(timeout=120) for name, job in jobs.items()}
        local_acks = {k: local.store.check([f"foreshock/local/directives/ack/{k}"])
                      for k in ("bogus/failed", "bogus/completed", "expired/failed", "expired/accepted",
                                "good/accepted", "good/state_transferred", "good/completed")}
        listed = {n: {d.directive_id: d for d in p.jobs.list(n)} for n, (p, _) in planes.items()}
        acks = {n: p.store.acks(directives[n].directive_id) for n, (p, _) in planes.items()}
        yield {"codes": codes, "results": {n: _by_name(j.results()) for n, j in jobs.items()},
               "directives": directives, "listed": listed, "acks": acks, "out": tmp,
               "registrations": registrations, "local_acks": local_acks}
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


def test_cancelled_before_its_step_nothing_happens(fault_group):
    assert all(c == 0 for c in fault_group["codes"]["cancel"].values())
    res = fault_group["results"]["cancel"]
    for r in range(4):
        rec = res[f"rank{r}"]
        assert rec["exit"] == "finished" and _steps(rec) == list(range(STEPS)) and not rec["changes"]
    assert res[f"spare-{SPARE}"]["exit"] == "released"
    d = fault_group["listed"]["cancel"][fault_group["directives"]["cancel"].directive_id]
    assert d.state.name == "CANCELLED" and d.at_step > STEPS
    assert [a.phase.name for a in fault_group["acks"]["cancel"]] == ["ACCEPTED"]


def test_without_a_service_store_directives_bad_one_rejected_good_one_done(fault_group):
    assert all(c == 0 for c in fault_group["codes"]["local"].values())
    res = fault_group["results"]["local"]
    for r in (0, 1, 2):
        kinds = [(c["kind"], c["directive"]) for c in res[f"rank{r}"]["changes"]]
        assert kinds == [("rejected", "bogus"), ("evacuate", "good")], kinds
        assert _steps(res[f"rank{r}"]) == list(range(STEPS))
    assert "do not match placement" in res["rank0"]["changes"][0]["reason"]
    spare = res[f"spare-{SPARE}"]
    assert _steps(res["rank3"]) + _steps(spare) == list(range(STEPS))
    # past its deadline on arrival: dropped by every rank, reported failed, never acted on
    assert fault_group["local_acks"] == {"bogus/failed": True, "bogus/completed": False, "expired/failed": True,
                                         "expired/accepted": False, "good/accepted": True,
                                         "good/state_transferred": True, "good/completed": True}


def test_checkpoint_exit_then_restore_continues_bit_identically(tmp_path):
    """In this process: a one-rank world without DDP (the agreement takes its own all-reduce), a
    directive from a LocalDirectiveSource, a just-in-time checkpoint, and Migrator.restore()."""
    import torch.distributed as dist
    from datetime import timedelta
    from foreshock.migrator import LocalDirectiveSource, Migrator, MigratorConfig
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    cfg = MigratorConfig.from_env({}, job_id="solo", rank=0, world_size=1, node="n0",
                                  store=f"127.0.0.1:{store.port}", checkpoint_dir=str(tmp_path))

    def job(seed):
        model, opt, sched = example.build(2000, seed)
        pos = example.DataPosition()
        return model, opt, sched, pos

    def train_step(mig, model, opt, sched, pos):
        x, y = example.batch(SEED, mig.step, 0)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(mig.model(x), y).backward()
        opt.step()
        sched.step()
        pos.next_step += 1

    model, opt, sched, pos = job(SEED)
    source = LocalDirectiveSource()
    mig = Migrator(cfg, model=model, optimizer=opt, scheduler=sched, per_rank={"data": pos}, source=source,
                   wrap_ddp=False, store=store)
    try:
        assert mig.start() and mig.model is model
        change = None
        while mig.step < 40:
            train_step(mig, model, opt, sched, pos)
            if mig.step == 4:
                source.push(Directive("ck-1", DirectiveKind.CHECKPOINT_EXIT, (0,), "n0", "", at_step=9,
                                      reason="test: no spare"))
            change = mig.end_step()
            if change.leave:
                break
        assert change.kind == "checkpoint_exit" and mig.step == 9 and pos.next_step == 9
        assert mig.agreement_counts == {"piggybacked": 0, "separate": 9}
        assert [a.phase.value for a in source.acks] == ["accepted", "completed"]
    finally:
        mig.close()
    assert not dist.is_initialized()
    rng_at_exit = torch.get_rng_state()
    torch.manual_seed(12345)                     # a restarted process starts from another RNG state
    # a restarted job restores the checkpoint into fresh objects (another seed: nothing shared)
    model2, opt2, sched2, pos2 = job(SEED + 1)
    mig2 = Migrator(cfg, model=model2, optimizer=opt2, scheduler=sched2, per_rank={"data": pos2}, store=store)
    mig2.restore(change.checkpoint)
    assert (mig2.step, pos2.next_step, sched2.last_epoch) == (9, 9, sched.last_epoch)
    assert torch.equal(torch.get_rng_state(), rng_at_exit)
    # the original (still in memory) and the restored copy take the same next step, bit for bit
    rng = torch.get_rng_state()
    for m, o, s_ in ((model, opt, sched), (model2, opt2, sched2)):
        torch.set_rng_state(rng)
        x, y = example.batch(SEED, 9, 0)
        o.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        s_.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert example.param_hash(model) == example.param_hash(model2)
