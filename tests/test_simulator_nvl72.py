"""The simulator's NVL72 racks: 18 trays x 4 GPUs per NVLink domain, the inventory's nvlink_domain and
the gpu table's fabric columns written as a real node's NVML source would."""

from __future__ import annotations

from collections import Counter

import pyarrow.compute as pc
import pytest

from foreshock import fabric
from foreshock.dataset import read_table
from foreshock.simulator.batch import SimSettings, run
from foreshock.simulator.faults import FaultSettings
from foreshock.simulator.topology import Topology, TopologyError


def test_nvl72_racks_have_a_domain_per_18_trays_and_registered_gpus(tmp_path):
    topo = Topology(nodes=40, gpus_per_node=4, hcas_per_node=4, nvlink_domain_nodes=18, nodes_per_leaf=8,
                    job_nodes=18)
    run(SimSettings(topology=topo, days=0.05, interval_s=300.0, seed=3, faults=FaultSettings(rate_scale=1.0)),
        tmp_path)
    inv = read_table(tmp_path, "inventory").to_pylist()
    domains = Counter(r["nvlink_domain"] for r in inv if r["ts"] == inv[0]["ts"])
    assert sorted(domains.values()) == [4, 18, 18] and None not in domains  # 40 trays: two racks and a part
    by_node = {r["node"]: r["nvlink_domain"] for r in inv}
    gpu = read_table(tmp_path, "gpu")
    live = gpu.filter(pc.invert(gpu.column("gpu_lost")))
    for row in live.slice(0, 200).to_pylist() + live.slice(live.num_rows - 200).to_pylist():
        assert row["nvlink_domain"] == by_node[row["node"]]  # the node's GPUs say what the inventory says
        assert (row["fabric_state"], row["fabric_status"], row["fabric_health_mask"]) == (
            fabric.STATE_COMPLETED, 0, fabric.HEALTHY_MASK)
        assert row["nvlink_domain"] == fabric.nvlink_domain(row["fabric_cluster_uuid"], row["fabric_clique_id"])
        assert row["fabric_degraded_bw"] is False and row["fabric_health_summary"] == 1
    assert set(gpu.column("gpu").to_pylist()) == {0, 1, 2, 3}


def test_hgx_nodes_have_no_nvlink_domain_and_no_fabric_information(tmp_path):
    topo = Topology(nodes=4, nodes_per_leaf=4, job_nodes=4)
    run(SimSettings(topology=topo, days=0.02, interval_s=300.0, seed=3, faults=FaultSettings(rate_scale=1.0)),
        tmp_path)
    assert read_table(tmp_path, "inventory").column("nvlink_domain").null_count == 4
    gpu = read_table(tmp_path, "gpu")
    assert gpu.num_rows and all(gpu.column(c).null_count == gpu.num_rows for c in fabric.GPU_COLUMNS)


def test_a_multi_node_nvlink_domain_of_8_gpu_nodes_is_refused_naming_the_settings():
    with pytest.raises(TopologyError, match="gpus_per_node 8 with nvlink_domain_nodes 9"):
        Topology(nodes=18, gpus_per_node=8, nvlink_domain_nodes=9)
    assert Topology(nodes=18, gpus_per_node=4, hcas_per_node=4, nvlink_domain_nodes=18).gpu_generation == "GB200"
