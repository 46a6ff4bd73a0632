"""FSDP2 proof: real gloo jobs on CPU, 4 ranks + 1 warm spare, the example MLP sharded with fully_shard
(each Linear its own unit, plus the root), Adam + StepLR, data a pure function of (seed, step, rank).

Two jobs run side by side with the same seed: `moved` gets an evacuation of rank 1 mid-run (the leaving
rank sends its own parameter and optimizer shards, RNG and data position to the spare), `undisturbed`
gets nothing; `hsdp` (a 2 x 2 mesh) moves rank 1 too; `no-spare` has no spare. The script makes its
own group (env://, as under torchrun) and the migrator adopts it. In-process tests cover the layouts
the migrator refuses, the backend seam and a sharded checkpoint.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from foreshock.migrator import Directive, DirectiveKind, publish_directive  # noqa: E402
from foreshock.migrator import example  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

STEPS = 24
NODES = ["f0", "f1", "f2", "f3"]
SPARE = "f4"
SEED = 5


@pytest.fixture(scope="module")
def fsdp_jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migrator-fsdp")
    # each job waits at a known step (hold_at) until its directive is published: on a loaded machine
    # a 24-step job can otherwise finish before the test gets to it
    jobs = {name: example.launch(name, NODES, [SPARE], steps=STEPS, out_dir=tmp / name, seed=SEED,
                                 params=6000, step_sleep_s=0.02, transfer_timeout_s=30.0, mode="fsdp",
                                 hold_at=6 if name == "moved" else None)
            for name in ("moved", "undisturbed")}
    # no spare and fallback shrink: a sharded job cannot shrink, so it checkpoints and exits
    jobs["no-spare"] = example.launch("no-spare", NODES, [], steps=STEPS, out_dir=tmp / "no-spare", seed=SEED,
                                      params=6000, step_sleep_s=0.02, transfer_timeout_s=30.0, mode="fsdp",
                                      fallback="shrink", registered_spares=[SPARE], hold_at=4)
    # HSDP: two replicas of a 2-rank shard group; rank 1 (shard 1 of replica 0) moves
    # its spare is told NCCL, as a spare on a GPU node picks by itself: it must join with the job's
    # gloo (on the lent H200 a spare that kept NCCL left the new world waiting for its peers)
    jobs["hsdp"] = example.launch("hsdp", NODES, [SPARE], steps=STEPS, out_dir=tmp / "hsdp", seed=SEED,
                                  params=6000, step_sleep_s=0.02, transfer_timeout_s=30.0, mode="hsdp", hold_at=4,
                                  spare_backend="nccl")
    try:
        jobs["hsdp"].wait_progress(4, timeout=180)
        publish_directive(jobs["hsdp"].store, "hsdp", Directive("hs-1", DirectiveKind.EVACUATE, (1,), NODES[1], SPARE,
                                                                at_step=jobs["hsdp"].progress() + 2,
                                                                reason="test: hsdp"))
        jobs["hsdp"].release()
        jobs["no-spare"].wait_progress(4, timeout=180)
        publish_directive(jobs["no-spare"].store, "no-spare",
                          Directive("ns-1", DirectiveKind.EVACUATE, (2,), NODES[2], SPARE,
                                    at_step=jobs["no-spare"].progress() + 2, reason="test: no spare"))
        jobs["no-spare"].release()
        moved = jobs["moved"]
        moved.wait_progress(6, timeout=180)
        publish_directive(moved.store, "moved", Directive("fsdp-1", DirectiveKind.EVACUATE, (1,), NODES[1], SPARE,
                                                          at_step=moved.progress() + 2, reason="test: fsdp"))
        moved.release()
        codes = {name: job.wait(timeout=150) for name, job in jobs.items()}
        acks = {k: moved.store.get(f"foreshock/moved/directives/ack/fsdp-1/{k}").decode()
                for k in ("accepted", "state_transferred", "completed")}
        yield {"codes": codes, "results": {n: {r["name"]: r for r in j.results()} for n, j in jobs.items()},
               "procs": moved.processes, "acks": acks}
    finally:
        for job in jobs.values():
            job.wait(timeout=1)


def _steps(rec):
    return sorted(int(s) for s in rec["losses"])


def test_fsdp_spare_takes_the_leaving_ranks_shards_no_step_lost_or_repeated(fsdp_jobs):
    assert all(c == 0 for job in ("moved", "undisturbed") for c in fsdp_jobs["codes"][job].values()), \
        fsdp_jobs["codes"]
    res, procs = fsdp_jobs["results"]["moved"], fsdp_jobs["procs"]
    for r in (0, 2, 3):
        rec = res[f"rank{r}"]
        assert rec["pid"] == procs[f"rank{r}"].pid and rec["exit"] == "finished"
        assert _steps(rec) == list(range(STEPS)) and set(rec["ranks"].values()) == {r}
        assert [c["kind"] for c in rec["changes"]] == ["evacuate"]
    leaving, spare = res["rank1"], res[f"spare-{SPARE}"]
    k = spare["joined_at_step"]
    assert 6 < k < STEPS and leaving["exit"] == "evacuate"
    assert _steps(leaving) == list(range(k)) and _steps(spare) == list(range(k, STEPS))
    assert set(spare["ranks"].values()) == {1}
    # the spare holds exactly the shards rank 1 held when it left
    assert spare["hashes"][str(k)] == leaving["hashes"][str(k)]


def test_fsdp_loss_and_every_shard_bit_identical_to_the_undisturbed_run(fsdp_jobs):
    moved, ref = fsdp_jobs["results"]["moved"], fsdp_jobs["results"]["undisturbed"]

    def curve(recs):
        out = {}
        for rec in recs.values():
            for s, loss in rec["losses"].items():
                key = (rec["ranks"][s], int(s))
                assert key not in out, f"step {key} ran twice"
                out[key] = loss
        return out

    got, want = curve(moved), curve(ref)
    assert set(got) == set(want) == {(r, s) for r in range(4) for s in range(STEPS)}
    assert got == want                      # exact: bit-identical float losses on every rank and step
    assert want[(0, STEPS - 1)] != want[(0, 0)]
    # every rank's final shards (rank 1's now in the spare) equal the undisturbed run's, bit for bit
    final = {rec["ranks"][str(STEPS - 1)]: rec["hashes"][str(STEPS)] for rec in moved.values()
             if rec["exit"] == "finished"}
    ref_final = {rec["ranks"][str(STEPS - 1)]: rec["hashes"][str(STEPS)] for rec in ref.values()
                 if rec["exit"] == "finished"}
    assert final == ref_final and len(final) == 4
    assert len(set(final.values())) == 4    # shards: each rank holds different rows


def test_fsdp_switch_acknowledged_with_bytes_from_the_leaving_rank(fsdp_jobs):
    import json
    transferred = json.loads(fsdp_jobs["acks"]["state_transferred"])
    # the shards came from rank 1 itself; the replica-less coordinator sent only the small shared part
    assert "from rank 1 (own shards and state)" in transferred["reason"]
    assert json.loads(fsdp_jobs["acks"]["completed"])["phase"] == "completed"
    res = fsdp_jobs["results"]["moved"]
    assert all(rec["final"]["agreements"]["separate"] == STEPS - (rec.get("joined_at_step") or 0)
               for rec in res.values() if rec.get("final"))


def test_hsdp_spare_takes_the_leaving_ranks_shards_and_agrees_with_their_replica(fsdp_jobs):
    codes = fsdp_jobs["codes"]["hsdp"]
    assert all(c == 0 for c in codes.values()), codes
    res = fsdp_jobs["results"]["hsdp"]
    spare, leaving = res[f"spare-{SPARE}"], res["rank1"]
    k = spare["joined_at_step"]
    assert _steps(leaving) == list(range(k)) and _steps(spare) == list(range(k, STEPS)) and 4 < k < STEPS
    for r in (0, 2, 3):
        assert _steps(res[f"rank{r}"]) == list(range(STEPS))
    final = {rec["ranks"][str(STEPS - 1)]: rec["hashes"][str(STEPS)] for rec in res.values()
             if rec["exit"] == "finished"}
    # mesh (replicate, shard) = [[0, 1], [2, 3]]: rank 1's shards, now in the spare, still equal
    # those of its replica, rank 3, bit for bit, after the steps of the new world
    assert final[1] == final[3] and final[0] == final[2] and final[0] != final[1]


def test_fsdp_without_a_spare_does_not_shrink_but_checkpoints_every_shard(fsdp_jobs):
    from foreshock.migrator.transfer import load_checkpoint
    codes = fsdp_jobs["codes"]["no-spare"]
    assert all(c == 3 for c in codes.values()) and len(codes) == 4, codes
    res = fsdp_jobs["results"]["no-spare"]
    (path,) = {rec["changes"][0]["checkpoint"] for rec in res.values()}
    for r in range(4):
        change = res[f"rank{r}"]["changes"][0]
        assert change["kind"] == "checkpoint_exit" and "cannot shrink" in change["reason"]
        local = load_checkpoint(f"{path}.rank{r}")
        shards = local["shards"]["model"]
        assert set(shards) == {"0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias"}
        assert set(local["shards"]["optimizer"]["state"]) == set(shards)   # Adam's moments, per shard
    assert load_checkpoint(path)["model"] is None         # no rank holds the whole model


def _one_rank_world():
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return store


def test_a_layout_other_than_fsdp2_or_hsdp_and_a_sharded_model_without_reshard_are_refused():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from foreshock.migrator import Migrator, MigratorConfig
    from foreshock.migrator.sharded import UnsupportedMeshError, check_layout
    store = _one_rank_world()
    try:
        cfg = MigratorConfig.from_env({}, job_id="hsdp", rank=0, world_size=1, node="n0",
                                      store=f"127.0.0.1:{store.port}")
        flat = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        check_layout(flat)                         # FSDP2 on a 1-D mesh: understood
        with pytest.raises(ValueError, match="pass reshard="):
            Migrator(cfg, model=flat, store=store)
        hsdp = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1),
                                                                         mesh_dim_names=("replicate", "shard")))
        assert check_layout(hsdp) == ((1, 1), ("replicate", "shard"))      # HSDP: understood
        from torch.distributed.tensor import Shard
        by_columns = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)),
                                 shard_placement_fn=lambda p: Shard(p.dim() - 1))
        with pytest.raises(UnsupportedMeshError, match=r"weight .*Shard\(dim=1\)"):
            check_layout(by_columns)
        mig = Migrator(cfg, model=by_columns, optimizer=torch.optim.Adam(by_columns.parameters()), store=store,
                       reshard=lambda mesh: by_columns)
        with pytest.raises(UnsupportedMeshError, match="1-D mesh"):
            mig.start()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_backend_seam_forms_abandons_and_forms_again_a_gloo_world():
    import torch.distributed as dist
    from foreshock.migrator.backends import backend_seam
    with pytest.raises(ValueError, match="backend 'mpi'"):
        backend_seam("mpi")
    seam = backend_seam("gloo")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    try:
        for gen in range(2):                 # a new world on a fresh prefix after abandoning the last
            seam.init_world(dist.PrefixStore(f"g{gen}/", store), 0, 1, timedelta(seconds=30))
            assert seam.mesh((1,)).device_type == "cpu"
            t = torch.ones(3)
            dist.all_reduce(t)
            assert t.tolist() == [1.0, 1.0, 1.0]
            seam.abandon()
            assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                    reason="the NCCL path needs a CUDA device")
def test_the_nccl_seam_binds_the_device_aborts_and_forms_again():
    import torch.distributed as dist
    from foreshock.migrator.backends import backend_seam
    seam = backend_seam("nccl")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    try:
        for gen in range(2):
            seam.init_world(dist.PrefixStore(f"g{gen}/", store), 0, 1, timedelta(seconds=60))
            t = torch.ones(3, device=seam.device())
            dist.all_reduce(t)
            assert t.cpu().tolist() == [1.0, 1.0, 1.0]
            assert seam.mesh((1,)).device_type == "cuda"
            seam.abandon()                   # ncclCommAbort, then the group is gone
            assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_sharded_checkpoint_restores_into_a_fresh_sharded_model_bit_identically(tmp_path):
    import functools
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from foreshock.migrator import Migrator, MigratorConfig
    store = _one_rank_world()
    try:
        cfg = MigratorConfig.from_env({}, job_id="ck", rank=0, world_size=1, node="n0",
                                      store=f"127.0.0.1:{store.port}", checkpoint_dir=str(tmp_path))
        mesh = init_device_mesh("cpu", (1,))

        def job(seed):
            model = example.shard(3000, mesh, seed=seed)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            mig = Migrator(cfg, model=model, optimizer=opt, store=store,
                           reshard=functools.partial(example.shard, 3000))
            return model, opt, mig

        def train(model, opt, step):
            x, y = example.batch(SEED, step, 0)
            opt.zero_grad()
            model.eval()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        model, opt, mig = job(SEED)
        for step in range(3):
            train(model, opt, step)
        path = mig._save_checkpoint(replicated=True)
        model2, opt2, mig2 = job(SEED + 1)           # other values: nothing shared but the checkpoint
        mig2.restore(path)
        for m, o in ((model, opt), (model2, opt2)):
            train(m, o, 3)
        assert example.param_hash(model) == example.param_hash(model2)
        assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), model2.parameters()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
