"""The simulated cluster's layout: nodes, GPUs, HCAs, leaf and spine switches, NVLink domains, sites, jobs.

Everything here is a pure function of the settings: the same settings give the same names and the same
placement. The `inventory` table (schema v1, foreshock/schema.py) is written from it, so the predictor
sees the same topology labels an operator's configuration would give it (who shares a leaf switch, a
site, an NVLink domain, a job).

Simplifications (docs/simulator.md): every HCA of a node attaches to the node's one leaf switch (a
rail-optimised fabric would spread them over rails); jobs take contiguous runs of nodes, so a job spans
as few leaves as possible, as schedulers try to; a share of nodes is kept as idle spares.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from foreshock import fabric
from foreshock import schema as sch
from foreshock import xid as xidcat

# PCI bus ids of the eight GPUs and eight ConnectX HCAs of an HGX H100 board (DGX H100 layout).
GPU_BUS_IDS = ("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
               "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0")
HCA_BUS_IDS = ("0000:1a:00.0", "0000:2c:00.0", "0000:3c:00.0", "0000:5e:00.0",
               "0000:9c:00.0", "0000:ad:00.0", "0000:bc:00.0", "0000:dc:00.0")
# NVSwitch chips of a multi-node NVLink domain: a GB200 NVL72 rack has 9 NVLink switch trays (NVIDIA Mission
# Control manual, "NVLink Switch Integration"), a rack switch holds 2 NVSwitch devices (NVIDIA's NVLink4
# glossary, "Rack switch node"), and a GB200 GPU has 18 NVLinks (NVIDIA Health Validation, nvlink checks),
# one to each chip. A chip's link numbers run over the domain's GPUs.
NVSWITCHES_PER_NVLINK_DOMAIN = 18
NVSWITCHES_PER_TRAY = 2
# A GB200/GB300 compute tray carries 4 GPUs (two Grace-Blackwell superchips); an NVL72 rack is 18 of them.
GPUS_PER_NVLINK_TRAY = 4


class TopologyError(ValueError):
    """Topology settings that do not describe a cluster; the message names the setting."""


@dataclass(frozen=True)
class Topology:
    nodes: int = 64
    gpus_per_node: int = 8
    hcas_per_node: int = 8
    nodes_per_leaf: int = 16
    leaves_per_spine: int = 8
    sites: int = 1
    nvlink_domain_nodes: int = 0  # 0: NVLink stays inside the node (HGX); 18 with 4 GPUs: NVL72 racks
    job_nodes: int = 32
    spare_fraction: float = 0.05
    link_layer: str = "InfiniBand"
    names: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node", "hcas_per_node", "nodes_per_leaf", "leaves_per_spine",
                     "sites", "job_nodes"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise TopologyError(f"topology {name} must be a positive integer, got {value!r}")
        if self.gpus_per_node > len(GPU_BUS_IDS) * 4 or self.hcas_per_node > 32:
            raise TopologyError("topology: at most 32 GPUs and 32 HCAs per node")
        if self.nvlink_domain_nodes < 0:
            raise TopologyError(f"topology nvlink_domain_nodes must be >= 0, got {self.nvlink_domain_nodes}")
        if self.nvlink_domain_nodes and self.gpus_per_node > GPUS_PER_NVLINK_TRAY:
            raise TopologyError(f"topology gpus_per_node {self.gpus_per_node} with nvlink_domain_nodes "
                                f"{self.nvlink_domain_nodes}: the nodes of a multi-node NVLink domain are GB200/GB300 "
                                f"compute trays of at most {GPUS_PER_NVLINK_TRAY} GPUs (an NVL72 rack: "
                                f"--nvlink-domain-nodes 18 --gpus-per-node 4)")
        if not 0.0 <= self.spare_fraction < 1.0:
            raise TopologyError(f"topology spare_fraction must be in [0, 1), got {self.spare_fraction}")
        if self.link_layer not in ("InfiniBand", "Ethernet"):
            raise TopologyError(f"topology link_layer must be InfiniBand or Ethernet (RoCE), got {self.link_layer!r}")
        width = max(3, len(str(self.nodes - 1)))
        object.__setattr__(self, "names", tuple(f"node-{i:0{width}d}" for i in range(self.nodes)))

    # -- placement -------------------------------------------------------------------------------
    @property
    def leaf_of(self) -> np.ndarray:
        return np.arange(self.nodes) // self.nodes_per_leaf

    @property
    def n_leaves(self) -> int:
        return int(self.leaf_of.max()) + 1

    @property
    def site_of(self) -> np.ndarray:
        """Sites take equal contiguous shares of the leaves."""
        per_site = -(-self.n_leaves // self.sites)
        return np.minimum(self.leaf_of // per_site, self.sites - 1)

    @property
    def spine_of(self) -> np.ndarray:
        return self.leaf_of // self.leaves_per_spine

    @property
    def job_of(self) -> np.ndarray:
        """Job index per node, -1 for idle spares (the last nodes of each site's share)."""
        jobs = np.full(self.nodes, -1, dtype=np.int64)
        next_job = 0
        for site in range(self.sites):
            members = np.flatnonzero(self.site_of == site)
            usable = len(members) - int(round(len(members) * self.spare_fraction))
            for start in range(0, usable, self.job_nodes):
                jobs[members[start:min(start + self.job_nodes, usable)]] = next_job
                next_job += 1
        return jobs

    @property
    def n_jobs(self) -> int:
        return int(self.job_of.max()) + 1

    @property
    def gpu_generation(self) -> str:
        """The GPUs the nodes carry, by the Xid catalogue's generation names: GB200 where NVLink spans
        several nodes (an NVL72 rack's compute trays), H100 (an HGX board) where it stays inside the node."""
        return xidcat.GB200 if self.nvlink_domain_nodes else xidcat.H100

    @property
    def nvlink_domain_of(self) -> np.ndarray:
        """NVLink domain index per node (consecutive nodes share a rack), -1 where NVLink stays inside the node."""
        if not self.nvlink_domain_nodes:
            return np.full(self.nodes, -1, dtype=np.int64)
        return np.arange(self.nodes) // self.nvlink_domain_nodes

    def fabric_cluster(self, domain: int) -> tuple[str, int]:
        """The fabric cluster UUID and clique id the GPUs of a simulated NVLink domain register with."""
        raw = (0x5F0AB1C0 + domain).to_bytes(4, "big") + bytes(6) + domain.to_bytes(6, "big")
        return fabric.cluster_uuid(raw), 32766

    def nvlink_domain_name(self, domain: int) -> str | None:
        """The inventory's nvlink_domain for a domain index: the same rule as on a real node."""
        return None if domain < 0 else fabric.nvlink_domain(*self.fabric_cluster(domain))

    def nvswitch_device(self, switch: int) -> str:
        """An NVSwitch chip of an NVLink domain as its driver names it in an SXid line (nvidia-nvswitchN)."""
        return f"nvswitch{switch}"

    def nvswitch_bus_id(self, switch: int) -> str:
        """A PCI bus id per NVSwitch chip of a domain (made up: no layout of a switch tray is published here)."""
        return f"0000:{0x05 + 4 * switch:02x}:00.0"

    def leaf_name(self, leaf: int) -> str:
        return f"leaf-{leaf:03d}"

    def site_name(self, site: int) -> str:
        return f"site-{chr(ord('a') + site)}" if self.sites <= 26 else f"site-{site:03d}"

    def nodes_under_leaf(self, leaf: int) -> np.ndarray:
        return np.flatnonzero(self.leaf_of == leaf)

    def nodes_in_site(self, site: int) -> np.ndarray:
        return np.flatnonzero(self.site_of == site)

    def index(self, node: str) -> int:
        try:
            return self.names.index(node)
        except ValueError:
            raise TopologyError(f"no node {node!r} in this cluster ({self.names[0]} .. {self.names[-1]})") from None

    def gpu_bus_id(self, gpu: int) -> str:
        if gpu < len(GPU_BUS_IDS):
            return GPU_BUS_IDS[gpu]
        return f"0000:{0xe0 + gpu:02x}:00.0"

    def hca_device(self, hca: int) -> str:
        return f"mlx5_{hca}"

    def inventory(self, ts_ns: int) -> pa.Table:
        """The inventory table: one row per node with its topology labels."""
        leaf, spine, site, job = self.leaf_of, self.spine_of, self.site_of, self.job_of
        domains = [self.nvlink_domain_name(int(d)) for d in self.nvlink_domain_of]
        n = self.nodes
        columns = {
            "ts": pa.array(np.full(n, ts_ns, dtype=np.int64)).cast(sch.TS),
            "node": pa.array(self.names, type=sch.STR),
            "site": pa.array([self.site_name(int(s)) for s in site], type=sch.STR),
            "spine": pa.array([f"spine-{int(s):03d}" for s in spine], type=sch.STR),
            "leaf_switch": pa.array([self.leaf_name(int(x)) for x in leaf], type=sch.STR),
            "nvlink_domain": pa.array(domains, type=sch.STR),
            "job": pa.array([f"job-{int(j):03d}" if j >= 0 else None for j in job], type=sch.STR),
            "gpus": pa.array(np.full(n, self.gpus_per_node, dtype=np.int16)),
            "hcas": pa.array(np.full(n, self.hcas_per_node, dtype=np.int16)),
        }
        return pa.Table.from_pydict(columns, schema=sch.schema("inventory"))
