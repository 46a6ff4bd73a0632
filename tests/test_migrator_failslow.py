"""Fail-slow end to end: real gloo jobs (foreshock.migrator.example) reporting each rank's step times to
a real control plane on a port. One node of a job computes slowly (a sleep between its forward and
backward passes, before the gradient all-reduce): its rank is evacuated to the spare with a FAIL_SLOW
directive while training goes on. A job whose nodes are all equally slow raises nothing; a job whose
control plane is not there trains to the end, its step times dropped and counted. The three jobs run
concurrently."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from foreshock.migrator import example  # noqa: E402
from support import free_port  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

STEPS = 80
NODES = ["node-a", "node-b", "node-c", "node-d"]
SPARE = "node-e"
ENV = {"FORESHOCK_STEP_REPORT_INTERVAL_S": "0.2"}


def _plane(tmp_path, name):
    from foreshock.service.scoring import NullScorer
    from foreshock.service.server import Settings, build_server
    plane = build_server(Settings.insecure_loopback(
        tmp_path / f"state-{name}", scorer=NullScorer(), decision_flush_seconds=3600,
        policy={"lead_seconds": 0.3, "min_steps_ahead": 6, "stale_seconds": 3600.0}))
    port = plane.start()
    return plane, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migrator-failslow")
    plane_s, addr_s = _plane(tmp, "slow")
    plane_e, addr_e = _plane(tmp, "even")
    jobs = {}
    try:
        common = dict(steps=STEPS, seed=3, step_sleep_s=0.01, transfer_timeout_s=20.0, env=ENV)
        jobs["slow"] = example.launch("slow", NODES, [SPARE], out_dir=tmp / "slow", service=addr_s,
                                      slow_nodes={"node-c": 0.06}, **common)
        jobs["even"] = example.launch("even", NODES, [], out_dir=tmp / "even", service=addr_e,
                                      slow_nodes={n: 0.06 for n in NODES}, **common)
        jobs["outage"] = example.launch("outage", NODES[:3], [], out_dir=tmp / "outage",
                                        service=f"127.0.0.1:{free_port()}", **common)
        codes = {name: job.wait(timeout=300) for name, job in jobs.items()}
        # the last batches of step times arrive as the ranks close: give the policy a few rounds
        time.sleep(0.5)
        yield {"codes": codes, "results": {n: {r["name"]: r for r in j.results()} for n, j in jobs.items()},
               "slow": plane_s, "even": plane_e,
               "directives": {"slow": plane_s.jobs.list("slow"), "even": plane_e.jobs.list("even")},
               "decisions": {"slow": plane_s.decisions.buffered(), "even": plane_e.decisions.buffered()}}
    finally:
        for job in jobs.values():
            job.wait(timeout=1)
        for plane in (plane_s, plane_e):
            plane.stop(grace=0.2)


def test_the_slow_nodes_rank_moves_to_the_spare_with_a_fail_slow_directive(group):
    assert all(c == 0 for c in group["codes"]["slow"].values()), group["codes"]["slow"]
    (d,) = group["directives"]["slow"]
    assert d.cause.name == "FAIL_SLOW" and d.kind.name == "EVACUATE"
    assert (d.ranks, d.from_node, d.to_node, d.state.name) == ((2,), "node-c", SPARE, "COMPLETED")
    assert d.reason.startswith("fail-slow: rank 2 compute time"), d.reason
    kinds = [(r["kind"], r["node"]) for r in group["decisions"]["slow"]]
    assert ("fail_slow", "node-c") in kinds and ("evacuate", "node-c") in kinds
    res = group["results"]["slow"]
    assert res["rank2"]["exit"] == "evacuate"
    spare = res[f"spare-{SPARE}"]
    assert spare["exit"] == "finished" and set(spare["ranks"].values()) == {2}
    for r in (0, 1, 3):     # training went on in the same processes, every step once
        assert sorted(int(s) for s in res[f"rank{r}"]["losses"]) == list(range(STEPS))


def test_a_job_slow_on_every_node_alike_raises_no_alarm(group):
    assert all(c == 0 for c in group["codes"]["even"].values()), group["codes"]["even"]
    assert group["directives"]["even"] == []
    assert "fail_slow" not in [r["kind"] for r in group["decisions"]["even"]]
    plane = group["even"]
    # the reports did arrive and were judged: most of every rank's steps are in
    assert plane.step_times.samples["kept"] >= len(NODES) * STEPS // 2
    assert all(rec["final"]["step_times"]["sent"] > 0 for rec in group["results"]["even"].values())


def test_without_its_control_plane_the_job_trains_on_and_counts_what_it_dropped(group):
    assert all(c == 0 for c in group["codes"]["outage"].values()), group["codes"]["outage"]
    for rec in group["results"]["outage"].values():
        assert rec["exit"] == "finished" and len(rec["losses"]) == STEPS
        assert rec["final"]["step_times"]["sent"] == 0
        assert rec["final"]["step_times"]["dropped"] > 0
