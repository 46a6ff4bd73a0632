"""The failure catalogue and the incident process: which faults happen, where, when, with what precursor.

Rates come from Meta's Llama 3 pre-training run (The Llama 3 Herd of Models, 2024, section 3.3;
../shared/reference/failure-figures.md): 419 unexpected interruptions on 2,048 nodes in 54 days, by root
cause, about 3.8 per 1,000 node-days. Each root-cause category maps to one or more failure *modes*
(the physics in foreshock.simulator.model); a mode either has a precursor (a degradation that starts a
lead time before the failure) or has none. Lead times, repair times and the shares of each mode inside a
category are modelling assumptions, written down in docs/simulator.md; a random world
(foreshock.simulator.scenarios) widens leads, takes repair times from the real InfiniteHBD trace and gives
each precursor episode a shape and a signature.

The schedule is drawn up front from the seed, as a list of `Episode`s: failures (each one incident) and
degrade-then-recover episodes (hard negatives: the same precursor, no failure). Telemetry generation
reads the schedule and never draws from the schedule's random stream, so the schedule is the ground
truth of the telemetry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from foreshock.simulator.scenarios import SIGNATURES, World
from foreshock.simulator.topology import NVSWITCHES_PER_NVLINK_DOMAIN, Topology

NS = 1_000_000_000
HOUR = 3600 * NS
DAY = 24 * HOUR

# Llama 3 unexpected interruptions by root cause (counts), 2,048 nodes x 54 days.
LLAMA3_COUNTS: dict[str, int] = {
    "faulty_gpu": 148, "gpu_hbm": 72, "software_bug": 54, "network_switch_cable": 35,
    "host_maintenance": 32, "gpu_sram": 19, "gpu_system_processor": 17, "nic": 7, "nccl_watchdog": 7,
    "silent_data_corruption": 6, "gpu_thermal": 6, "ssd": 3, "power_supply": 3, "server_chassis": 2,
    "io_expansion_board": 2, "dependency": 2, "cpu": 2, "system_memory": 2,
}
LLAMA3_NODE_DAYS = 2048 * 54


@dataclass(frozen=True)
class Mode:
    """A failure mode: what it degrades (component kind), whether it warns, how it ends."""

    name: str
    component: str          # gpu | hca | node | switch | site | nvlink_domain
    precursor: bool
    lead_median_h: float = 0.0   # median precursor lead time (lognormal)
    lead_sigma: float = 0.8
    description: str = ""


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("hbm", "gpu", True, 8.0, 0.9, "HBM3 wear: corrected ECC accelerates, rows remapped (Xid 63), Xid 92, "
                                       "then a double-bit error (Xid 48), uncontained error (Xid 95) or a row-remap failure (Xid 64)"),
    Mode("hbm_abrupt", "gpu", False, description="HBM double-bit error with no warning (Xid 48)"),
    Mode("sram", "gpu", True, 1.0, 0.8, "on-chip SRAM: a short burst of corrected ECC, then an uncontained error (Xid 95)"),
    Mode("sram_abrupt", "gpu", False, description="SRAM uncorrectable error with no warning (Xid 95/48)"),
    Mode("nvlink", "gpu", True, 3.0, 0.8, "NVLink: CRC flit/data, replay and recovery errors climb, a link drops, then its "
                                         "generation's link-down Xid (74 on Hopper, 149 on a GB200 tray)"),
    Mode("gpu_off_bus_pcie", "gpu", True, 1.0, 0.8, "PCIe: replays climb, the link trains down in width, then the GPU falls off the bus (Xid 79)"),
    Mode("gpu_off_bus", "gpu", False, description="the GPU falls off the bus with no warning (Xid 79)"),
    Mode("straggler", "node", True, 6.0, 0.8, "slow-degrading node: throughput falls against its job peers, then a GPU is lost (Xid 79)"),
    Mode("gsp", "gpu", False, description="GPU System Processor timeout or error (Xid 119/120), abrupt"),
    Mode("thermal", "gpu", True, 2.0, 0.8, "thermal interface/sensor: temperature drifts up, thermal clock events, then the GPU is lost"),
    Mode("ib_cable", "hca", True, 4.0, 0.9, "cable/transceiver: symbol errors, link error recoveries, link integrity errors, "
                                            "retransmissions, flaps (link_downed), then the port goes down"),
    Mode("nic", "hca", True, 2.0, 0.8, "NIC: completion errors, ack timeouts and mlx5 driver errors, then the port goes down"),
    Mode("leaf_switch", "switch", True, 1.0, 0.8, "leaf switch: remote physical errors, discards, ack timeouts on every port under it, then all go down"),
    Mode("scale_across", "site", True, 1.0, 0.8, "site uplink: TCP retransmissions and probe RTT rise, then cross-site probes are lost"),
    Mode("software", "node", False, description="software bug: the job crashes (sometimes with an application Xid 13/43)"),
    Mode("nccl_hang", "node", False, description="NCCL watchdog timeout: traffic stops, GPUs spin"),
    Mode("host", "node", False, description="host-side fault or maintenance: the node drops out"),
    Mode("sdc", "node", False, description="silent data corruption: nothing in telemetry at all"),
    Mode("nvswitch", "nvlink_domain", True, 4.0, 0.9, "NVSwitch / NVLink fabric of a multi-node NVLink domain: "
         "non-fatal SXids densify, the GPUs report degraded bandwidth and access-timeout recovery, then a fatal "
         "SXid and every GPU of the domain loses its links to the switch (a Fatal NVLink5 Xid 149; each non-fatal SXid "
         "has a Nonfatal Xid 145 at the link's GPU end)"),
)}

# Root cause -> (mode, share) and median repair time in hours (assumed; docs/simulator.md).
CATEGORIES: dict[str, tuple[tuple[tuple[str, float], ...], float]] = {
    "faulty_gpu": ((("gpu_off_bus_pcie", 0.25), ("gpu_off_bus", 0.25), ("nvlink", 0.25), ("straggler", 0.25)), 24.0),
    "gpu_hbm": ((("hbm", 0.85), ("hbm_abrupt", 0.15)), 24.0),
    "software_bug": ((("software", 1.0),), 0.5),
    "network_switch_cable": ((("ib_cable", 0.7), ("leaf_switch", 0.2), ("scale_across", 0.1)), 4.0),
    "host_maintenance": ((("host", 1.0),), 4.0),
    "gpu_sram": ((("sram", 0.4), ("sram_abrupt", 0.6)), 24.0),
    "gpu_system_processor": ((("gsp", 1.0),), 2.0),
    "nic": ((("nic", 1.0),), 6.0),
    "nccl_watchdog": ((("nccl_hang", 1.0),), 0.5),
    "silent_data_corruption": ((("sdc", 1.0),), 24.0),
    "gpu_thermal": ((("thermal", 1.0),), 12.0),
    "ssd": ((("host", 1.0),), 6.0),
    "power_supply": ((("host", 1.0),), 6.0),
    "server_chassis": ((("host", 1.0),), 12.0),
    "io_expansion_board": ((("host", 1.0),), 12.0),
    "dependency": ((("software", 1.0),), 1.0),
    "cpu": ((("host", 1.0),), 24.0),
    "system_memory": ((("host", 1.0),), 12.0),
}

# The fabric of a multi-node NVLink domain (an NVL72 rack's NVLink switch trays): Llama 3's HGX H100 nodes
# kept NVLink on their own baseboards, so its counts have no such cause and the category is drawn apart,
# only where the topology has such domains (schedule()). Rate, an assumption: a switch tray fails as often
# per node it serves as a leaf switch does per node under it (Llama 3's network switch/cable count times the
# leaf_switch share above). Repair: a switch tray swapped, 12 h (assumption, as a server chassis).
NVLINK_FABRIC = "nvlink_fabric"
FABRIC_CATEGORIES: dict[str, tuple[tuple[tuple[str, float], ...], float]] = {
    NVLINK_FABRIC: ((("nvswitch", 1.0),), 12.0),
}
FABRIC_COUNTS: dict[str, float] = {
    NVLINK_FABRIC: LLAMA3_COUNTS["network_switch_cable"] * dict(CATEGORIES["network_switch_cable"][0])["leaf_switch"],
}


# The modes that fail every node under a scope (a leaf switch, a site uplink) at once.
WIDE_MODES = frozenset(m.name for m in MODES.values() if m.component in ("switch", "site"))
PRECURSOR_MODES = frozenset(m.name for m in MODES.values() if m.precursor)


def category_rates(rate_scale: float = 1.0) -> dict[str, float]:
    """Failures per node-day by category."""
    return {c: n / LLAMA3_NODE_DAYS * rate_scale for c, n in LLAMA3_COUNTS.items()}


def fabric_rates(rate_scale: float = 1.0) -> dict[str, float]:
    """Failures per node-day of a node in a multi-node NVLink domain, by fabric category."""
    return {c: n / LLAMA3_NODE_DAYS * rate_scale for c, n in FABRIC_COUNTS.items()}


@dataclass
class Episode:
    """One degradation on one component: a failure (an incident) or a degrade-then-recover hard negative.

    Times are ns since the epoch. `start_ns` is the precursor's start (== fail_ns for a mode with no
    precursor); `end_ns` is the failure, or the end of the recovery. `nodes` are the affected node indices.
    """

    episode_id: str
    mode: str
    category: str | None      # None for a recovery
    nodes: tuple[int, ...]
    component: int            # GPU or HCA index; the domain's NVSwitch for nvlink_domain modes; else 0
    start_ns: int
    end_ns: int
    fails: bool
    repair_ns: int = 0        # back in service (failures only)
    peak: float = 1.0         # precursor intensity at its end, 1.0 = a failing device's
    scope_name: str = ""      # leaf or site name for wide faults
    variant: int = 0          # which fatal signature (e.g. Xid 48 vs 95 vs 64)
    seed: int = 0             # the episode's own random stream (per-episode effects)
    injected: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def fail_ns(self) -> int | None:
        return self.end_ns if self.fails else None

    @property
    def has_precursor(self) -> bool:
        return MODES[self.mode].precursor


@dataclass(frozen=True)
class FaultSettings:
    rate_scale: float = 1.0
    difficulty: float = 1.0       # >1: weaker, shorter precursors, more benign noise and recoveries
    recovery_ratio: float = 1.0   # degrade-then-recover episodes per precursor failure (at difficulty 1)
    lead_scale: float = 1.0       # multiplies every precursor lead time
    time_compression: float = 1.0  # live mode: rates x c, durations / c


def _lognormal_ns(rng: np.random.Generator, median_h: float, sigma: float, compression: float,
                  floor_s: float = 600.0, cap_s: float = float("inf")) -> int:
    return int(min(cap_s, max(floor_s, median_h * 3600.0 * float(np.exp(sigma * rng.standard_normal()))))
               / compression * NS)


# Where the knobs of a world widen the clean world's processes (scenarios.py: lead_sigma, repair_median_h).
WIDE_LEAD_FLOOR_S, WIDE_LEAD_CAP_S = 180.0, 36 * 3600.0
REPAIR_CAP_S = 60 * 86400.0


def _lead_ns(rng, mode: Mode, settings: "FaultSettings", d: float, world: World, pod: int) -> int:
    sigma = float(world.pod("lead_sigma", pod))
    if sigma > 0:
        return _lognormal_ns(rng, mode.lead_median_h * settings.lead_scale / d, sigma, settings.time_compression,
                             WIDE_LEAD_FLOOR_S, WIDE_LEAD_CAP_S)
    return _lognormal_ns(rng, mode.lead_median_h * settings.lead_scale / d, mode.lead_sigma, settings.time_compression)


def _repair_ns(rng, repair_h: float, settings: "FaultSettings", world: World, pod: int) -> int:
    median = float(world.pod("repair_median_h", pod))
    sigma = float(world.pod("repair_sigma", pod))
    if median > 0:
        return _lognormal_ns(rng, median, sigma, settings.time_compression, cap_s=REPAIR_CAP_S)
    return _lognormal_ns(rng, repair_h, sigma, settings.time_compression)


def component_count(topo: Topology, world: World, kind: str, pod: int) -> int:
    """GPUs or HCAs of a node in the pod: the topology's, or fewer where the world gives the pod another
    node type (the knob's 0 means the topology's)."""
    top = topo.gpus_per_node if kind == "gpu" else topo.hcas_per_node
    v = int(world.pod("gpus_per_node" if kind == "gpu" else "hcas_per_node", pod))
    return top if v <= 0 else min(v, top)


def _annotate(ep: "Episode", world: World, pod: int, lookalike: bool = False) -> None:
    """A random world's episode: its shape, signature and faintness, from the episode's own stream."""
    if not world.random or ep.mode not in PRECURSOR_MODES:
        return
    draws = world.episode_draws(ep.mode, ep.seed, pod, (ep.end_ns - ep.start_ns) / NS, lookalike)
    ep.extra.update(draws)
    if draws["faint"] and ep.fails:
        ep.peak = draws["faint_factor"]


def schedule(topo: Topology, start_ns: int, end_ns: int, seed: int, settings: FaultSettings = FaultSettings(),
             world: World | None = None) -> list[Episode]:
    """Draw every failure and recovery episode of [start_ns, end_ns) for the cluster, from the seed alone.

    Failures form a Poisson process per category at rate x nodes; a failure that would land on a node
    that is already failed-and-in-repair is dropped (a node in repair cannot fail), which lowers the
    realised rate by the share of node-time in repair (well under 1% at the default rates). A wide fault
    (WIDE_MODES) is dropped only while its own leaf or site is in repair, and fails the nodes under it that
    are up (_drop_overlaps).
    A random `world` (scenarios.py) widens leads and repairs per pod and gives each precursor episode a
    shape and a signature from the episode's own stream; the schedule's stream draws the same numbers.
    """
    world = world if world is not None else World("clean", seed=seed, n_pods=topo.n_leaves)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    comp = settings.time_compression
    days = (end_ns - start_ns) / DAY * comp
    d = max(settings.difficulty, 1e-6)
    episodes: list[Episode] = []
    leaf_of, site_of = topo.leaf_of, topo.site_of
    for category, rate in category_rates(settings.rate_scale).items():
        modes, repair_h = CATEGORIES[category]
        names = [m for m, _ in modes]
        shares = np.array([s for _, s in modes], dtype=float)
        if topo.sites < 2 and "scale_across" in names:
            i = names.index("scale_across")
            shares[names.index("ib_cable")] += shares[i]
            shares[i] = 0.0
        shares /= shares.sum()
        count = rng.poisson(rate * topo.nodes * days)
        for k in range(count):
            mode = MODES[names[rng.choice(len(names), p=shares)]]
            fail = start_ns + int(rng.uniform(0, end_ns - start_ns))
            node = int(rng.integers(topo.nodes))
            pod = int(leaf_of[node])
            lead = _lead_ns(rng, mode, settings, d, world, pod) if mode.precursor else 0
            repair = _repair_ns(rng, repair_h, settings, world, pod)
            variant = int(rng.integers(1 << 30))
            ep_seed = int(rng.integers(1 << 62))
            comp_idx = int(rng.integers(topo.gpus_per_node if mode.component == "gpu" else topo.hcas_per_node))
            if mode.component in ("gpu", "hca"):
                comp_idx %= component_count(topo, world, mode.component, pod)
            if mode.component == "switch":
                leaf = int(leaf_of[node])
                nodes, scope = tuple(int(n) for n in topo.nodes_under_leaf(leaf)), topo.leaf_name(leaf)
            elif mode.component == "site":
                site = int(site_of[node])
                nodes, scope = tuple(int(n) for n in topo.nodes_in_site(site)), topo.site_name(site)
            else:
                nodes, scope = (node,), ""
            ep = Episode(f"{category}-{k:05d}-s{seed}", mode.name, category, nodes,
                         comp_idx if mode.component in ("gpu", "hca") else 0,
                         max(start_ns - 30 * DAY, fail - lead), fail, True, fail + repair,
                         1.0, scope, variant, ep_seed)
            _annotate(ep, world, pod)
            episodes.append(ep)
    episodes = _drop_overlaps(sorted(episodes, key=lambda e: (e.end_ns, e.episode_id)))

    # Degrade-then-recover: the same precursor processes at a random peak, fading out, no failure.
    precursor_failures = [e for e in episodes if e.has_precursor]
    ratio = settings.recovery_ratio * float(world.scalar("lookalike_scale"))
    n_recover = rng.poisson(len(precursor_failures) * ratio * d) if precursor_failures else 0
    # In a random world every precursor family has look-alikes, whatever failed; in the clean world they
    # follow the failures' mix.
    lookalike_modes = [m for m in SIGNATURES if MODES[m].component in ("gpu", "hca", "node")]
    for k in range(n_recover):
        if world.random:
            mode = MODES[lookalike_modes[int(rng.integers(len(lookalike_modes)))]]
        else:
            like = precursor_failures[int(rng.integers(len(precursor_failures)))]
            mode = MODES[like.mode]
            if mode.component in ("switch", "site"):
                mode = MODES["ib_cable"]  # a wide fault that heals is rare; use a port that heals instead
        node = int(rng.integers(topo.nodes))
        pod = int(leaf_of[node])
        dur = _lead_ns(rng, mode, settings, d, world, pod)
        begin = start_ns + int(rng.uniform(-dur, end_ns - start_ns))
        comp_idx = int(rng.integers(topo.gpus_per_node if mode.component == "gpu" else topo.hcas_per_node))
        if mode.component in ("gpu", "hca"):
            comp_idx %= component_count(topo, world, mode.component, pod)
        ep = Episode(f"recovery-{k:05d}-s{seed}", mode.name, None, (node,),
                     comp_idx if mode.component in ("gpu", "hca") else 0,
                     begin, begin + dur, False, 0, float(rng.uniform(0.3, 0.9)), "",
                     int(rng.integers(1 << 30)), int(rng.integers(1 << 62)))
        _annotate(ep, world, pod, lookalike=True)
        episodes.append(ep)
    if topo.nvlink_domain_nodes > 0:
        episodes += _fabric_episodes(topo, start_ns, end_ns, seed, settings, world)
    return sorted(episodes, key=lambda e: (e.start_ns, e.episode_id))


def _fabric_episodes(topo: Topology, start_ns: int, end_ns: int, seed: int, settings: FaultSettings,
                     world: World) -> list[Episode]:
    """The NVLink-fabric failures of every multi-node NVLink domain and their look-alikes (a few non-fatal
    SXids that stop), from a stream of their own, so that every other episode keeps its draws.

    Failures are a Poisson process per domain at the fabric rate x its nodes. One is dropped while the
    domain's fabric is still in repair; a compute tray in repair does not keep the switch trays from
    failing, and the domain's nodes are not drained (their GPUs work on, without the fabric's links), so
    the other failures ignore the fabric's.
    Look-alikes come at recovery_ratio x lookalike_scale x difficulty per expected failure: a domain whose
    fabric never failed in the run still shows them.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED, 0xFAB]))
    days = (end_ns - start_ns) / DAY * settings.time_compression
    d = max(settings.difficulty, 1e-6)
    ratio = settings.recovery_ratio * float(world.scalar("lookalike_scale")) * d
    domain_of = topo.nvlink_domain_of
    out: list[Episode] = []
    for category, rate in fabric_rates(settings.rate_scale).items():
        modes, repair_h = FABRIC_CATEGORIES[category]
        ((mode_name, _),) = modes  # one mode per fabric category
        mode = MODES[mode_name]
        for dom in range(int(domain_of.max()) + 1):
            members = tuple(int(n) for n in np.flatnonzero(domain_of == dom))
            pod, name = int(topo.leaf_of[members[0]]), topo.nvlink_domain_name(dom)
            expected = rate * len(members) * days
            fabric_free = start_ns - 30 * DAY
            drawn = []
            for k in range(rng.poisson(expected)):
                fail = start_ns + int(rng.uniform(0, end_ns - start_ns))
                lead = _lead_ns(rng, mode, settings, d, world, pod)
                repair = _repair_ns(rng, repair_h, settings, world, pod)
                drawn.append((fail, k, lead, repair, int(rng.integers(NVSWITCHES_PER_NVLINK_DOMAIN)),
                              int(rng.integers(1 << 30)), int(rng.integers(1 << 62))))
            for fail, k, lead, repair, switch, variant, ep_seed in sorted(drawn):
                if fail < fabric_free:
                    continue
                fabric_free = fail + repair
                ep = Episode(f"{category}-{dom:03d}-{k:03d}-s{seed}", mode.name, category, members, switch,
                             max(start_ns - 30 * DAY, fail - lead), fail, True, fail + repair, 1.0, name,
                             variant, ep_seed)
                _annotate(ep, world, pod)
                out.append(ep)
            for k in range(rng.poisson(expected * ratio)):
                dur = _lead_ns(rng, mode, settings, d, world, pod)
                begin = start_ns + int(rng.uniform(-dur, end_ns - start_ns))
                ep = Episode(f"recovery-{category}-{dom:03d}-{k:03d}-s{seed}", mode.name, None, members,
                             int(rng.integers(NVSWITCHES_PER_NVLINK_DOMAIN)), begin, begin + dur, False, 0,
                             float(rng.uniform(0.3, 0.9)), name, int(rng.integers(1 << 30)), int(rng.integers(1 << 62)))
                _annotate(ep, world, pod, lookalike=True)
                out.append(ep)
    return out


def _drop_overlaps(failures: list[Episode]) -> list[Episode]:
    """The failures that can happen, in end order: a node fails once until it is repaired; a wide fault (a
    leaf switch, a site uplink) fails once per scope until repaired and takes down the nodes under it that
    are still up. Dropping a wide fault because one of its nodes was in repair would leave a world at a
    high --rate-scale almost without switch failures (a leaf's 16 nodes are seldom all up at once), so a
    model trained there would never see one."""
    busy_until: dict[int, int] = {}
    scope_busy_until: dict[str, int] = {}
    kept = []
    for ep in failures:
        if ep.mode in WIDE_MODES:
            if scope_busy_until.get(ep.scope_name, -1) > ep.end_ns:
                continue
            up = tuple(n for n in ep.nodes if busy_until.get(n, -1) <= ep.end_ns)
            if not up:
                continue
            ep.nodes = up
            scope_busy_until[ep.scope_name] = ep.repair_ns
        else:
            if busy_until.get(ep.nodes[0], -1) > ep.end_ns:
                continue
            busy_until[ep.nodes[0]] = ep.repair_ns
        kept.append(ep)
    return kept


def injected(topo: Topology, node: int, mode: str, now_ns: int, lead_ns: int, component: int | None,
             repair_ns: int, seed: int, serial: int) -> Episode:
    """An episode injected on command (live mode): its precursor starts now, it fails lead_ns later."""
    m = MODES[mode]
    category = next((c for c, (modes, _) in {**CATEGORIES, **FABRIC_CATEGORIES}.items()
                     if any(x == mode for x, _ in modes)), None)
    if m.component == "nvlink_domain":
        domain = int(topo.nvlink_domain_of[node])
        if domain < 0:
            raise ValueError(f"{mode} needs a node in a multi-node NVLink domain; {topo.names[node]} has none")
        nodes = tuple(int(n) for n in np.flatnonzero(topo.nvlink_domain_of == domain))
        scope = topo.nvlink_domain_name(domain)
    elif m.component == "switch":
        leaf = int(topo.leaf_of[node])
        nodes, scope = tuple(int(n) for n in topo.nodes_under_leaf(leaf)), topo.leaf_name(leaf)
    elif m.component == "site":
        site = int(topo.site_of[node])
        nodes, scope = tuple(int(n) for n in topo.nodes_in_site(site)), topo.site_name(site)
    else:
        nodes, scope = (node,), ""
    start = now_ns if m.precursor else now_ns + lead_ns
    return Episode(f"injected-{serial:04d}", mode, category, nodes, component or 0, start, now_ns + lead_ns,
                   True, now_ns + lead_ns + repair_ns, 1.0, scope, serial, seed ^ (serial * 0x9E3779B97F4A7C15 % (1 << 62)),
                   injected=True)


__all__ = ["Episode", "FaultSettings", "component_count", "MODES", "CATEGORIES", "LLAMA3_COUNTS", "category_rates", "schedule",
           "injected", "FABRIC_CATEGORIES", "FABRIC_COUNTS", "NVLINK_FABRIC", "fabric_rates"]
