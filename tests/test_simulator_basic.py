"""The simulator writes schema-v1 tables through the dataset writer, deterministically from the seed."""

from __future__ import annotations

import pyarrow.compute as pc

from foreshock import schema as sch
from foreshock.dataset import read_table
from foreshock.simulator.batch import SimSettings, run
from foreshock.simulator.faults import FaultSettings
from foreshock.simulator.topology import Topology

TABLES = ("gpu", "nvlink", "rdma_port", "netdev", "host_net", "events", "inventory", "incidents")


def _small(seed=7, **kw):
    return SimSettings(topology=Topology(nodes=8, nodes_per_leaf=4, job_nodes=4), days=0.25, interval_s=60.0,
                       seed=seed, faults=FaultSettings(rate_scale=kw.pop("rate_scale", 300.0)), **kw)


def test_same_seed_same_tables(tmp_path):
    run(_small(), tmp_path / "a")
    run(_small(), tmp_path / "b")
    run(_small(seed=8), tmp_path / "c")
    for table in TABLES:
        a, b = read_table(tmp_path / "a", table), read_table(tmp_path / "b", table)
        assert a.num_rows > 0 or table == "events", table
        assert a.equals(b), table
    assert not read_table(tmp_path / "a", "gpu").equals(read_table(tmp_path / "c", "gpu"))


def test_tables_are_schema_v1_with_real_widths(tmp_path):
    run(_small(), tmp_path)
    for table in TABLES:
        data = read_table(tmp_path, table)
        assert data.schema.equals(sch.schema(table), check_metadata=False), table
    rdma = read_table(tmp_path, "rdma_port")
    for name, width in sch.IB_PORT_COUNTERS.items():
        if width < 64:
            assert pc.max(rdma.column(name)).as_py() <= (1 << width) - 1, name
    # counters an mlx5 InfiniBand port does not have stay null; those it has are never null
    for absent in ("req_transport_retries_exceeded", "rp_cnp_handled", "np_cnp_sent", "rx_icrc_encapsulated"):
        assert rdma.column(absent).null_count == rdma.num_rows, absent
    for present in ("local_ack_timeout_err", "out_of_sequence", "symbol_error", "port_xmit_wait"):
        assert rdma.column(present).null_count == 0, present
    inv = read_table(tmp_path, "inventory")
    assert inv.num_rows == 8 and inv.column("leaf_switch").null_count == 0
    assert set(inv.column("leaf_switch").to_pylist()) == {"leaf-000", "leaf-001"}


def test_worker_processes_do_not_change_the_data(tmp_path):
    settings = _small(block_nodes=4)
    run(settings, tmp_path / "one", workers=1)
    run(settings, tmp_path / "two", workers=2)
    for table in TABLES:
        assert read_table(tmp_path / "one", table).equals(read_table(tmp_path / "two", table)), table
    # no temporary file is left behind and none was lost
    assert not list((tmp_path / "two").rglob(".*.tmp"))
