"""Simulated step times (docs/simulator.md, "Step times"): the `step_times` table follows the jobs' load and
the straggler signatures, and every other table of a world is what it was before the table existed."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock import schema as sch
from foreshock.dataset import read_table
from foreshock.simulator.batch import SimSettings, run
from foreshock.simulator.faults import HOUR, NS, Episode, FaultSettings
from foreshock.simulator.model import ClusterModel
from foreshock.simulator.topology import Topology

T0 = 1_767_571_200 * NS  # 2026-01-05T00:00:00Z
EXISTING = tuple(t for t in sch.TABLES if t != "step_times")
# Each table's digest (column names and values) of a clean world, a random one, and a random one whose
# jobs move every 4 hours: the step times are written beside them and move none of them.
GOLDEN = {
    "clean": {
        "gpu": "de0604807c1a5da295fa1a25b62b0c980f0ffe2b3c68be5271723d056be948d6",
        "nvlink": "b122533ad6912ada252377d1e53eb738d46d9cb4c4d3295a389bfb24f57494b3",
        "nvlink_link": "464870b14c9c158b9c93c6f62f10ff7f19c318d5b762da11497e9c1b047ee842",
        "rdma_port": "1cc6f1beeb074ead29bef86bac9a5e09ec262f130ca1ae243ad0f871e9f88ebc",
        "netdev": "00f40e5ca3e48a8d4b7123affaea56319e933891bb5fe2df4fef0ac00969c7c8",
        "host_net": "ea6049327c9e73ae0a58a0eac52faa16b8423abca663a2b86156bbfc2dccf907",
        "path_probe": "06846fac880ea620764a96087580742d6c96d0eddeec6c875572f18994ef9946",
        "events": "0010344fbf2c3687bbae6618f005d87af5c8a5f0230c74e3da5a5f57ee38073f",
        "inventory": "e3e1eeddccbd6ac3d04d0fdfdb9a2b62ca1b6b14e9b2d11ef567d7c05e9e0ef9",
        "incidents": "8d4c92a9a76c331c0b75d8dafacd5521c846de423a58acc5b2a7b59e20fe4443",
        "systemd_unit": "8b19c4627ea583f488c8af5c3ad1e416f82b823b9a28d614e65e2ec72c03aa09",
    },
    "random": {
        "gpu": "5b6088a4f1c6dd4b77fcae3c0ecb2f66306ff7f26475902995bef03d0f4ad22b",
        "nvlink": "a5d04400c946138002625e5ba0cb81a82e9d509e709b40c4727a9b56528a7d64",
        "nvlink_link": "464870b14c9c158b9c93c6f62f10ff7f19c318d5b762da11497e9c1b047ee842",
        "rdma_port": "621b7536fa10a0ae46f81132fd19c412cb73c777a871d9fddcca6e923ba7fba0",
        "netdev": "b205e49b50defb8288a6c286fbff8fbe6b53e0c505219c98e588b61133966023",
        "host_net": "8b49ef0522db3b34077e7716b442fa894c17b723b1229521d98181cb2c8fa8d7",
        "path_probe": "339fe0221706659e409e27f4d634aefc5ca5f0b80c7c424bad0a4f560c649980",
        "events": "23cb8c8002a90d8ef3d35aaf8c39602662b2f69a1e81984769d11f9a06741640",
        "inventory": "40430c9cbe92bb7d4efa7065c8523f39f2a4526a5a460d837870a302106be122",
        "incidents": "e6340228c8fe94328fdecb4848f3b1c591acd1e1c14d6e5c61b5e884605b027b",
        "systemd_unit": "8b19c4627ea583f488c8af5c3ad1e416f82b823b9a28d614e65e2ec72c03aa09",
    },
    "churn": {
        "gpu": "c1881d9fc92ff298acec8dd98df6c805af9167972cb64c70eb31a0eb9de0d806",
        "nvlink": "1f8619c096e1746bc503008799eeaffc2e71e1df482fd0d81b89bb945fcf8101",
        "nvlink_link": "464870b14c9c158b9c93c6f62f10ff7f19c318d5b762da11497e9c1b047ee842",
        "rdma_port": "af19132a8cf9f5f8379b925d72904b8b4ec45b428301e8509dd1a9d7bbb1a9f4",
        "netdev": "b51ae314bae5f52a82ed755c18f10be97f258fe1c87c22707f00042db8a6c701",
        "host_net": "12fbd0edb584c4a3bd955d053fa92f4f392828345738d4e89d2864e5bfeefbec",
        "path_probe": "482e5badec63d114eea8aa8333772b8720e74c98c4d5778df7dd1503ed6318cf",
        "events": "0603c47e88317c70da465f22fcd1f024cacd0eaf09acdb2b8737ff4d86b38a3e",
        "inventory": "efa9e9e269f3859863aa8df2da9af03c95c9094e8ab7619ac5d282809e298142",
        "incidents": "6626542b373d9adaab434faf77a3843db4dafc4969b83bbc2b1cbe23eee9eb38",
        "systemd_unit": "8b19c4627ea583f488c8af5c3ad1e416f82b823b9a28d614e65e2ec72c03aa09",
    },
}
WORLDS = {
    "clean": dict(topology=Topology(nodes=6, nodes_per_leaf=3, job_nodes=3, sites=2), days=0.25, interval_s=120.0,
                  seed=3, faults=FaultSettings(rate_scale=3000.0)),
    "random": dict(topology=Topology(nodes=8, nodes_per_leaf=2, job_nodes=4, sites=2), days=0.25, interval_s=120.0,
                   seed=11, faults=FaultSettings(rate_scale=1500.0), world="random"),
    "churn": dict(topology=Topology(nodes=8, nodes_per_leaf=2, job_nodes=4, sites=2), days=0.25, interval_s=120.0,
                  seed=7, faults=FaultSettings(rate_scale=1500.0), world="random", knobs={"job_epoch_h": 4}),
}


def _digests(path) -> dict[str, str]:
    out = {}
    for table in EXISTING:
        data = read_table(path, table)
        h = hashlib.sha256()
        for name in data.column_names:
            h.update(name.encode())
            h.update(repr(data.column(name).to_pylist()).encode())
        out[table] = h.hexdigest()
    return out


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_every_other_table_is_unchanged(tmp_path, world):
    run(SimSettings(**WORLDS[world]), tmp_path, workers=1)
    assert _digests(tmp_path) == GOLDEN[world]


TOPO = Topology(nodes=10, nodes_per_leaf=5, job_nodes=4, spare_fraction=0.2)   # job-000: nodes 0-3
FAIL_H, LEAD_H = 9.0, 6.0


def _episode(signature=None):
    fail = T0 + int(FAIL_H * HOUR)
    ep = Episode("t-straggler", "straggler", "test", (0,), 0, fail - int(LEAD_H * HOUR), fail, True,
                 fail + int(2 * HOUR), 1.0, "", 1, 777)
    if signature:
        ep.extra.update(signature=signature, shape="ramp")
    return ep


def _simulate(episodes, world=None):
    from foreshock.simulator.scenarios import World

    world = world or World("clean", seed=5, n_pods=TOPO.n_leaves)
    model = ClusterModel(TOPO, seed=5, episodes=episodes, start_ns=T0, interval_s=60.0, world=world, step_times=True)
    ts = T0 + np.arange(0, 12 * 60) * 60 * NS
    # blocks split inside the job: the job-wide parts must not depend on which block a node is in
    parts = [model.generate(nodes, chunk) for chunk in np.array_split(ts, 3) for nodes in (np.arange(2), np.arange(2, 10))]
    return pa.concat_tables([p["step_times"] for p in parts]).sort_by([("node", "ascending"), ("ts", "ascending")])


def _pivot(table, column):
    frame = table.to_pandas()
    frame["ts"] = frame["ts"].astype("int64")
    return frame.pivot(index="ts", columns="rank", values=column)


def _late(frame):
    return frame[(frame.index > T0 + int((FAIL_H - 1) * HOUR)) & (frame.index < T0 + int(FAIL_H * HOUR))]


def test_the_table_is_schema_v1_and_its_rows_are_what_the_docs_say():
    table = _simulate([])
    assert table.schema.equals(sch.schema("step_times"), check_metadata=True)
    sch.conform("step_times", table)
    assert set(table.column("job").to_pylist()) == {"job-000", "job-001"}
    assert table.column("generation").null_count == table.num_rows
    spares = [TOPO.names[n] for n in np.flatnonzero(TOPO.job_of < 0)]
    assert spares and not set(spares) & set(table.column("node").to_pylist())   # idle nodes take no steps
    job0 = table.filter(pc.equal(table.column("job"), "job-000"))
    assert sorted(set(job0.column("rank").to_pylist())) == [0, 1, 2, 3]
    # one row per node and sample, the job's step ending then, every rank at the same step
    steps = _pivot(job0, "step")
    assert len(steps) == 12 * 60 and (steps.nunique(axis=1) == 1).all()
    whole, compute = _pivot(job0, "step_seconds"), _pivot(job0, "compute_seconds")
    assert ((compute > 0.4 * whole) & (compute < 0.6 * whole)).all().all()


def test_a_peer_lag_straggler_computes_longer_than_its_peers_and_only_over_its_precursor():
    base, sim = _simulate([]), _simulate([_episode()])
    job0 = sim.filter(pc.equal(sim.column("job"), "job-000"))
    compute = _pivot(job0, "compute_seconds")
    ratio = compute[0] / compute[[1, 2, 3]].median(axis=1)
    before = ratio[ratio.index < T0 + int((FAIL_H - LEAD_H) * HOUR)]
    assert (before.between(0.97, 1.03)).all()
    assert (_late(ratio) > 1.25).all() and _late(ratio).mean() > 1.35
    whole = _pivot(job0, "step_seconds")
    assert (_late(whole)[0] > _late(whole)[[1, 2, 3]].max(axis=1)).all()
    # the peers step as before; the culprit has no rows while it is drained for repair
    base0 = _pivot(base.filter(pc.equal(base.column("job"), "job-000")), "step_seconds")
    peers = whole[[1, 2, 3]].dropna()
    assert np.allclose(peers, base0.loc[peers.index, [1, 2, 3]])
    drained = (whole.index >= T0 + int(FAIL_H * HOUR) + 10 * 60 * NS) & (whole.index < T0 + int((FAIL_H + 2) * HOUR))
    assert whole.loc[drained, 0].isna().all()


def test_a_job_slow_straggler_slows_every_rank_and_computes_longest():
    from foreshock.simulator.scenarios import World

    world = World("random", seed=5, n_pods=TOPO.n_leaves,
                  knobs={"ts_jitter_s": 0, "missing_share": 0, "outages_per_node_day": 0, "job_epoch_h": 0,
                         "load_spread": 0.0, "load_diurnal": 0.0, "job_gap_share": 0.0})
    base, sim = _simulate([], world), _simulate([_episode("job_slow")], world)
    pick = lambda t, job: t.filter(pc.equal(t.column("job"), job))   # noqa: E731
    whole, whole0 = _pivot(pick(sim, "job-000"), "step_seconds"), _pivot(pick(base, "job-000"), "step_seconds")
    slowdown = _late(whole) / _late(whole0)
    assert (slowdown > 1.1).all().all() and slowdown.to_numpy().mean() > 1.15
    assert (slowdown.max(axis=1) / slowdown.min(axis=1) < 1.01).all()   # together
    compute = _pivot(pick(sim, "job-000"), "compute_seconds")
    assert (_late(compute)[0] / _late(compute)[[1, 2, 3]].median(axis=1) > 1.25).all()
    # another job does not move
    other, other0 = _pivot(pick(sim, "job-001"), "step_seconds"), _pivot(pick(base, "job-001"), "step_seconds")
    assert np.allclose(other, other0)
