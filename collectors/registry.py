"""The node sources, registered by name (`--sources rdma,netdev,...`), as node_exporter registers its collectors.

Each entry builds a source from the collector's settings (`SourceConfig`): the injectable roots
(`sysfs`, `procfs`, `kmsg`), the node name and per-source options. Modules are imported only when their
source is built, so `foreshock collect --sources rdma` never loads NVML.
"""

from __future__ import annotations


from collections.abc import Callable
from dataclasses import dataclass, field

from .base import Source
from .repeats import DEFAULT_WINDOW_SECONDS


@dataclass
class SourceConfig:
    node: str
    sysfs: str = "/sys"
    procfs: str = "/proc"
    kmsg: str = "/dev/kmsg"
    peers: list[str] = field(default_factory=list)
    nvlink_links: bool = False
    sim_gpus: int = 8
    sim_hcas: int = 8
    seed: int = 0
    rescan_seconds: float = 60.0
    xid_fold_seconds: float = DEFAULT_WINDOW_SECONDS


def _rdma(c: SourceConfig) -> Source:
    from .rdma import RdmaSource
    return RdmaSource(c.node, sysfs=c.sysfs, rescan_seconds=c.rescan_seconds)


def _netdev(c: SourceConfig) -> Source:
    from .netdev import NetdevSource
    return NetdevSource(c.node, sysfs=c.sysfs, rescan_seconds=c.rescan_seconds)


def _host_net(c: SourceConfig) -> Source:
    from .host_net import HostNetSource
    return HostNetSource(c.node, procfs=c.procfs, peers=c.peers)


def _kmsg(c: SourceConfig) -> Source:
    from .kmsg import KmsgSource
    return KmsgSource(c.node, path=c.kmsg, xid_fold_seconds=c.xid_fold_seconds)


def _nvml(c: SourceConfig) -> Source:
    from .nvml import NvmlSource
    return NvmlSource(c.node, nvlink_links=c.nvlink_links, xid_fold_seconds=c.xid_fold_seconds)


def _systemd(c: SourceConfig) -> Source:
    from .systemd import SystemdSource
    return SystemdSource(c.node)


def _simulated(c: SourceConfig) -> Source:
    from .simulated import SimulatedSource
    return SimulatedSource(c.node, gpus=c.sim_gpus, hcas=c.sim_hcas, seed=c.seed)


SOURCES: dict[str, Callable[[SourceConfig], Source]] = {
    "nvml": _nvml,
    "rdma": _rdma,
    "netdev": _netdev,
    "host_net": _host_net,
    "kmsg": _kmsg,
    "systemd": _systemd,
    "simulated": _simulated,
}
# What `foreshock collect` reads when --sources is not given: every real interface of a GPU node.
DEFAULT_SOURCES = ("nvml", "rdma", "netdev", "host_net", "kmsg")


class UnknownSource(ValueError):
    pass


def build_sources(names, config: SourceConfig) -> list[Source]:
    """Sources by name, in the order given; an unknown name is an error that lists the known ones."""
    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise UnknownSource(f"unknown sources {unknown}; known: {', '.join(SOURCES)}")
    return [SOURCES[n](config) for n in names]


