"""An NVLink domain (an NVL72 rack) as a blast-radius scope beside the leaf switch and the site: the
inventory's nvlink_domain reaches the node book, and most of a domain in alarm is a fabric incident."""

from __future__ import annotations

import numpy as np
import pytest

from foreshock import schema as sch
from foreshock.service.decisions import DecisionLog, incident_rows, read_decisions
from foreshock.service.ingest import Ingest
from foreshock.service.jobs import JobDirectory
from foreshock.service.nodes import NodeBook, Topology
from foreshock.service.policy import EvacuationPolicy, PolicySettings
from foreshock.service.store import StateStore

S = 1_000_000_000
T0 = 1_800_000_000 * S
NODES = [f"n{i:02d}" for i in range(16)]   # leaves l0 = n00..n03, ...; the rack: n00, n04, n08, n12
RACK = "5f0ab1c0-0000-0000-0000-000000000000/32766"


@pytest.fixture
def world(tmp_path):
    clock = lambda: T0  # noqa: E731
    store = StateStore(tmp_path / "state.sqlite3", clock=clock)
    jobs = JobDirectory(store, clock=clock)
    nodes = NodeBook()
    for i, n in enumerate(NODES):
        nodes.set_topology(n, Topology(site="s0" if i < 12 else "s1", leaf_switch=f"l{i // 4}",
                                       nvlink_domain=RACK if i % 4 == 0 else ""))
        nodes.seen(n, T0)
    decisions = DecisionLog(tmp_path / "decisions", fsync=False, clock=clock)
    jobs.register("A", [(i, NODES[i], [0]) for i in range(0, 16, 4)], ["n01", "n05"], current_step=1000)
    store.report_step("A", 1000, 0.5)
    policy = EvacuationPolicy(PolicySettings(threshold=0.5, cooldown_seconds=60), nodes, jobs, decisions)
    yield store, nodes, decisions, policy
    store.close()


def test_most_of_an_nvlink_domain_in_alarm_is_a_fabric_incident(world, tmp_path):
    store, nodes, decisions, policy = world
    risk = np.array([0.9 if n in ("n00", "n04", "n08", "n12") else 0.01 for n in NODES])
    nodes.update_risk(NODES, risk, [[] for _ in NODES], T0)
    # one node per leaf, a quarter of site s0: only the rack holds most of them
    assert policy.evaluate(T0, NODES, risk) == []
    assert set(policy.incidents) == {("nvlink_domain", RACK)}
    assert store.directives() == []
    decisions.flush()
    (row,) = incident_rows(read_decisions(tmp_path / "decisions")).to_pylist()
    assert row["scope"] == "nvlink_domain" and row["component"] == RACK
    assert sorted(row["affected_nodes"]) == ["n00", "n04", "n08", "n12"]


def test_nodes_outside_any_domain_are_no_domain_incident(world):
    store, nodes, decisions, policy = world
    risk = np.array([0.9 if n in ("n01", "n05", "n09") else 0.01 for n in NODES])
    nodes.update_risk(NODES, risk, [[] for _ in NODES], T0)
    policy.evaluate(T0, NODES, risk)
    assert not any(scope == "nvlink_domain" for scope, _ in policy.incidents)


def test_the_inventorys_nvlink_domain_reaches_the_node_book():
    nodes = NodeBook()
    ingest = Ingest(nodes, sink=lambda p: 0)
    inv = sch.to_table("inventory", [
        {"ts": T0, "node": "tray-01", "site": "s0", "leaf_switch": "l0", "nvlink_domain": RACK},
        {"ts": T0, "node": "hgx-01", "site": "s0", "leaf_switch": "l0", "nvlink_domain": None}])
    ingest.act_on_events({"inventory": inv}, T0)
    assert nodes.topo("tray-01") == Topology("s0", "", "l0", RACK)
    assert nodes.topo("hgx-01").nvlink_domain == "" and nodes.nodes_under("nvlink_domain", RACK) == {"tray-01"}


def test_a_job_inside_one_nvlink_domain_takes_its_spare_from_that_domain(tmp_path):
    clock = lambda: T0  # noqa: E731
    store = StateStore(tmp_path / "state.sqlite3", clock=clock)
    jobs = JobDirectory(store, clock=clock)
    nodes = NodeBook()
    other = "9e0ab1c0-0000-0000-0000-000000000000/7"
    for n, domain, leaf in (("r0", RACK, "l0"), ("r1", RACK, "l0"), ("r2", RACK, "l0"),
                            ("o0", other, "l1"), ("h0", "", "l2")):
        nodes.set_topology(n, Topology(site="s0", leaf_switch=leaf, nvlink_domain=domain))
        nodes.seen(n, T0)
    decisions = DecisionLog(tmp_path / "decisions", fsync=False, clock=clock)
    policy = EvacuationPolicy(PolicySettings(threshold=0.5), nodes, jobs, decisions)
    try:
        # spares on other leaves rank first, so only the domain rule keeps o0 and h0 out
        jobs.register("rack", [(0, "r0", [0]), (1, "r1", [0])], ["o0", "h0", "r2"], current_step=10)
        job = store.job("rack")
        assert policy.job_nvlink_domain(job) == RACK
        assert policy.choose_spare(job, "r0", T0, set()) == ("r2", "")
        spare, why = policy.choose_spare(job, "r0", T0, {"r2"})
        assert spare is None and f"o0: outside the job's NVLink domain {RACK}" in why
        # a job across domains (or on HGX nodes) takes any usable spare, the other leaves first
        jobs.register("wide", [(0, "r0", [0]), (1, "o0", [0])], ["h0", "r2"], current_step=10)
        wide = store.job("wide")
        assert policy.job_nvlink_domain(wide) == ""
        assert policy.choose_spare(wide, "r0", T0, set()) == ("h0", "")
    finally:
        store.close()
