"""The NVLink-fabric failure mode of a multi-node NVLink domain (simulator/faults.py, mode nvswitch): its
non-fatal SXids densify over the lead and the domain's GPUs report degraded bandwidth and access-timeout
recovery, then a fatal SXid and a Fatal NVLink5 Xid 149 on every GPU of the domain (the GPUs of an NVL72 rack
are GB200s), each non-fatal SXid with a Nonfatal Xid 145 at its link's GPU end; its look-alike is a few SXids
that stop.
The rows are what collectors/sxid.py writes from the driver's lines and what the control plane's ingest
takes. Worlds without multi-node NVLink domains come out exactly as before the mode existed."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock import fabric
from foreshock import schema as sch
from foreshock import xid as xidcat
from foreshock.collectors.kmsg import parse_dmesg_line, parse_event
from foreshock.collectors.sxid import parse_sxid
from foreshock.dataset import read_table
from foreshock.service import validation
from foreshock.service.ingest import Ingest, IngestLimits
from foreshock.service.nodes import NodeBook
from foreshock.simulator.batch import SimSettings, run
from foreshock.simulator.faults import (FABRIC_CATEGORIES, HOUR, MODES, NS, NVLINK_FABRIC, Episode, FaultSettings,
                                        injected, schedule)
from foreshock.simulator.model import (LINK_DOWN_XIDS, LINK_ERROR_XID, NVSWITCH_FATAL_SXID, NVSWITCH_NONFATAL_SXIDS,
                                       ClusterModel)
from foreshock.simulator.topology import NVSWITCHES_PER_TRAY, Topology
from test_simulator_worlds import _digest

T0 = 1_767_571_200 * NS  # 2026-01-05T00:00:00Z
# Two NVLink domains of three 4-GPU trays each.
TOPO = Topology(nodes=6, gpus_per_node=4, hcas_per_node=4, nvlink_domain_nodes=3, nodes_per_leaf=6, job_nodes=3,
                spare_fraction=0.0)
DOMAIN, OTHER = (0, 1, 2), (3, 4, 5)
LEAD_H, FAIL_H, REPAIR_H = 4.0, 6.0, 3.0
# The tables of small worlds without NVLink domains (tests/test_simulator_worlds.py's digest): a random
# world and benchmarks/scenarios/shifted.toml's. The fabric mode draws from a stream of its own and
# writes nothing there, so they do not move with it.
RANDOM_GOLDEN = "5919b9782a43e68d9717586ede46ea4a51c6980c0cea3f7ad78a7b04c66c7c45"
SHIFTED_GOLDEN = "d44b558b94a2bd54558ee9cd9b8ad5286f71ff856bfb73e9d1deefd9822a0d2b"


def _episode(fails=True, peak=1.0, switch=5):
    fail = T0 + int(FAIL_H * HOUR)
    return Episode("t-nvswitch", "nvswitch", NVLINK_FABRIC if fails else None, DOMAIN, switch,
                   fail - int(LEAD_H * HOUR), fail, fails, fail + int(REPAIR_H * HOUR) if fails else 0, peak,
                   TOPO.nvlink_domain_name(0), 7, 4242)


def _simulate(episodes, hours=12.0, interval_s=60.0):
    model = ClusterModel(TOPO, seed=5, episodes=episodes, start_ns=T0, interval_s=interval_s)
    ts = T0 + np.arange(0, int(hours * 3600 / interval_s)) * int(interval_s * NS)
    # two blocks of nodes split inside the domain, three chunks of time: every node logs the same lines
    parts = [model.generate(nodes, chunk) for chunk in np.array_split(ts, 3) for nodes in (np.arange(2), np.arange(2, 6))]
    return {name: pa.concat_tables([p[name] for p in parts if name in p]) for name in parts[0]}


@pytest.fixture(scope="module")
def failing():
    return _simulate([_episode()])


def _int_ts(table):
    return table.set_column(table.schema.get_field_index("ts"), "ts", table.column("ts").cast(pa.int64()))


def _rows(table, kind=None):
    return [r for r in _int_ts(table).to_pylist() if kind is None or r["kind"] == kind]


def _frame(table):
    return _int_ts(table).to_pandas()


def test_worlds_without_nvlink_domains_are_unchanged(tmp_path):
    knobs = tomllib.loads((Path(__file__).parents[1] / "benchmarks/scenarios/shifted.toml").read_text())["simulate"]["knobs"]
    topo = Topology(nodes=8, nodes_per_leaf=2, job_nodes=4, sites=2)
    for name, golden, extra in (("random", RANDOM_GOLDEN, {}), ("shifted", SHIFTED_GOLDEN, {"knobs": knobs})):
        run(SimSettings(topology=topo, days=0.25, interval_s=120.0, seed=11 if name == "random" else 12,
                        faults=FaultSettings(rate_scale=1500.0), world="random", **extra), tmp_path / name, workers=1)
        assert _digest(tmp_path / name) == golden, name
        assert not _rows(read_table(tmp_path / name, "events"), "sxid")


@pytest.mark.parametrize("world", ["clean", "random"])
def test_the_fabric_draws_from_its_own_stream(world):
    """A topology with NVLink domains has every episode of the same topology without them, and the
    fabric's own besides: the other episodes' draws did not move."""
    flat = Topology(nodes=36, gpus_per_node=4, hcas_per_node=4, nodes_per_leaf=18, job_nodes=18)
    racks = Topology(nodes=36, gpus_per_node=4, hcas_per_node=4, nodes_per_leaf=18, job_nodes=18, nvlink_domain_nodes=18)
    settings = FaultSettings(rate_scale=20.0)
    span = (T0, T0 + 60 * 24 * HOUR)

    def episodes(topo):
        from foreshock.simulator.scenarios import World
        return schedule(topo, *span, 3, settings, World(world, seed=3, n_pods=topo.n_leaves))

    without, with_racks = episodes(flat), episodes(racks)
    assert not [e for e in without if e.mode == "nvswitch"]
    fabric_eps = [e for e in with_racks if e.mode == "nvswitch"]
    assert [e for e in with_racks if e.mode != "nvswitch"] == without
    assert any(e.fails for e in fabric_eps) and any(not e.fails for e in fabric_eps)
    for e in fabric_eps:
        assert set(e.nodes) in ({*range(18)}, {*range(18, 36)})
        assert e.category == (NVLINK_FABRIC if e.fails else None)


def test_the_precursor_densifies_in_sxids_and_sets_the_fabric_mask_in_the_domain_only(failing):
    fail, start = T0 + int(FAIL_H * HOUR), T0 + int((FAIL_H - LEAD_H) * HOUR)
    sxids = _rows(failing["events"], "sxid")
    early = [r for r in sxids if r["ts"] < fail]
    assert early and {r["severity"] for r in early} == {"precursor"}
    assert {r["sxid"] for r in early} <= {c for c, _ in NVSWITCH_NONFATAL_SXIDS}
    assert {r["node"] for r in sxids} == {TOPO.names[n] for n in DOMAIN}
    assert all(start <= r["ts"] for r in early)
    # every node of the domain logs the same lines, whichever block computed it
    per_node = {n: sorted((r["ts"], r["sxid"], r["link"]) for r in early if r["node"] == TOPO.names[n]) for n in DOMAIN}
    assert per_node[0] == per_node[1] == per_node[2]
    half = start + (fail - start) // 2
    lines = per_node[0]
    assert sum(t >= half for t, _, _ in lines) > 2 * sum(t < half for t, _, _ in lines)  # densifying (x^2)
    gpu = _frame(failing["gpu"])
    domain = gpu[gpu.node.isin([TOPO.names[n] for n in DOMAIN])]
    other = gpu[gpu.node.isin([TOPO.names[n] for n in OTHER])]
    assert (other.fabric_health_mask == fabric.HEALTHY_MASK).all() and not other.fabric_degraded_bw.any()
    before = domain[domain.ts < start]
    assert (before.fabric_health_mask == fabric.HEALTHY_MASK).all() and (before.fabric_health_summary == 1).all()
    late = domain[(domain.ts >= fail - HOUR) & (domain.ts < fail)]
    assert late.fabric_access_timeout_recovery.all() and late.fabric_degraded_bw.all()
    assert (late.fabric_health_summary == 3).all()  # limited capacity
    first_quarter = domain[(domain.ts >= start) & (domain.ts < start + HOUR)]
    assert not first_quarter.fabric_degraded_bw.any()  # the mask follows the intensity, late in the lead
    assert set(late.fabric_health_mask) == {fabric.with_unhealthy(fabric.with_unhealthy(
        fabric.HEALTHY_MASK, "fabric_access_timeout_recovery"), "fabric_degraded_bw")}


def test_the_failure_is_a_fatal_sxid_and_a_fatal_nvlink5_xid_on_every_gpu_of_the_domain(failing):
    fabric_xid = LINK_DOWN_XIDS[TOPO.gpu_generation][0]
    assert TOPO.gpu_generation == xidcat.GB200 and fabric_xid == 149
    fail, repaired = T0 + int(FAIL_H * HOUR), T0 + int((FAIL_H + REPAIR_H) * HOUR)
    events = failing["events"]
    fatal = [r for r in _rows(events) if r["severity"] == "fatal"]
    code, lines = NVSWITCH_FATAL_SXID
    assert {(r["node"], r["kind"], r["sxid"] or r["xid"]) for r in fatal} == \
        {(TOPO.names[n], "sxid", code) for n in DOMAIN} | {(TOPO.names[n], "xid", fabric_xid) for n in DOMAIN}
    assert all(r["ts"] == fail for r in fatal)
    assert sorted(r["gpu"] for r in fatal if r["kind"] == "xid") == sorted(list(range(4)) * 3)
    details = [r for r in _rows(events, "sxid") if r["ts"] == fail and r["severity"] == "info"]
    assert len(details) == (len(lines) - 1) * len(DOMAIN) and all(r["sxid"] == code for r in details)
    assert xidcat.lookup(fabric_xid).collateral and xidcat.lookup(fabric_xid).nvlink
    xids = [r for r in fatal if r["kind"] == "xid"]
    # the line names the failed chip as the GPU's link, and its Fatal token is what makes it fatal
    assert all("NETIR_LINK_EVT Fatal XC0 i0 Link 05 " in r["message"] and r["pid"] is None for r in xids)
    _agree_with_the_kmsg_reading(xids)
    nvl = _frame(failing["nvlink"])
    down = nvl[(nvl.ts >= fail) & (nvl.ts < repaired)]
    in_domain = down.node.isin([TOPO.names[n] for n in DOMAIN])
    assert (down[in_domain].links_up == down[in_domain].links_total - NVSWITCHES_PER_TRAY).all()
    assert (down[~in_domain].links_up == down[~in_domain].links_total).all()
    after = nvl[nvl.ts >= repaired]
    assert len(after) and (after.links_up == after.links_total).all()
    gpu = _frame(failing["gpu"])
    out = gpu[(gpu.ts >= fail) & (gpu.ts < repaired) & gpu.node.isin([TOPO.names[n] for n in DOMAIN])]
    assert len(out) == 3 * 4 * REPAIR_H * 60 and out.fabric_degraded_bw.all()  # not drained: the trays report on
    back = gpu[gpu.ts >= repaired]
    assert (back.fabric_health_mask == fabric.HEALTHY_MASK).all()


def test_each_non_fatal_sxid_has_a_nonfatal_nvlink5_xid_at_its_gpu_end(failing):
    fail = T0 + int(FAIL_H * HOUR)
    events = _rows(failing["events"])
    sxids = sorted((r["ts"], r["link"]) for r in events if r["kind"] == "sxid" and r["ts"] < fail
                   and r["node"] == TOPO.names[0])
    code, _ = LINK_ERROR_XID
    assert not [r for r in events if r["kind"] == "xid" and r["xid"] == code and r["ts"] >= fail]
    xids = [r for r in events if r["kind"] == "xid" and r["xid"] == code]
    assert xids and {r["severity"] for r in xids} == {"precursor"}
    # switch link l is GPU l % 4 of the domain's node l // 4; the GPU names its own link to chip 5
    assert sorted((r["ts"], DOMAIN.index(TOPO.index(r["node"])) * 4 + r["gpu"]) for r in xids) == sxids
    assert all(r["message"].startswith("RLW_RXPIPE Nonfatal XC0 i0 Link 05 (") for r in xids)
    assert all(xidcat.classify(r["xid"], r["severity"]) == "precursor" and xidcat.lookup(r["xid"]).nvlink for r in xids)
    _agree_with_the_kmsg_reading(xids)


def _agree_with_the_kmsg_reading(xids):
    """The kmsg collector's reading of each row's driver line (an NVLink5 line names no process, an
    older one an unknown one) is the row: code, class, GPU, no process and the message."""
    for r in xids:
        process = "" if xidcat.lookup(r["xid"]).token else "pid='<unknown>', name=<unknown>, "
        line = f"NVRM: Xid (PCI:{r['pci_bus_id'][:-2]}): {r['xid']}, {process}{r['message']}"
        keys = ("kind", "xid", "severity", "pci_bus_id", "pid", "process_name", "message")
        assert {k: v for k, v in parse_event(line).items() if k in keys} == {k: r[k] for k in keys}


HGX = Topology(nodes=2, gpus_per_node=8, hcas_per_node=8, nodes_per_leaf=2, job_nodes=2, spare_fraction=0.0)


@pytest.mark.parametrize("topo, code", [(HGX, 74), (TOPO, 149)], ids=["hgx-h100", "nvl-gb200"])
def test_a_gpus_own_link_taken_down_logs_its_generations_xid(topo, code):
    assert LINK_DOWN_XIDS[topo.gpu_generation][0] == code
    fail = T0 + int(FAIL_H * HOUR)
    ep = Episode("t-nvlink", "nvlink", "faulty_gpu", (1,), 3, fail - int(LEAD_H * HOUR), fail, True,
                 fail + int(REPAIR_H * HOUR), 1.0, "", 20, 99)
    model = ClusterModel(topo, seed=5, episodes=[ep], start_ns=T0, interval_s=60.0)
    tables = model.generate(np.arange(2), T0 + np.arange(0, 8 * 60) * 60 * NS)
    xids = [r for r in _rows(tables["events"], "xid") if r["severity"] == "fatal"]
    assert [(r["node"], r["gpu"], r["xid"]) for r in xids] == [(topo.names[1], 3, code)]
    if code == 74:
        assert xids[0]["message"] == xidcat.lookup(74).example
    else:   # the variant's link among the GPU's 18
        assert xids[0]["message"].startswith("NETIR_LINK_EVT Fatal XC0 i0 Link 02 (")
    _agree_with_the_kmsg_reading(xids)


def test_the_rows_are_what_the_collector_writes_and_the_ingest_takes(failing):
    events = failing["events"]
    assert events.schema.equals(sch.schema("events"), check_metadata=False)
    for r in _rows(events, "sxid"):
        line = f"nvidia-{r['device']}: SXid (PCI:{r['pci_bus_id']}): {r['sxid']:05d}, {r['message']}"
        parsed = parse_sxid(line)
        assert {k: r[k] for k in parsed} == parsed
        assert parse_event(parse_dmesg_line(f"[  123.456789] {line}").message) == parsed  # the kmsg source's reading
    gpu = failing["gpu"]
    for name, table in (("events", events), ("gpu", gpu)):
        nodes = sorted(set(table.column("node").to_pylist()))
        table = table.sort_by("node")
        lengths = np.array([pc.sum(pc.equal(table.column("node"), n)).as_py() for n in nodes])
        now = int(pc.max(table.column("ts").cast(pa.int64())).as_py()) + NS
        kept, refused = validation.check_table(name, table, nodes, lengths, now,
                                               IngestLimits(max_table_rows=10**7, max_past_seconds=10 * 86400.0))
        assert not refused and kept.num_rows == table.num_rows, name
    book = NodeBook()
    Ingest(book, sink=lambda p: 0).act_on_events({"events": events}, T0 + int(FAIL_H * HOUR))
    assert set(book.fatal) == {TOPO.names[n] for n in DOMAIN}


def test_the_look_alike_is_a_few_sxids_that_stop():
    tables = _simulate([_episode(fails=False, peak=0.6)])
    end = T0 + int(FAIL_H * HOUR)
    sxids = _rows(tables["events"], "sxid")
    assert sxids and all(r["severity"] == "precursor" and r["ts"] < end for r in sxids)
    assert len({(r["ts"], r["link"]) for r in sxids}) <= 12
    assert not [r for r in _rows(tables["events"]) if r["severity"] == "fatal"]
    gpu = tables["gpu"]
    assert pc.all(pc.equal(gpu.column("fabric_health_mask"), fabric.HEALTHY_MASK)).as_py()
    nvl = tables["nvlink"]
    assert pc.all(pc.equal(nvl.column("links_up"), nvl.column("links_total"))).as_py()


def test_the_incident_names_the_domain_and_its_family(tmp_path):
    topo = Topology(nodes=36, gpus_per_node=4, hcas_per_node=4, nodes_per_leaf=18, job_nodes=18, nvlink_domain_nodes=18)
    run(SimSettings(topology=topo, days=1.0, interval_s=600.0, seed=4, faults=FaultSettings(rate_scale=300.0)),
        tmp_path, workers=1)
    incidents = read_table(tmp_path, "incidents").to_pylist()
    fabric_incidents = [r for r in incidents if r["category"] == NVLINK_FABRIC]
    assert fabric_incidents, "the rate scale should give a fabric failure in a day"
    events = read_table(tmp_path, "events")
    for inc in fabric_incidents:
        domain = int(topo.names.index(inc["affected_nodes"][0])) // 18
        assert inc["scope"] == "nvlink_domain" and inc["node"] == topo.nvlink_domain_name(domain)
        assert inc["affected_nodes"] == [topo.names[n] for n in range(18 * domain, 18 * domain + 18)]
        assert inc["has_precursor"] and inc["component"].startswith("nvswitch")
        assert inc["description"] == MODES["nvswitch"].description
        at = events.filter(pc.and_(pc.equal(events.column("kind"), "sxid"),
                                   pc.equal(events.column("severity"), "fatal"))).to_pylist()
        assert {r["node"] for r in at if r["ts"] == inc["ts"]} == set(inc["affected_nodes"])


def test_nothing_happens_without_nvlink_domains():
    flat = Topology(nodes=36, gpus_per_node=4, hcas_per_node=4, nodes_per_leaf=18, job_nodes=18)
    assert not [e for e in schedule(flat, T0, T0 + 400 * 24 * HOUR, 1, FaultSettings(rate_scale=50.0))
                if e.mode == "nvswitch" or e.category in FABRIC_CATEGORIES]
    with pytest.raises(ValueError, match="NVLink domain"):
        injected(flat, 3, "nvswitch", T0, HOUR, 0, HOUR, 1, 1)
    ep = injected(TOPO, 4, "nvswitch", T0, HOUR, 2, HOUR, 1, 1)
    assert ep.nodes == OTHER and ep.category == NVLINK_FABRIC and ep.scope_name == TOPO.nvlink_domain_name(1)
