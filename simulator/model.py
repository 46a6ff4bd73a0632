"""The physics of the simulated cluster: one model that turns (nodes, sample times) into schema-v1 tables.

Both the batch simulator (foreshock.simulator.batch) and the live cluster (foreshock.simulator.live) call
`ClusterModel.generate`, so there is one implementation of every signal. A call covers a block of nodes
over an array of sample times and is vectorised with numpy over (nodes x components x time); the model
keeps, per node, the true cumulative value of every counter since its last reset (a reboot resets the
volatile ones, a GPU replacement its lifetime ones) and renders them the way the hardware would:
narrow InfiniBand error counters saturate at 2^w-1, 32-bit mlx5 hw_counters and port_xmit_wait wrap at
2^32, values the device does not report are null (signals.md; schema widths in foreshock/schema.py).

What a healthy node shows: job-level activity with checkpoint dips and bursty congestion shared by all
nodes of a job (port_xmit_wait, CNPs on RoCE, a few out-of-sequence packets), benign errors at per-device
chronic rates (a lognormal spread, so a few healthy devices are noisy all their life), application Xids
13/31/43. What a failing one shows: the precursor of its mode (foreshock.simulator.faults), then the
fatal signature, then it is drained for repair (no rows) and comes back rebooted.

The world (foreshock.simulator.scenarios) sets the knobs the physics reads: node types, chronic rates,
load, room temperature, jobs that move, collection noise; the clean world is the model as described in
docs/simulator.md, a random world draws the knobs per pod.

Random streams: the benign telemetry of a block is drawn from a stream keyed by (seed, block, time) whose
draws never depend on the fault schedule, and each episode's effects come from the episode's own stream,
so adding or removing an episode changes nothing but that episode's own signals.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from foreshock import fabric
from foreshock import schema as sch
from foreshock import xid as xidcat
from foreshock.collectors.sxid import parse_sxid
from foreshock.simulator.faults import DAY, MODES, NS, Episode, component_count
from foreshock.simulator.scenarios import World, shape_intensity, shape_mean
from foreshock.simulator.topology import NVSWITCHES_PER_TRAY, Topology

NVLINKS_PER_GPU = 18
PCIE_GEN, PCIE_WIDTH = 5, 16
MEM_CLOCK_MHZ, SM_CLOCK_MHZ, SM_IDLE_MHZ = 2619, 1980, 345
IDLE_W, TDP_W = 72.0, 700.0
RATE_GBPS = 400.0
HCA_BYTES_PER_S = 20e9       # average all-reduce load per 400G HCA while a job computes
NVLINK_KIB_PER_S = 1.2e8     # per GPU per direction (about 120 GB/s of a 450 GB/s H100 direction)
ETH_BYTES_PER_S = 40e6       # front-end traffic (data loading, logging); checkpoints burst above it
MTU = 4096
XMIT_WAIT_TICKS_PER_S = 2.0e5  # ticks per second of full congestion: port_xmit_wait wraps in days
DRAIN_NS = 10 * 60 * NS        # a failed node reports for 10 min, then is drained for repair
RESTART_NS = 20 * 60 * NS      # a failure stalls its whole job: NCCL timeout, then restart from a checkpoint
                               # on a spare (15-30+ min per incident, failure-figures.md)
CKPT_PERIOD_S, CKPT_S = 90 * 60, 180
STEP_PERIODS_MS = (5000, 6000, 10000, 12000, 15000)  # training step times; each divides a minute
# Step times (the step_times table, docs/simulator.md "Step times"): a job steps at its period when its
# load (activity) is STEP_LOAD_REF, the clean world's mean; the first STEP_COMPUTE_SHARE of a step is the
# ranks' own compute, the rest the all-reduce (the step rhythm's burst); the step varies by
# STEP_JOB_JITTER across the job and each rank's compute by STEP_RANK_JITTER (relative, +-).
STEP_LOAD_REF = 0.93
STEP_COMPUTE_SHARE = 0.5
STEP_JOB_JITTER, STEP_RANK_JITTER = 0.02, 0.01
STEP_MIN_LOAD = 0.05     # below it (idle, a gap between jobs, a stalled job) the job takes no steps

# mlx5 hw_counters a ConnectX really exposes (the q-counter and retransmission sets, as in the mlx5
# fixture tree of ../shared/fixtures/procfs); the congestion counters exist on RoCE ports only.
MLX5_PRESENT = (
    "rx_write_requests", "rx_read_requests", "rx_atomic_requests", "rx_dct_connect", "out_of_buffer",
    "out_of_sequence", "duplicate_request", "rnr_nak_retry_err", "packet_seq_err", "implied_nak_seq_err",
    "local_ack_timeout_err", "resp_local_length_error", "resp_cqe_error", "req_cqe_error",
    "req_remote_invalid_request", "req_remote_access_errors", "resp_remote_access_errors",
    "resp_cqe_flush_error", "req_cqe_flush_error", "roce_adp_retrans", "roce_adp_retrans_to",
    "roce_slow_restart", "roce_slow_restart_cnps", "roce_slow_restart_trans", "lifespan",
)
MLX5_ROCE_ONLY = ("rp_cnp_ignored", "rp_cnp_handled", "np_ecn_marked_roce_packets", "np_cnp_sent")

GPU_COUNTERS = ("ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate",
                "ecc_uncorrected_aggregate", "remapped_rows_correctable", "remapped_rows_uncorrectable",
                "pcie_replay_counter", "replay_errors", "recovery_errors", "crc_flit_errors",
                "crc_data_errors", "tx_kib", "rx_kib")
GPU_LIFETIME = ("ecc_corrected_aggregate", "ecc_uncorrected_aggregate", "remapped_rows_correctable",
                "remapped_rows_uncorrectable")
HCA_COUNTERS = tuple(sch.IB_PORT_COUNTERS) + MLX5_PRESENT + MLX5_ROCE_ONLY
NETDEV_COUNTERS = ("carrier_changes", "carrier_up_count", "carrier_down_count") + sch.NETDEV_STATISTICS
HOST_COUNTERS = tuple(f"Tcp_{n}" for n in sch.TCP_SNMP_FIELDS if n != "CurrEstab") + tuple(
    f"TcpExt_{n}" for n in sch.TCPEXT_FIELDS)
NODE_COUNTERS = NETDEV_COUNTERS + HOST_COUNTERS

# Benign error processes of healthy devices: counter -> (median events per device-day, lognormal sigma
# of the device-to-device spread). The spread makes a few healthy devices chronically noisy.
BENIGN_GPU = {
    "ecc_corrected_volatile": (0.3, 2.2),
    "pcie_replay_counter": (0.2, 2.0),
    "crc_flit_errors": (0.5, 2.0),
    "replay_errors": (0.2, 2.0),
    "remapped_rows_correctable": (0.002, 1.0),
}
BENIGN_HCA = {
    "symbol_error": (1.0, 2.5),
    "port_rcv_errors": (0.2, 2.0),
    "link_error_recovery": (0.01, 1.0),
    "port_xmit_discards": (0.5, 1.5),
    "VL15_dropped": (0.05, 1.0),
    "local_ack_timeout_err": (0.2, 1.5),
    "req_cqe_flush_error": (0.5, 1.5),
    "resp_cqe_flush_error": (0.5, 1.5),
    "rnr_nak_retry_err": (0.2, 1.5),
}
BENIGN_NODE = {
    "rx_errors": (0.1, 1.5), "rx_dropped": (20.0, 1.0), "tx_dropped": (0.1, 1.0), "rx_crc_errors": (0.05, 1.5),
    "Tcp_InErrs": (1.0, 1.0), "Tcp_EstabResets": (20.0, 0.8), "Tcp_AttemptFails": (5.0, 0.8),
    "TcpExt_TCPTimeouts": (50.0, 1.0), "TcpExt_TCPLostRetransmit": (5.0, 1.0),
    "TcpExt_TCPSpuriousRTOs": (2.0, 1.0), "TcpExt_TCPSynRetrans": (5.0, 1.0),
    "TcpExt_TCPRcvQDrop": (0.2, 1.0), "TcpExt_TCPBacklogDrop": (0.2, 1.0), "TcpExt_ListenDrops": (0.1, 1.0),
    "TcpExt_ListenOverflows": (0.1, 1.0), "TcpExt_TCPRetransFail": (0.1, 1.0),
    "TcpExt_TCPAbortOnTimeout": (1.0, 1.0), "Tcp_ActiveOpens": (2000.0, 0.3), "Tcp_PassiveOpens": (2000.0, 0.3),
    "Tcp_OutRsts": (500.0, 0.5),
}
# Lognormal device-to-device spread of the benign link recoveries (scenarios.py link_recovery_per_device_day).
LINK_RECOVERY_SIGMA = 1.5
# Benign bursts: a healthy device's counter spikes for minutes at precursor-like rates and stops (a link
# retrain, a memory-hungry kernel, a congested all-reduce). Per device-day rate, (low, high) events per
# second while it lasts, median minutes; counters that move with it (counter, share).
BENIGN_BURSTS = {
    "ecc_corrected_volatile": ("gpu", 0.04, (0.3, 2.0), 15.0, ()),
    "pcie_replay_counter": ("gpu", 0.04, (0.5, 3.0), 10.0, ()),
    "crc_flit_errors": ("gpu", 0.04, (5.0, 40.0), 10.0, (("replay_errors", 0.5),)),
    "symbol_error": ("hca", 0.04, (5.0, 60.0), 15.0, (("port_rcv_errors", 0.1),)),
    "local_ack_timeout_err": ("hca", 0.04, (0.2, 1.0), 10.0, (("out_of_sequence", 5.0),)),
    "port_xmit_discards": ("hca", 0.02, (1.0, 8.0), 10.0, ()),
}
# Marginal-but-stable devices: a small share of healthy devices run all their life at error rates a
# degrading one reaches half-way (a link within spec but with a high BER, a GPU with a weak memory row that
# the ECC keeps correcting). They never fail: a threshold on the rate flags them forever, a model that
# looks at the trend does not. counter -> (share of devices at difficulty 1, median events per second).
MARGINAL = {
    "ecc_corrected_volatile": (0.01, 0.05),
    "crc_flit_errors": (0.01, 1.0),
    "pcie_replay_counter": (0.005, 0.1),
    "symbol_error": (0.01, 0.5),
    "local_ack_timeout_err": (0.005, 0.02),
}
APP_XID_PER_NODE_DAY = 0.03
APP_XIDS = (13, 31, 43)  # drawn at APP_XID_PER_NODE_DAY; their class and text: foreshock/xid.py
PROBE_PEERS_PER_SITE = 1
# The driver raises Xid 92 when a GPU's corrected-ECC rate passes XID92_RATE_PER_S, judged once per
# window of its own, not at the collector's sampling interval (the window's length is an assumption:
# NVIDIA documents the Xid, not the window), so the Xid's count does not grow with a finer interval
# (benchmarks/results/predictor-sampling-interval-2026-12-04.md).
XID92_RATE_PER_S = 0.25
XID92_WINDOW_S = 60.0
# An NVLink-fabric episode (faults.py, mode nvswitch): the NVSwitch's SXid lines as the nvidia-nvswitch
# driver prints them, after "nvidia-nvswitchN: SXid (PCI:...): <code>, " (real lines with their sources:
# examples/kmsg/sxid-lines.txt). Their severity and columns are collectors/sxid.py's reading of the line.
NVSWITCH_NONFATAL_SXIDS = (
    (12028, "Non-fatal, Link {link:02d} egress non-posted PRIV error"),
    (19084, "Non-fatal, Link {link:02d} AN1 Heartbeat Timeout Error"),
)
NVSWITCH_FATAL_SXID = (20034, ("Fatal, Link {link:02d} LTSSM Fault Up",
                               "Severity 1 Engine instance {link:02d} Sub-engine instance 00",
                               "Data {{0x50610002, 0x10100030, 0x00000000, 0x10100030, 0x00000000, 0x00000000, "
                               "0x00000000, 0x00000000}}"))
# Assumptions: about this many non-fatal SXids over a failing fabric's precursor (densifying with its shape)
# and over a look-alike; the precursor intensity from which the GPUs' fabric health mask shows an
# access-timeout recovery, then degraded bandwidth (both held until the repair once the fabric fails);
# NVLink throughput lost at full intensity. At the failure every GPU of the domain loses its links to
# the failed switch tray (one to each of its chips) and logs its generation's Xid for a link taken down.
FABRIC_PRECURSOR_SXIDS = 20.0
FABRIC_LOOKALIKE_SXIDS = 3.0
FABRIC_TIMEOUT_RECOVERY_AT, FABRIC_DEGRADED_BW_AT = 0.25, 0.5
FABRIC_TP_LOSS = 0.1
# The Xid a GPU logs when a link of its own is taken down, by generation (Topology.gpu_generation): Hopper's
# NVLINK_ERROR with the catalogue's example text; Blackwell's NVLink5 link event, whose class is its message's
# Fatal token (foreshock/xid.py). Where the switch logs a non-fatal SXid for a link, the GPU at its other end
# logs a Nonfatal NVLink5 error naming its own link to that switch chip (Blackwell only: an H100 has no
# such Xid). The NVLink5 texts are the real lines of ../shared/fixtures/kmsg/xid-lines.txt, link varied.
LINK_DOWN_XIDS: dict[str, tuple[int, str | None]] = {
    xidcat.H100: (74, None),
    xidcat.GB200: (149, "NETIR_LINK_EVT Fatal XC0 i0 Link {link:02d} (0x025001c6 0x00000000 0x00000000 0x00000000 "
                        "0x00000000 0x00000000)"),
}
LINK_ERROR_XID = (145, "RLW_RXPIPE Nonfatal XC0 i0 Link {link:02d} (0x0409a0c2 0x00000008 0x00000001 0x00000000 "
                       "0x00100000 0x00000004)")
FABRIC_SXID_GRID = 1024  # cells over which an episode's SXid times are drawn in proportion to its intensity
LATE_SAMPLE_SHARE = 0.01  # samples a collector takes late by up to the world's ts_jitter_s (scenarios.py)
PMA_CLEAR = "pma_clear"   # a reset of the narrow IB PMA error counters only (a fabric manager's clear)
PMA_ERROR_COUNTERS = frozenset(n for n, w in sch.IB_PORT_COUNTERS.items() if w < 32)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """Counter-based hash (splitmix64) -> uniform [0, 1): the same (key, time) gives the same value
    whichever block or process asks, which keeps job-wide signals identical on every node of a job."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _col(a: np.ndarray) -> np.ndarray:
    """A per-node array (B,) as a column against time, or a per-node-and-time one (B, T) as it is."""
    return a[:, None] if a.ndim == 1 else a


def job_runs(topo: Topology, world: World, seed: int, nodes: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """The job run each node is in: (B,) job indices of the topology (-1 idle) where jobs never change,
    or (B, T) run ids where the world ends all jobs every `job_epoch_h` hours and starts new ones on the
    site's nodes rotated by a random shift, so nodes move between jobs and the spares. A run id is
    slot + n_slots * epoch, so every run is a new job (job_name)."""
    static = topo.job_of
    epoch_h = float(world.scalar("job_epoch_h"))
    if epoch_h <= 0:
        return static[nodes]
    n_slots = max(topo.n_jobs, 1)
    src = job_places(topo, world, seed, nodes, ts)
    epoch = ts // int(epoch_h * 3600 * NS)
    slot = static[src]
    return np.where(slot >= 0, slot + n_slots * epoch[None, :], -1)


def job_places(topo: Topology, world: World, seed: int, nodes: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """The topology's node whose place in a job each node takes (job_runs): the node itself (B,) where
    jobs never change, else (B, T) the node of its site the epoch's shift puts it on."""
    epoch_h = float(world.scalar("job_epoch_h"))
    if epoch_h <= 0:
        return nodes
    site_of = topo.site_of
    starts = np.array([int(np.flatnonzero(site_of == s)[0]) for s in range(topo.sites)])
    sizes = np.bincount(site_of, minlength=topo.sites)
    site = site_of[nodes]
    epoch = ts // int(epoch_h * 3600 * NS)
    with np.errstate(over="ignore"):
        u = _splitmix((site.astype(np.uint64)[:, None] * np.uint64(0x2545F491)) ^ epoch.astype(np.uint64)[None, :]
                      ^ np.uint64(int(_key(seed, "job-epoch"))))
    size = sizes[site][:, None]
    shift = (u * size).astype(np.int64)
    pos = (nodes - starts[site])[:, None]
    return starts[site][:, None] + (pos + shift) % size


def job_name(run: int, n_slots: int, churn: bool) -> str | None:
    """The inventory's job label of a run (None: a spare): job-003, or job-003-r40917 where jobs change."""
    if run < 0:
        return None
    return f"job-{run % n_slots:03d}-r{run // n_slots}" if churn else f"job-{run:03d}"


def _key(*parts: int) -> np.uint64:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(h, "little"))


@dataclass
class Block:
    """The working arrays of one generate() call: (B nodes, C components, T samples)."""

    nodes: np.ndarray
    ts: np.ndarray
    prev0: np.ndarray              # (B,) each node's sample time before ts[0]
    dt: np.ndarray                 # (B, T) seconds since the previous sample
    deltas: dict                   # counter -> (B, C, T) int64 increments
    node_tp: np.ndarray            # (B, T) throughput factor (stragglers)
    gpu_tp: np.ndarray             # (B, G, T)
    port_tp: np.ndarray            # (B, H, T)
    temp_add: np.ndarray           # (B, G, T) degC
    hbm_add: np.ndarray            # (B, G, T) degC on the HBM only
    clock_bits: np.ndarray         # (B, G, T) uint64 extra clock-event reasons
    links_down: np.ndarray         # (B, G, T) int16
    pcie_width: np.ndarray         # (B, G, T) int8
    gpu_lost: np.ndarray           # (B, G, T) bool
    port_down: np.ndarray          # (B, H, T) bool
    hang: np.ndarray               # (B, T) bool: traffic stops, GPUs spin
    in_service: np.ndarray         # (B, T) bool: rows are emitted
    probe_rtt_add: np.ndarray      # (B, T) ms
    probe_loss: np.ndarray         # (B, T) ratio
    tcp_retrans_ratio: np.ndarray  # (B, T) extra retransmitted share of OutSegs
    remap_failure: np.ndarray      # (B, G, T) bool
    events: list
    resets: list                   # (b, t index, None: a reboot | gpu index replaced | PMA_CLEAR)
    row_ts: np.ndarray | None = None  # (B, T) the collector's sample times, where they are jittered
    jobs: np.ndarray | None = None    # (B,) or (B, T) job runs (job_runs)
    fabric_health: np.ndarray | None = None  # (B, G, T) fabric health masks, where an episode changes them
    step_pace: np.ndarray | None = None      # (B, T) the pace of the node's job (a job-wide slowdown)
    compute_tp: np.ndarray | None = None     # (B, T) the pace of the node's own compute (its rank's)


class ClusterModel:
    """State and physics of a simulated cluster. generate() advances the nodes it is given."""

    def __init__(self, topo: Topology, *, seed: int, episodes: list[Episode] = (), difficulty: float = 1.0,
                 start_ns: int = 0, interval_s: float = 60.0, time_compression: float = 1.0,
                 world: World | None = None, step_times: bool = False):
        """`step_times`: generate() returns the jobs' step_times rows too (`foreshock simulate` writes
        them; the live simulator's collectors do not read step times)."""
        self.topo = topo
        self.step_times = bool(step_times)
        self.world = world if world is not None else World("clean", seed=seed, n_pods=topo.n_leaves)
        self._node_types(topo)
        jobs = topo.job_of
        # a node's rank in its job: its place among the job's nodes (one rank per node, docs/simulator.md)
        self.rank_in_job = np.full(topo.nodes, -1, dtype=np.int32)
        for j in np.unique(jobs[jobs >= 0]).tolist():
            members = np.flatnonzero(jobs == j)
            self.rank_in_job[members] = np.arange(len(members), dtype=np.int32)
        self.drain_ns = int(DRAIN_NS / time_compression)
        self.restart_ns = int(RESTART_NS / time_compression)
        self._by_job: dict[int, list[Episode]] = {}
        self._detached: dict[int, int] = {}   # node -> since when its job no longer runs on it (ns)
        self.seed = int(seed)
        self.difficulty = float(difficulty)
        self.interval_s = float(interval_s)
        self.episodes: list[Episode] = []
        self._sxids: dict[str, tuple] = {}
        self._by_node: dict[int, list[Episode]] = {}
        for ep in episodes:
            self.add_episode(ep)
        N, G, H = topo.nodes, topo.gpus_per_node, topo.hcas_per_node
        init = np.random.default_rng(np.random.SeedSequence([self.seed, 1]))
        d = self.difficulty
        pod = topo.leaf_of
        s_add = self.world.per_node("chronic_sigma_add", pod).astype(float)[:, None]
        s_mul = self.world.per_node("chronic_scale", pod).astype(float)[:, None]
        self.chronic = {
            "gpu": {k: med * d / 86400.0 * np.exp((sig + s_add) * init.standard_normal((N, G))) * s_mul
                    for k, (med, sig) in BENIGN_GPU.items()},
            "hca": {k: med * d / 86400.0 * np.exp((sig + s_add) * init.standard_normal((N, H))) * s_mul
                    for k, (med, sig) in BENIGN_HCA.items()},
            "node": {k: med / 86400.0 * np.exp(sig * init.standard_normal((N, 1))) for k, (med, sig) in BENIGN_NODE.items()},
        }
        # Benign link recoveries of healthy devices (the catalogue's link_recovery_per_device_day), from a
        # stream of their own so that the draws above and every block's benign stream stay as they were.
        rec_median = self.world.per_node("link_recovery_per_device_day", pod).astype(float)[:, None]
        rec = np.random.default_rng(np.random.SeedSequence([self.seed, 4]))
        self.link_recovery = {  # counter -> per-device rate (N, GPUs or HCAs), events a second
            name: rec_median / 86400.0 * np.exp(LINK_RECOVERY_SIGMA * rec.standard_normal((N, C)))
            for name, C in (("recovery_errors", G), ("link_error_recovery", H))
        } if (rec_median > 0).any() else {}
        m_mul = self.world.per_node("marginal_scale", pod).astype(float)[:, None]
        for kind in ("gpu", "hca"):
            for name, rates in self.chronic[kind].items():
                if name in MARGINAL:
                    share, median = MARGINAL[name]
                    marginal = init.random(rates.shape) < share * d * m_mul
                    rates[marginal] = median * np.exp(0.8 * init.standard_normal(int(marginal.sum())))
        self.gpu_temp_offset = init.normal(0.0, 2.5, (N, G))
        self.gpu_power_offset = init.normal(0.0, 12.0, (N, G))
        self.job_phase = init.uniform(0.0, 1.0, max(topo.n_jobs, 1))
        self.state = {
            "gpu": {k: np.zeros((N, G), dtype=np.int64) for k in GPU_COUNTERS},
            "hca": {k: np.zeros((N, H), dtype=np.int64) for k in HCA_COUNTERS},
            "node": {k: np.zeros((N, 1), dtype=np.int64) for k in NODE_COUNTERS},
        }
        # A fleet is not new: lifetime counters start where months of service left them.
        age_days = init.uniform(30.0, 400.0, (N, G))
        self.state["gpu"]["ecc_corrected_aggregate"] += init.poisson(
            self.chronic["gpu"]["ecc_corrected_volatile"] * 86400.0 * age_days * 0.2)
        self.state["gpu"]["remapped_rows_correctable"] += init.poisson(0.002 * age_days)
        if self.world.random:
            # Counters since the last driver load or PMA clear: the busy 32-bit hw_counters anywhere in their
            # range (they wrap during the run), a tenth of the narrow PMA error counters already high or stuck.
            hist = np.random.default_rng(np.random.SeedSequence([self.seed, 3]))
            for name in ("rx_write_requests", "rx_read_requests"):
                self.state["hca"][name] += hist.integers(0, 1 << 32, (N, H))
            for name in sorted(PMA_ERROR_COUNTERS):
                top = (1 << sch.IB_PORT_COUNTERS[name]) - 1
                self.state["hca"][name] += hist.integers(0, top + 1, (N, H)) * (hist.random((N, H)) < 0.1)
        self.state["node"]["carrier_changes"] += 2
        self.state["node"]["carrier_up_count"] += 1
        self.state["node"]["carrier_down_count"] += 1
        self.energy = np.zeros((N, G), dtype=np.float64)
        self.remap_pending = np.zeros((N, G), dtype=bool)
        self.remap_failed = np.zeros((N, G), dtype=bool)
        self.generation = np.zeros((N, G), dtype=np.int64)
        self.ce_hot = np.zeros((N, G), dtype=bool)
        # the corrected-ECC counts and sample spans of the samples before a block in the Xid 92 window
        self.xid92_samples = max(1, int(round(XID92_WINDOW_S / self.interval_s)))
        self.ce_window = np.zeros((N, G, self.xid92_samples - 1), dtype=np.int64)
        self.dt_window = np.full((N, self.xid92_samples - 1), self.interval_s)
        self.last_ts = np.full(N, start_ns - int(interval_s * NS), dtype=np.int64)

    @staticmethod
    def node_type_arrays(topo: Topology, world: World) -> dict[str, np.ndarray]:
        """Per node: GPUs and HCAs present (the physics runs on the topology's, absent ones are dropped)."""
        pods = range(topo.n_leaves)
        return {"gpus": np.array([component_count(topo, world, "gpu", p) for p in pods])[topo.leaf_of],
                "hcas": np.array([component_count(topo, world, "hca", p) for p in pods])[topo.leaf_of]}

    def _node_types(self, topo: Topology) -> None:
        """Per node: the world's node type (components present, NVLink links, PCIe generation) and the
        per-pod nuisance knobs the physics reads each step."""
        w, pod = self.world, topo.leaf_of
        types = self.node_type_arrays(topo, w)
        self.n_gpus, self.n_hcas = types["gpus"], types["hcas"]
        self.short_nodes = bool((self.n_gpus < topo.gpus_per_node).any() or (self.n_hcas < topo.hcas_per_node).any())
        links = w.per_node("nvlinks_per_gpu", pod).astype(np.int16)
        self.nvlinks = np.where(links > 0, links, NVLINKS_PER_GPU).astype(np.int16)
        gen = w.per_node("pcie_gen", pod).astype(np.int8)
        self.pcie_gen = np.where(gen > 0, gen, PCIE_GEN).astype(np.int8)
        self.idle_downtrain = w.per_node("idle_pcie_downtrain", pod).astype(bool)
        self.site_temp_amp = w.per_node("site_temp_amp_c", pod).astype(float)
        self.burst_scale = w.per_node("burst_scale", pod).astype(float)
        jobs = topo.job_of
        first = {int(j): i for i, j in reversed(list(enumerate(jobs))) if j >= 0}
        job_pod = np.array([pod[first[j]] for j in range(max(topo.n_jobs, 1))]) if first else np.zeros(1, int)
        self.job_knobs = {k: w.per_node(k, job_pod).astype(float) for k in ("load_spread", "load_diurnal", "job_gap_share")}
        self.traffic_imbalance = w.per_node("job_traffic_imbalance", job_pod).astype(float)

    # -- the schedule ----------------------------------------------------------------------------
    def add_episode(self, ep: Episode) -> None:
        self.episodes.append(ep)
        for n in self._touched_nodes(ep):
            self._by_node.setdefault(int(n), []).append(ep)
        if ep.fails:
            at_fail = self.jobs_at(np.asarray(ep.nodes, dtype=np.int64), np.array([ep.end_ns], dtype=np.int64))
            for j in set(at_fail.reshape(-1).tolist()) - {-1}:
                self._by_job.setdefault(int(j), []).append(ep)

    def jobs_at(self, nodes: np.ndarray, ts: np.ndarray) -> np.ndarray:
        return job_runs(self.topo, self.world, self.seed, nodes, ts)

    def _touched_nodes(self, ep: Episode):
        """The nodes whose telemetry the episode changes: its own, and for a job-wide slowdown every node
        that shares a job with the culprit while it lasts (with jobs that move: any node of its site)."""
        if ep.extra.get("signature") == "job_slow":
            if float(self.world.scalar("job_epoch_h")) > 0:
                site = self.topo.site_of[ep.nodes[0]]
                return np.flatnonzero(self.topo.site_of == site).tolist()
            job = int(self.topo.job_of[ep.nodes[0]])
            if job >= 0:
                return sorted(set(ep.nodes) | set(np.flatnonzero(self.topo.job_of == job).tolist()))
        return ep.nodes

    def detach(self, node: int, since_ns: int) -> None:
        """The job's work has moved off the node (an evacuation): a failure of it from then on stalls
        no job. The node's own telemetry is unchanged."""
        self._detached[int(node)] = int(since_ns)

    def _stalls_job(self, ep: Episode) -> bool:
        return not all(n in self._detached and self._detached[n] <= ep.end_ns for n in map(int, ep.nodes))

    def _job_stalls(self, jobs: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """(B, T): the node's job is down after a failure of one of its nodes, until it restarts."""
        stall = np.zeros((len(jobs), len(ts)), bool)
        for j in set(np.unique(jobs).tolist()) - {-1}:
            for ep in self._by_job.get(j, ()):
                if ep.end_ns <= ts[-1] and ep.end_ns + self.restart_ns > ts[0] and self._stalls_job(ep):
                    stall |= (_col(jobs) == j) & ((ts >= ep.end_ns) & (ts < ep.end_ns + self.restart_ns))[None, :]
        return stall

    def _relevant(self, nodes: np.ndarray, t0: int, t1: int) -> list[Episode]:
        seen, out = set(), []
        for n in nodes:
            for ep in self._by_node.get(int(n), ()):
                last = ep.repair_ns if ep.fails else ep.end_ns
                if ep.episode_id not in seen and ep.start_ns <= t1 and last >= t0:
                    seen.add(ep.episode_id)
                    out.append(ep)
        return out

    # -- the shared job-level processes -----------------------------------------------------------
    def _activity(self, jobs: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(activity, congestion), each (B, T): identical for every node of a job at the same time.

        Training throughput is steady: a job's step rate holds for six-hour segments and moves slightly
        between them. Checkpoints (asynchronous, every 90 min) dip the GPUs a little and burst the
        front-end network, not the training fabric. Congestion comes in one-minute bursts."""
        base = int(_key(self.seed, "job"))
        j = _col((jobs.astype(np.int64) + 1).astype(np.uint64))
        slot = np.maximum(jobs, 0) % max(self.topo.n_jobs, 1)
        with np.errstate(over="ignore"):
            seg = (ts // (6 * 3600 * NS)).astype(np.uint64)[None, :]
            minute = (ts // (60 * NS)).astype(np.uint64)[None, :]
            u1 = _splitmix((j * np.uint64(0x100000001B3)) ^ (seg * np.uint64(0x9E37)) ^ np.uint64(base))
            u2 = _splitmix((j * np.uint64(0x100000001B3)) ^ (minute * np.uint64(0x85EB)) ^ np.uint64((base + 7) % (1 << 64)))
        if jobs.ndim == 1:
            phase = self.job_phase[np.maximum(jobs, 0)][:, None]
        else:  # every run of a job slot is a new job, with its own checkpoint phase
            with np.errstate(over="ignore"):
                phase = _splitmix(j * np.uint64(0xD1B54A32D192ED03) ^ np.uint64((base + 29) % (1 << 64)))
        in_ckpt = ((ts[None, :] / NS / CKPT_PERIOD_S + phase) % 1.0) < (CKPT_S / CKPT_PERIOD_S)
        act = np.broadcast_to(0.90 + 0.06 * u1, (len(jobs), len(ts))).copy()
        cong = np.broadcast_to(np.round(np.clip((u2 - 0.55) * 2.2, 0.0, 1.0) ** 2 * 16.0) / 16.0, act.shape).copy()
        idle = np.broadcast_to(_col(jobs < 0), act.shape)
        if self.world.varied:
            jk = {k: _col(v[slot]) for k, v in self.job_knobs.items()}
            # Hour by hour (a scheduler's pace): steady within an hour, so the counters stay cheap to store.
            hour = (ts // (3600 * NS)) % 24
            night = 0.5 * (1.0 + np.cos(2 * np.pi * (hour - 3.0) / 24.0))[None, :]  # 1 at 03:00 UTC
            act = (0.96 - jk["load_spread"] * (1.0 - u1)) * (1.0 - jk["load_diurnal"] * night)
            with np.errstate(over="ignore"):
                u3 = _splitmix((j * np.uint64(0x100000001B3)) ^ (seg * np.uint64(0xC2B2)) ^ np.uint64((base + 13) % (1 << 64)))
            gap = u3 < jk["job_gap_share"]
            act = np.where(gap, 0.01, act)
            cong = np.where(gap, 0.0, cong)
            in_ckpt = in_ckpt & ~gap
        act[idle] = 0.01
        cong[idle] = 0.0
        in_ckpt &= ~idle
        return act, cong, in_ckpt

    def _traffic_share(self, nodes: np.ndarray, jobs: np.ndarray) -> np.ndarray | float:
        """(B, 1) or (B, T): each node's share of its job's traffic per device, 1 +- the job's imbalance,
        fixed for a run of the job (a pipeline stage or shard keeps its place until the job ends)."""
        if not self.traffic_imbalance.any():
            return 1.0
        jobs = _col(jobs) if jobs.ndim == 1 else jobs
        slot = np.maximum(jobs, 0) % max(self.topo.n_jobs, 1)
        with np.errstate(over="ignore"):
            u = _splitmix((jobs.astype(np.int64) + 1).astype(np.uint64) * np.uint64(0x100000001B3)
                          ^ _col(nodes.astype(np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
                          ^ np.uint64(int(_key(self.seed, "share")) % (1 << 64)))
        share = 1.0 + self.traffic_imbalance[slot] * (2.0 * u - 1.0)
        return np.where(jobs < 0, 1.0, share)

    # -- one call --------------------------------------------------------------------------------
    def generate(self, nodes, ts) -> dict[str, pa.Table]:
        """Advance `nodes` (indices) through sample times `ts` (ns, increasing) and return their rows."""
        topo = self.topo
        nodes = np.asarray(nodes, dtype=np.int64)
        ts = np.asarray(ts, dtype=np.int64)
        B, T, G, H = len(nodes), len(ts), topo.gpus_per_node, topo.hcas_per_node
        prev = self.last_ts[nodes]
        if np.any(ts[0] <= prev):
            raise ValueError(f"sample time {ts[0]} is not after the previous sample of every node")
        dt = np.diff(np.concatenate([np.broadcast_to(prev[:, None], (B, 1)), np.broadcast_to(ts, (B, T))], axis=1),
                     axis=1) / NS
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2, int(ts[0]), int(nodes[0]), B, T]))
        blk = Block(
            nodes=nodes, ts=ts, prev0=prev.copy(), dt=dt, deltas={},
            node_tp=np.ones((B, T)), gpu_tp=np.ones((B, G, T)), port_tp=np.ones((B, H, T)),
            temp_add=np.zeros((B, G, T)), hbm_add=np.zeros((B, G, T)), clock_bits=np.zeros((B, G, T), dtype=np.uint64),
            links_down=np.zeros((B, G, T), dtype=np.int16), pcie_width=np.full((B, G, T), PCIE_WIDTH, np.int8),
            gpu_lost=np.zeros((B, G, T), bool), port_down=np.zeros((B, H, T), bool), hang=np.zeros((B, T), bool),
            in_service=np.ones((B, T), bool), probe_rtt_add=np.zeros((B, T)), probe_loss=np.zeros((B, T)),
            tcp_retrans_ratio=np.zeros((B, T)), remap_failure=np.zeros((B, G, T), bool), events=[], resets=[],
            step_pace=np.ones((B, T)), compute_tp=np.ones((B, T)),
        )
        # 1. Every draw of the benign stream, with parameters the fault schedule cannot change.
        jobs = self.jobs_at(nodes, ts)
        blk.jobs = jobs
        act, cong, ckpt = self._activity(jobs, ts)
        z_gpu = rng.standard_normal((4, B, G, T)).astype(np.float32)
        z_hca = rng.standard_normal((2, B, H, T)).astype(np.float32)
        z_node = rng.standard_normal((4, B, T)).astype(np.float32)
        benign = {}
        for kind, table in (("gpu", BENIGN_GPU), ("hca", BENIGN_HCA), ("node", BENIGN_NODE)):
            for name in table:
                rate = self.chronic[kind][name][nodes]  # (B, C)
                benign[name] = _sparse_poisson(rng, rate, dt)
        if self.link_recovery:
            rrng = np.random.default_rng(np.random.SeedSequence([self.seed, 5, int(ts[0]), int(nodes[0]), B, T]))
            for name, rate in self.link_recovery.items():
                arr = _sparse_poisson(rrng, rate[nodes], dt)
                benign[name] = benign[name] + arr if name in benign else arr
        for name, arr in self._draw_bursts(rng, nodes, dt).items():
            benign[name] = benign[name] + arr if name in benign else arr
        app_xids = self._draw_app_xids(rng, nodes, ts)

        # 2. The fault schedule's effects (each from its own stream).
        for ep in self._relevant(nodes, int(ts[0] - dt.max() * NS), int(ts[-1])):
            self._apply_episode(blk, ep)
        # the migrator reports step times whatever the collector does: the nodes its nuisances leave out
        # still step, the nodes in repair do not
        serving = blk.in_service.copy()
        if self.world.varied:
            self._collection(blk)

        # 3. Traffic, counters and analog values.
        stall = self._job_stalls(jobs, ts)
        act = np.where(stall, 0.01, act)
        cong = np.where(stall, 0.0, cong)
        tp = blk.node_tp * (~blk.hang)
        d = blk.deltas
        for name, arr in benign.items():
            d[name] = d[name] + arr if name in d else arr
        self._traffic(blk, act, cong, ckpt, tp * self._traffic_share(nodes, jobs), z_gpu, z_hca, z_node)
        tables = self._render(blk, act * np.where(ckpt, 0.7, 1.0), tp, z_gpu, z_node, app_xids)
        if self.step_times:
            tables["step_times"] = self._step_times(blk, act, serving & ~blk.hang)
        self.last_ts[nodes] = ts[-1]
        return tables

    # -- benign sparse events ----------------------------------------------------------------------
    def _draw_bursts(self, rng, nodes, dt) -> dict[str, np.ndarray]:
        """Benign bursts inside this block (each starts and ends within it)."""
        B, T = dt.shape
        out: dict[str, np.ndarray] = {}
        span_days = float(dt.sum(axis=1).mean()) / 86400.0
        step_s = float(dt.mean())
        for name, (kind, per_day, (lo, hi), minutes, companions) in BENIGN_BURSTS.items():
            C = self.topo.gpus_per_node if kind == "gpu" else self.topo.hcas_per_node
            if self.world.varied:
                scale = self.burst_scale[nodes]
                count = rng.poisson(per_day * self.difficulty * scale.sum() * C * span_days)
                if count == 0:
                    continue
                b = rng.choice(B, size=count, p=scale / scale.sum())
            else:
                count = rng.poisson(per_day * self.difficulty * B * C * span_days)
                if count == 0:
                    continue
                b = rng.integers(B, size=count)
            c = rng.integers(C, size=count)
            length = np.maximum(1, np.round(minutes * 60.0 / step_s * np.exp(0.7 * rng.standard_normal(count)))).astype(int)
            length = np.minimum(length, T)
            start = (rng.random(count) * (T - length + 1)).astype(int)
            rate = np.exp(rng.uniform(np.log(lo), np.log(hi), count))
            for name_, share in ((name, 1.0), *companions):
                arr = out.setdefault(name_, np.zeros((B, C, T), np.int64))
                for k in range(count):
                    sl = slice(start[k], start[k] + length[k])
                    arr[b[k], c[k], sl] += rng.poisson(rate[k] * share * dt[b[k], sl])
        return out

    def _collection(self, blk: Block) -> None:
        """The random world's collection noise on a block: late samples (jittered ts), lost samples,
        collector outages, driver reloads (every volatile counter restarts from 0) and PMA clears. Each comes
        from a hash or a stream keyed by (seed, node, time), never from the block's benign stream."""
        w, topo = self.world, self.topo
        nodes, ts = blk.nodes, blk.ts
        pods = topo.leaf_of[nodes]
        node_key = nodes.astype(np.uint64)[:, None] * np.uint64(0x9E3779B1)
        key = node_key ^ (ts // NS).astype(np.uint64)[None, :]
        salt = int(_key(self.seed, "collect"))
        with np.errstate(over="ignore"):
            u_phase = _splitmix(node_key ^ (ts // DAY).astype(np.uint64)[None, :] ^ np.uint64(salt))
            u_late = _splitmix(key ^ np.uint64(salt))
            u_miss = _splitmix(key ^ np.uint64((salt * 3 + 1) % (1 << 64)))
        # A collector's phase against the minute (set per node and day: a restart moves it), plus now and
        # then a late sample. Per-sample jitter on every row would cost 4 bytes a row on disk.
        jitter_s = np.minimum(w.per_node("ts_jitter_s", pods).astype(float), 0.2 * self.interval_s)[:, None]
        late = np.where(u_late < LATE_SAMPLE_SHARE, u_late / LATE_SAMPLE_SHARE, 0.0)
        blk.row_ts = ts[None, :] + ((u_phase + late) * jitter_s * NS).astype(np.int64)
        collected = u_miss >= w.per_node("missing_share", pods).astype(float)[:, None]
        first_day, last_day = int(ts[0] // DAY) - 1, int(ts[-1] // DAY)
        for r, (n, p) in enumerate(zip(nodes.tolist(), pods.tolist())):
            for day in range(first_day, last_day + 1):
                outages, reloads, clears = w.collection_events(n, p, day)
                for a, b in outages:
                    collected[r] &= ~((ts >= a) & (ts < b))
                for t_ns, what in [(t, None) for t in reloads] + [(t, PMA_CLEAR) for t in clears]:
                    after = np.flatnonzero(ts >= t_ns)
                    if after.size and (after[0] > 0 or blk.prev0[r] < t_ns):
                        blk.resets.append((r, int(after[0]), what))
        blk.in_service &= collected

    def _draw_app_xids(self, rng, nodes, ts):
        span_days = max((ts[-1] - self.last_ts[nodes].min()) / NS / 86400.0, 1e-9)
        count = rng.poisson(APP_XID_PER_NODE_DAY * self.difficulty * len(nodes) * span_days)
        b = rng.integers(len(nodes), size=count)
        t = rng.integers(len(ts), size=count)
        g = rng.integers(self.topo.gpus_per_node, size=count)
        x = rng.choice(np.array(APP_XIDS), size=count)
        return list(zip(b.tolist(), t.tolist(), g.tolist(), x.tolist()))

    # -- the failure modes -------------------------------------------------------------------------
    def _intensity(self, ep: Episode, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(x, active, intensity) of an episode's precursor at times ts: x its progress in [0, 1]; a failure's
        rises with its shape to peak / sqrt(difficulty), a look-alike's rises to its peak and fades out."""
        span = max(ep.end_ns - ep.start_ns, 1)
        x = np.clip((ts - ep.start_ns) / span, 0.0, 1.0)
        active = (ts >= ep.start_ns) & (ts < ep.end_ns)
        shape, params = ep.extra.get("shape", "ramp"), ep.extra.get("shape_params", ())
        if ep.fails:
            rise = x ** 2 if shape == "ramp" else shape_intensity(shape, x, params)
            inten = np.where(active, rise, 0.0) * ep.peak / np.sqrt(self.difficulty)
        else:
            x_rise = np.minimum(x / 0.7, 1.0)
            rise = x_rise ** 2 if shape == "ramp" else shape_intensity(shape, x_rise, params)
            fall = np.clip((1.0 - x) / 0.3, 0.0, 1.0)
            inten = np.where(active, rise * np.where(x > 0.7, fall, 1.0), 0.0) * ep.peak
        return x, active, inten

    def _apply_episode(self, blk: Block, ep: Episode) -> None:
        ts = blk.ts
        mode = MODES[ep.mode]
        span = max(ep.end_ns - ep.start_ns, 1)
        shape, params = ep.extra.get("shape", "ramp"), ep.extra.get("shape_params", ())
        signature = ep.extra.get("signature", "")
        x, active, inten = self._intensity(ep, ts)
        if signature == "job_slow":
            # A synchronous job runs at its slowest rank's pace: every node of the job slows together.
            culprit = _col(self.jobs_at(np.asarray(ep.nodes[:1], dtype=np.int64), ts))
            peers = (_col(blk.jobs) == culprit) & (culprit >= 0)
            blk.node_tp *= np.where(peers, 1.0 - 0.3 * inten[None, :], 1.0)
            blk.step_pace *= np.where(peers, 1.0 - 0.3 * inten[None, :], 1.0)
        local = {int(n): i for i, n in enumerate(blk.nodes)}
        rows = [local[n] for n in ep.nodes if n in local]
        if not rows:
            return
        rows = np.array(rows)
        erng = np.random.default_rng(np.random.SeedSequence([ep.seed & ((1 << 63) - 1), int(ts[0]), int(rows[0])]))
        failed = (ts >= ep.end_ns) & (ts < ep.repair_ns) if ep.fails else np.zeros(len(ts), bool)
        c = ep.component
        dt = blk.dt[rows]  # (R, T)

        span_s = span / NS

        mean = shape_mean(shape, params)

        def over(total: float) -> float:
            """A rate that gives about `total` events over the whole precursor (the integral of x^2 is 1/3)."""
            return 3.0 * total / span_s if shape == "ramp" else total / (mean * span_s)

        def add(counter: str, rate_per_s: float, comps=None, inten_=None):
            i = inten if inten_ is None else inten_
            lam = rate_per_s * i[None, :] * dt
            if not lam.any():
                return
            arr = blk.deltas.get(counter)
            if arr is None:
                C = self.topo.gpus_per_node if counter in GPU_COUNTERS else (
                    self.topo.hcas_per_node if counter in HCA_COUNTERS else 1)
                blk.deltas[counter] = arr = np.zeros((len(blk.nodes), C, len(ts)), np.int64)
            for k in ([c if arr.shape[1] > 1 else 0] if comps is None else comps):
                arr[rows, k, :] += erng.poisson(lam)

        m = ep.mode
        if signature == "remaps+temp":      # rows remapped, the HBM warming, little corrected ECC
            add("ecc_corrected_volatile", 0.02)
            add("remapped_rows_correctable", over(6.0))
            blk.hbm_add[rows, c, :] += ep.extra["hbm_temp_c"] * inten
        elif signature == "ecc_step":       # corrected ECC steps to a constant rate (shape: step)
            add("ecc_corrected_volatile", 1.0)
            add("remapped_rows_correctable", over(1.0))
        elif signature == "single_remap":   # a look-alike: one row remapped half-way, nothing after
            half = np.flatnonzero(ts >= ep.start_ns + span // 2)
            if half.size and (half[0] > 0 or blk.prev0[rows[0]] < ep.start_ns + span // 2):
                arr = blk.deltas.setdefault("remapped_rows_correctable",
                                            np.zeros((len(blk.nodes), self.topo.gpus_per_node, len(ts)), np.int64))
                arr[rows, c, half[0]] += 1
        elif signature == "x8":             # the link trains down to x8 early, few replays
            add("pcie_replay_counter", 0.05)
            blk.pcie_width[rows, c, :] = np.where(active & (x > 0.1), 8, blk.pcie_width[rows, c, :])
        elif signature == "replay_bursts":  # replays in bursts with quiet gaps (shape: bursts)
            add("pcie_replay_counter", 2.0)
        elif signature == "recoveries":     # link error recoveries and flaps, few symbol errors
            add("symbol_error", 0.3)
            add("port_rcv_errors", 0.05)
            add("link_error_recovery", over(40.0))
            add("local_link_integrity_errors", over(6.0))
            add("local_ack_timeout_err", 0.3)
            add("out_of_sequence", 3.0)
            add("link_downed", over(6.0))
            blk.port_tp[rows, c, :] *= 1.0 - 0.2 * inten
        elif signature == "job_slow":       # the culprit keeps pace with its job, but runs hot and slow-clocked
            blk.clock_bits[rows, :, :] |= np.where(inten > 0.3, np.uint64(0x8), np.uint64(0))[None, None, :]
            blk.temp_add[rows, :, :] += 8.0 * inten[None, None, :]
            blk.compute_tp[rows, :] *= 1.0 - 0.3 * inten   # the rank the job waits for
        elif m in ("hbm", "sram"):
            add("ecc_corrected_volatile", 1.0 if m == "hbm" else 0.25)
            if m == "hbm":
                add("remapped_rows_correctable", over(4.0))
        elif m == "nvlink":
            add("crc_flit_errors", 20.0)
            add("crc_data_errors", 0.5)
            add("replay_errors", 10.0)
            add("recovery_errors", over(12.0))
            drop_at = 0.8 + 0.15 * ((ep.variant >> 3) % 4) / 4
            blk.links_down[rows, c, :] += (active & (x >= drop_at)).astype(np.int16)
            blk.gpu_tp[rows, c, :] *= 1.0 - 0.1 * inten
        elif m == "gpu_off_bus_pcie":
            add("pcie_replay_counter", 2.0)
            if ep.variant % 2 == 0:
                blk.pcie_width[rows, c, :] = np.where(active & (inten > 0.5), 8, blk.pcie_width[rows, c, :])
        elif m == "straggler":
            blk.node_tp[rows, :] *= 1.0 - 0.35 * inten
            blk.compute_tp[rows, :] *= 1.0 - 0.35 * inten
            if ep.variant % 3 == 0:
                blk.clock_bits[rows, :, :] |= np.where(inten > 0.4, np.uint64(0x8), np.uint64(0))[None, None, :]
        elif m == "thermal":
            blk.temp_add[rows, c, :] += 30.0 * inten
        elif m == "ib_cable":
            add("symbol_error", 30.0)
            add("port_rcv_errors", 3.0)
            add("link_error_recovery", over(25.0))
            add("local_link_integrity_errors", over(10.0))
            add("local_ack_timeout_err", 0.5)
            add("out_of_sequence", 5.0)
            add("packet_seq_err", 1.0)
            add("implied_nak_seq_err", 1.0)
            add("duplicate_request", 2.0)
            add("link_downed", over(3.0))
            blk.port_tp[rows, c, :] *= 1.0 - 0.2 * inten
        elif m == "nic":
            add("req_cqe_error", 0.05)
            add("resp_cqe_error", 0.05)
            add("req_cqe_flush_error", 0.5)
            add("resp_cqe_flush_error", 0.5)
            add("local_ack_timeout_err", 0.3)
            add("rnr_nak_retry_err", 0.2)
            add("out_of_buffer", 20.0)
            lam = over(5.0) * inten[None, :] * dt
            for r, t in zip(*np.nonzero(erng.poisson(lam))):
                self._nic_event(blk, int(rows[r]), c, int(t), "mlx5_core {bus}: mlx5_cmd_out_err:838: "
                                "QUERY_QP(0x50b) op_mod(0x0) failed, status bad resource state(0x9), syndrome (0x3a61d5)")
        elif m == "leaf_switch":
            hcas = list(range(self.topo.hcas_per_node))
            add("port_rcv_remote_physical_errors", 2.0, hcas)
            add("port_xmit_discards", 5.0, hcas)
            add("port_xmit_wait", XMIT_WAIT_TICKS_PER_S * 0.3, hcas)
            add("local_ack_timeout_err", 0.2, hcas)
            add("out_of_sequence", 3.0, hcas)
            add("link_error_recovery", over(3.0), hcas)
            blk.port_tp[rows, :, :] *= (1.0 - 0.15 * inten)[None, None, :]
        elif m == "nvswitch":
            self._fabric_precursor(blk, ep, rows, inten)
        elif m == "scale_across":
            blk.tcp_retrans_ratio[rows, :] += 0.02 * inten
            blk.probe_rtt_add[rows, :] += 40.0 * inten
            blk.probe_loss[rows, :] = np.maximum(blk.probe_loss[rows, :], 0.3 * inten)
            add("TcpExt_TCPTimeouts", 0.5)
            add("TcpExt_TCPLostRetransmit", 0.2)

        # the link flaps of a degrading cable are link_state events too
        if m == "ib_cable" and "link_downed" in blk.deltas:
            for r in range(len(rows)):
                for t in np.flatnonzero(blk.deltas["link_downed"][rows[r], c, :]):
                    self._link_event(blk, int(rows[r]), c, int(t), "link flap: ACTIVE -> DOWN -> ACTIVE")

        if not ep.fails:
            return
        fail_idx = np.flatnonzero(failed)
        if fail_idx.size == 0:
            return
        first = fail_idx[0]
        # the failure fires in the first sample at or after it (every row of a block shares the clock)
        fires = bool(first > 0 or blk.prev0[rows[0]] < ep.end_ns)
        drain = (ts >= ep.end_ns + self.drain_ns) & (ts < ep.repair_ns)
        scope_node = mode.component not in ("switch", "site", "nvlink_domain")
        if scope_node:
            blk.in_service[rows, :] &= ~drain[None, :]

        def bump(counter: str, comp: int):
            arr = blk.deltas.setdefault(counter, np.zeros(
                (len(blk.nodes), self.topo.gpus_per_node if counter in GPU_COUNTERS else self.topo.hcas_per_node,
                 len(ts)), np.int64))
            if fires:
                arr[rows, comp, first] += 1

        if m in ("hbm", "hbm_abrupt", "sram", "sram_abrupt"):
            xid = {0: 48, 1: 95, 2: 64, 3: 94}[ep.variant % 4] if m == "hbm" else (
                48 if m == "hbm_abrupt" else (95 if ep.variant % 2 else 48))
            if xid == 64:
                blk.remap_failure[rows, c, :] |= failed[None, :]
            else:
                bump("ecc_uncorrected_volatile", c)
                bump("ecc_uncorrected_aggregate", c)
                if m.startswith("hbm"):
                    bump("remapped_rows_uncorrectable", c)
            if fires:
                for r in rows:
                    self._xid(blk, int(r), c, first, xid, ep.end_ns)
        elif m == "nvlink":
            blk.links_down[rows, c, :] += (failed * (2 + ep.variant % 4)).astype(np.int16)[None, :]
            if fires:
                for r in rows:
                    link = ep.variant % int(self.nvlinks[blk.nodes[r]])   # one of the node type's links
                    self._link_down_xid(blk, int(r), c, link, ep.end_ns)
        elif m in ("gpu_off_bus_pcie", "gpu_off_bus", "straggler", "thermal"):
            blk.gpu_lost[rows, c, :] |= failed[None, :]
            if fires:
                for r in rows:
                    self._xid(blk, int(r), c, first, 79, ep.end_ns)
                    blk.events.append(dict(self._event_base(blk, int(r), ep.end_ns), kind="gpu_lost",
                                           severity="fatal", gpu=c, pci_bus_id=self.topo.gpu_bus_id(c),
                                           message="NVML_ERROR_GPU_IS_LOST"))
        elif m == "gsp":
            if fires:
                for r in rows:
                    self._xid(blk, int(r), c, first, 119 if ep.variant % 2 else 120, ep.end_ns)
        elif m in ("ib_cable", "nic", "leaf_switch"):
            hcas = [c] if m != "leaf_switch" else list(range(self.topo.hcas_per_node))
            for h in hcas:
                blk.port_down[rows, h, :] |= failed[None, :]
                bump("link_downed", h)
                if fires:
                    for r in rows:
                        self._link_event(blk, int(r), h, first, "ACTIVE -> DOWN", ts_ns=ep.end_ns)
            if m == "nic" and fires:
                for r in rows:
                    self._nic_event(blk, int(r), c, first, "mlx5_core {bus}: poll_health:835: device's health "
                                    "compromised - reached miss count", ts_ns=ep.end_ns)
        elif m == "nvswitch":
            blk.links_down[rows, :, :] += (failed * NVSWITCHES_PER_TRAY).astype(np.int16)[None, None, :]
            health = self._fabric_health(blk)
            for column in ("fabric_access_timeout_recovery", "fabric_degraded_bw"):
                health[rows] = np.where(failed[None, None, :], fabric.with_unhealthy(health[rows], column), health[rows])
            if fires:
                link = ep.variant % (len(ep.nodes) * self.topo.gpus_per_node)
                code, lines = NVSWITCH_FATAL_SXID
                for r in rows:
                    for line in lines:
                        self._sxid(blk, int(r), ep.component, code, line.format(link=link), ep.end_ns)
                    for g in range(self.topo.gpus_per_node):
                        self._link_down_xid(blk, int(r), g, ep.component, ep.end_ns)
        elif m == "scale_across":
            blk.probe_loss[rows, :] = np.where(failed[None, :], 1.0, blk.probe_loss[rows, :])
        elif m == "nccl_hang":
            blk.hang[rows, :] |= failed[None, :]
        elif m == "software" and fires and ep.variant % 2 == 0:
            for r in rows:
                self._xid(blk, int(r), c, first, 43 if ep.variant % 4 else 13, ep.end_ns, pid=True)

        # back in service: rebooted (volatile counters reset), the failed part replaced
        back = np.flatnonzero(ts >= ep.repair_ns)
        if scope_node and back.size and (back[0] > 0 or blk.prev0[rows[0]] < ep.repair_ns):
            replaced = c if mode.component == "gpu" else None
            for r in rows:
                blk.resets.append((int(r), int(back[0]), replaced))

    def _fabric_health(self, blk: Block) -> np.ndarray:
        """The block's fabric health masks (B, G, T), healthy until an episode changes them."""
        if blk.fabric_health is None:
            blk.fabric_health = np.full((len(blk.nodes), self.topo.gpus_per_node, len(blk.ts)), fabric.HEALTHY_MASK,
                                        np.int64)
        return blk.fabric_health

    def _fabric_precursor(self, blk: Block, ep: Episode, rows: np.ndarray, inten: np.ndarray) -> None:
        """An NVLink-fabric episode before its end: the switch's non-fatal SXids on every node of the domain;
        for a failure also the GPUs' health mask (access-timeout recovery, then degraded bandwidth) and
        their NVLink throughput. A look-alike shows its few SXids only."""
        times, links, codes = self._sxid_draws(ep)
        g = self.topo.gpus_per_node
        gpu_end = self.topo.gpu_generation in xidcat.BLACKWELL
        for r in rows:
            lo = int(blk.prev0[r])
            at = list(ep.nodes).index(int(blk.nodes[r]))
            for i in np.flatnonzero((times > lo) & (times <= blk.ts[-1])):
                code, text = NVSWITCH_NONFATAL_SXIDS[codes[i]]
                self._sxid(blk, int(r), ep.component, code, text.format(link=int(links[i])), int(times[i]))
                if gpu_end and links[i] // g == at:
                    xid, xid_text = LINK_ERROR_XID
                    self._xid(blk, int(r), int(links[i] % g), 0, xid, int(times[i]),
                              text=xid_text.format(link=ep.component))
        if not ep.fails:
            return
        blk.gpu_tp[rows, :, :] *= (1.0 - FABRIC_TP_LOSS * inten)[None, None, :]
        health = self._fabric_health(blk)
        for column, at in (("fabric_access_timeout_recovery", FABRIC_TIMEOUT_RECOVERY_AT),
                           ("fabric_degraded_bw", FABRIC_DEGRADED_BW_AT)):
            on = (inten >= at)[None, None, :]
            health[rows] = np.where(on, fabric.with_unhealthy(health[rows], column), health[rows])

    def _sxid_draws(self, ep: Episode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(times ns, links, indices into NVSWITCH_NONFATAL_SXIDS) of an NVLink-fabric episode's non-fatal
        SXids, drawn once from the episode's own stream, in proportion to its intensity: every node of the
        domain logs the same lines, whichever block or process computes it."""
        drawn = self._sxids.get(ep.episode_id)
        if drawn is None:
            rng = np.random.default_rng(np.random.SeedSequence([ep.seed & ((1 << 63) - 1), 0x5C1D]))
            cell_ns = max(ep.end_ns - ep.start_ns, 1) / FABRIC_SXID_GRID
            grid = ep.start_ns + ((np.arange(FABRIC_SXID_GRID) + 0.5) * cell_ns).astype(np.int64)
            weight = self._intensity(ep, grid)[2]
            total = weight.sum()
            mean = FABRIC_PRECURSOR_SXIDS * ep.peak / np.sqrt(self.difficulty) if ep.fails else FABRIC_LOOKALIKE_SXIDS
            n = int(rng.poisson(mean)) if total > 0 else 0
            cells = rng.choice(FABRIC_SXID_GRID, size=n, p=weight / total) if n else np.zeros(0, np.int64)
            times = np.minimum(grid[cells] + ((rng.random(n) - 0.5) * cell_ns).astype(np.int64), ep.end_ns - 1)
            links = rng.integers(len(ep.nodes) * self.topo.gpus_per_node, size=n)
            codes = rng.integers(len(NVSWITCH_NONFATAL_SXIDS), size=n)
            order = np.argsort(times, kind="stable")
            drawn = self._sxids[ep.episode_id] = (times[order], links[order], codes[order])
        return drawn

    # -- events ------------------------------------------------------------------------------------
    def _sxid(self, blk: Block, r: int, switch: int, code: int, text: str, ts_ns: int) -> None:
        """An SXid line of the domain's NVSwitch, as the kmsg collector writes it (collectors/sxid.py)."""
        line = f"nvidia-{self.topo.nvswitch_device(switch)}: SXid (PCI:{self.topo.nvswitch_bus_id(switch)}): {code:05d}, {text}"
        blk.events.append(dict(self._event_base(blk, r, ts_ns), **parse_sxid(line)))

    def _event_base(self, blk: Block, r: int, ts_ns: int) -> dict:
        return {"ts": int(ts_ns), "node": self.topo.names[int(blk.nodes[r])], "source": "simulator"}

    def _xid92_state(self, nodes: np.ndarray, ts: np.ndarray, prev0: np.ndarray, ce: np.ndarray,
                     dt: np.ndarray) -> np.ndarray:
        """Whether each GPU's corrected-ECC rate is past the Xid 92 rate at each sample (B, G, T): judged
        at the first sample after each XID92_WINDOW_S boundary, over the window's samples, and held in
        between. At a 60 s interval every sample is such a sample."""
        rate = self._ce_rate_over_window(nodes, ce, dt)
        w = int(XID92_WINDOW_S * NS)
        prev = np.concatenate([prev0[:, None], np.broadcast_to(ts[None, :-1], (len(prev0), len(ts) - 1))], axis=1)
        judged = (ts[None, :] // w) != (prev // w)                                   # (B, T)
        at = np.maximum.accumulate(np.where(judged, np.arange(len(ts))[None, :], -1), axis=1)
        hot = np.take_along_axis(rate > XID92_RATE_PER_S, np.maximum(at, 0)[:, None, :], axis=2)
        return np.where((at < 0)[:, None, :], self.ce_hot[nodes][:, :, None], hot)

    def _ce_rate_over_window(self, nodes: np.ndarray, ce: np.ndarray, dt: np.ndarray) -> np.ndarray:
        """Corrected ECC per second at each sample (B, G, T) over the last `xid92_samples` samples (the
        Xid 92 window), the ones before the block taken from the carried window."""
        k = self.xid92_samples
        if k == 1:
            return ce / np.maximum(dt[:, None, :], 1e-9)
        ce_ext = np.concatenate([self.ce_window[nodes], ce.astype(np.int64)], axis=2)
        dt_ext = np.concatenate([self.dt_window[nodes], dt], axis=1)
        self.ce_window[nodes] = ce_ext[:, :, -(k - 1):]
        self.dt_window[nodes] = dt_ext[:, -(k - 1):]
        cs = np.concatenate([np.zeros(ce_ext.shape[:2] + (1,), np.int64), np.cumsum(ce_ext, axis=2)], axis=2)
        ds = np.concatenate([np.zeros((dt_ext.shape[0], 1)), np.cumsum(dt_ext, axis=1)], axis=1)
        T = ce.shape[2]
        counts = cs[:, :, k:k + T] - cs[:, :, :T]
        spans = ds[:, k:k + T] - ds[:, :T]
        return counts / np.maximum(spans[:, None, :], 1e-9)

    def _xid(self, blk: Block, r: int, gpu: int, t: int, xid: int, ts_ns: int | None = None, pid: bool = False,
             text: str | None = None):
        """An Xid row of a GPU as the kmsg collector reads the driver's line (collectors/kmsg.py): its
        message is the text after the pid and name, the catalogue's example, or `text` (an NVLink5 line
        names no process, and its class is its text's Fatal/Nonfatal token)."""
        ts_ns = int(blk.ts[t]) if ts_ns is None else int(ts_ns)
        text = xidcat.lookup(xid).example if text is None else text
        blk.events.append(dict(self._event_base(blk, r, ts_ns), kind="xid", severity=xidcat.severity(xid, text),
                               xid=xid, gpu=gpu, pci_bus_id=self.topo.gpu_bus_id(gpu),
                               pid=(4000 + 97 * r + gpu) if pid else None,
                               process_name="python3" if pid else None, message=text))

    def _link_down_xid(self, blk: Block, r: int, gpu: int, link: int, ts_ns: int) -> None:
        """The Xid of a GPU whose NVLink `link` was taken down, in its generation's words (LINK_DOWN_XIDS)."""
        xid, text = LINK_DOWN_XIDS[self.topo.gpu_generation]
        self._xid(blk, r, gpu, 0, xid, ts_ns, text=None if text is None else text.format(link=link))

    def _link_event(self, blk, r, hca, t, what, ts_ns=None):
        dev = self.topo.hca_device(hca)
        blk.events.append(dict(self._event_base(blk, r, int(blk.ts[t]) if ts_ns is None else ts_ns),
                               kind="link_state", severity="info" if "flap" in what else "fatal",
                               device=dev, port=1, message=f"{dev} port 1: {what}"))

    def _nic_event(self, blk, r, hca, t, text, ts_ns=None):
        dev = self.topo.hca_device(hca)
        from foreshock.simulator.topology import HCA_BUS_IDS
        bus = HCA_BUS_IDS[hca % len(HCA_BUS_IDS)]
        blk.events.append(dict(self._event_base(blk, r, int(blk.ts[t]) if ts_ns is None else ts_ns),
                               kind="nic_error", severity="precursor" if ts_ns is None else "fatal",
                               device=dev, port=1, pci_bus_id=bus, message=text.format(bus=bus)))

    # -- traffic -----------------------------------------------------------------------------------
    def _step_rhythm(self, jobs: np.ndarray, blk: Block) -> np.ndarray:
        """(B, T) fabric traffic in each interval relative to its mean: a training step computes, then
        all-reduces in a burst over its second half (at 80% of a 400G line rate). Step periods divide 60 s, so a minute (or any multiple
        of the period) averages exactly to 1 and only second-scale sampling (live mode) sees the bursts.
        Integer milliseconds keep the average exact."""
        period = _col(self._step_period_ms(jobs))  # (B, 1) or (B, T)
        burst = period // 2

        def comm_ms(t_ms):  # burst milliseconds from the epoch to t
            return (t_ms // period) * burst + np.clip(t_ms % period - (period - burst), 0, burst)

        t1 = np.broadcast_to(blk.ts // 1_000_000, blk.dt.shape)
        t0 = np.concatenate([blk.prev0[:, None] // 1_000_000, t1[:, :-1]], axis=1)
        span = np.maximum(t1 - t0, 1)
        factor = (comm_ms(t1) - comm_ms(t0)) * period / (span * burst)
        return np.where(_col(jobs < 0), 1.0, factor)

    def _step_period_ms(self, jobs: np.ndarray) -> np.ndarray:
        """Each job run's step period (ms), the shape of `jobs`."""
        periods = np.array(STEP_PERIODS_MS, dtype=np.int64)
        return periods[(np.maximum(jobs, 0) * 7 + self.seed) % len(periods)]

    def _step_times(self, blk: Block, act: np.ndarray, stepping: np.ndarray) -> pa.Table:
        """The step_times rows: per node of a running job and sample time, its rank's step that ends then
        (docs/simulator.md, "Step times"). Counter-based hashes only: no stream of the block is drawn.

        The step takes its period at load STEP_LOAD_REF, longer at a lower load; its compute part is
        STEP_COMPUTE_SHARE of it over the rank's own pace (compute_tp: a straggler, a job_slow culprit),
        and the all-reduce ends when the job's slowest rank is in: the job's pace (step_pace, a job_slow
        slowdown) sets it for every rank, and a rank slower than that (a straggler) ends later itself."""
        nodes, ts = blk.nodes, blk.ts
        B, T = blk.dt.shape
        jobs = np.broadcast_to(_col(blk.jobs), (B, T))
        stepping = stepping & (jobs >= 0) & (act >= STEP_MIN_LOAD)
        period_ms = self._step_period_ms(jobs)
        epoch_h = float(self.world.scalar("job_epoch_h"))
        run_start = (ts // int(epoch_h * 3600 * NS)) * int(epoch_h * 3600 * NS) if epoch_h > 0 else np.zeros_like(ts)
        step = (ts - run_start)[None, :] // (period_ms * 1_000_000)
        salt = int(_key(self.seed, "step-times"))
        with np.errstate(over="ignore"):
            sec = (ts // NS).astype(np.uint64)[None, :]
            u_job = _splitmix((jobs.astype(np.int64) + 1).astype(np.uint64) * np.uint64(0x100000001B3) ^ sec
                              ^ np.uint64(salt))
            u_rank = _splitmix(nodes.astype(np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15) ^ sec
                               ^ np.uint64((salt + 1) % (1 << 64)))
        whole = period_ms / 1000.0 * STEP_LOAD_REF / np.maximum(act, STEP_MIN_LOAD) \
            * (1.0 + STEP_JOB_JITTER * (2.0 * u_job - 1.0))
        own = STEP_COMPUTE_SHARE * whole
        compute = own * (1.0 + STEP_RANK_JITTER * (2.0 * u_rank - 1.0)) / blk.compute_tp
        slowest_peer = own * (1.0 + STEP_RANK_JITTER) / blk.step_pace
        total = np.maximum(compute, slowest_peer) + (whole - own)
        places = job_places(self.topo, self.world, self.seed, nodes, ts)
        rank = np.broadcast_to(_col(self.rank_in_job[places]), (B, T))
        b, t = np.nonzero(stepping)   # node by node, as the writer slices tables
        churn = epoch_h > 0
        n_slots = max(self.topo.n_jobs, 1)
        runs = jobs[b, t]
        names = {int(r): job_name(int(r), n_slots, churn) for r in np.unique(runs).tolist()}
        return pa.Table.from_arrays([
            pa.array(ts[t]).cast(sch.TS),
            pa.array(np.array(self.topo.names, dtype=object)[nodes[b]], sch.STR),
            pa.array([names[int(r)] for r in runs], sch.STR),
            pa.nulls(len(b), sch.I64),
            pa.array(rank[b, t].astype(np.int32)),
            pa.array(step[b, t].astype(np.int64)),
            pa.array(total[b, t].astype(np.float64)),
            pa.array(compute[b, t].astype(np.float64)),
        ], schema=sch.schema("step_times"))

    def _traffic(self, blk, act, cong, ckpt, tp, z_gpu, z_hca, z_node):
        d, dt = blk.deltas, blk.dt
        B, T = dt.shape
        a = (act * tp * self._step_rhythm(blk.jobs, blk))[:, None, :]
        gpu_live = ~blk.gpu_lost
        # Volumes follow the job's step rate; the per-device jitter is small control traffic.
        nvl = NVLINK_KIB_PER_S * a * blk.gpu_tp * dt[:, None, :]
        links = self.nvlinks[blk.nodes]
        if (links != NVLINKS_PER_GPU).any():  # fewer links carry proportionally less
            nvl = nvl * (links / NVLINKS_PER_GPU)[:, None, None]
        nvl = nvl.astype(np.int64)
        d["tx_kib"] = (nvl + (np.abs(z_gpu[2]) * 30).astype(np.int64)) * gpu_live
        d["rx_kib"] = (nvl + (np.abs(z_gpu[3]) * 30).astype(np.int64)) * gpu_live
        live = ~blk.port_down
        words = (HCA_BYTES_PER_S / 4 * a * blk.port_tp * dt[:, None, :]).astype(np.int64)
        xmit_b = (words + (np.abs(z_hca[0]) * 250).astype(np.int64)) * 4 * live
        rcv_b = (words + (np.abs(z_hca[1]) * 250).astype(np.int64)) * 4 * live
        d["port_xmit_bytes"], d["port_rcv_bytes"] = xmit_b, rcv_b
        xp, rp = xmit_b // MTU + 30 * live, rcv_b // MTU + 30 * live
        d["port_xmit_packets"], d["port_rcv_packets"] = xp, rp
        mc = (dt[:, None, :] * 0.5 * live).astype(np.int64)
        d["multicast_xmit_packets"], d["multicast_rcv_packets"] = mc, mc
        d["unicast_xmit_packets"], d["unicast_rcv_packets"] = xp - mc, rp - mc
        c3 = (cong[:, None, :] * dt[:, None, :]) * live
        d["port_xmit_wait"] = d.get("port_xmit_wait", 0) + (c3 * XMIT_WAIT_TICKS_PER_S).astype(np.int64)
        # Congestion sheds a few packets out of order even on healthy links.
        d["out_of_sequence"] = d.get("out_of_sequence", 0) + (c3 * 0.05).astype(np.int64)
        d["rx_write_requests"] = (rp * 0.9).astype(np.int64)
        d["rx_read_requests"] = (rp * 0.02).astype(np.int64)
        d["roce_adp_retrans"] = d.get("roce_adp_retrans", 0) + (c3 * 0.01).astype(np.int64)
        if self.topo.link_layer == "Ethernet":
            d["np_ecn_marked_roce_packets"] = (c3 * 4000.0).astype(np.int64)
            d["np_cnp_sent"] = (c3 * 3000.0).astype(np.int64)
            d["rp_cnp_handled"] = (c3 * 3000.0 * (1.0 + 0.01 * z_hca[1])).astype(np.int64)
            d["rp_cnp_ignored"] = (c3 * 2.0).astype(np.int64)
        # Front-end Ethernet and TCP: data loading, checkpoints (act dips are checkpoint writes).
        eth = (ETH_BYTES_PER_S * dt * (1.0 + 20.0 * ckpt) + 2e3 * np.abs(z_node[0]))[:, None, :]
        rx = (eth * 0.7).astype(np.int64)
        tx = eth.astype(np.int64)
        d["rx_bytes"], d["tx_bytes"] = rx, tx
        d["rx_packets"], d["tx_packets"] = rx // 1400, tx // 1400
        d["multicast"] = (dt * 0.1).astype(np.int64)[:, None, :]
        out = tx // 1400
        d["Tcp_OutSegs"], d["Tcp_InSegs"] = out, rx // 1400
        retr = out * (2e-5 * (1.0 + 0.3 * np.abs(z_node[1]))[:, None, :] + blk.tcp_retrans_ratio[:, None, :])
        d["Tcp_RetransSegs"] = retr.astype(np.int64)
        d["TcpExt_TCPLossProbes"] = (retr * 0.3).astype(np.int64)
        d["TcpExt_TCPFastRetrans"] = (retr * 0.5).astype(np.int64)
        d["TcpExt_TCPSlowStartRetrans"] = (retr * 0.05).astype(np.int64)

    # -- counters to tables -------------------------------------------------------------------------
    def _accumulate(self, blk: Block, kind: str, names) -> dict[str, np.ndarray]:
        """True cumulative values (B, C, T) of the counters, with the resets of this block applied."""
        state = self.state[kind]
        out = {}
        nodes = blk.nodes
        for name in names:
            st = state[name][nodes]  # (B, C)
            delta = blk.deltas.get(name)
            if delta is None:
                cum = np.broadcast_to(st[:, :, None], st.shape + (len(blk.ts),)).copy()
            else:
                delta = np.broadcast_to(delta, st.shape + (len(blk.ts),))
                cum = st[:, :, None] + np.cumsum(delta, axis=2)
            for r, t, replaced in blk.resets:
                if replaced == PMA_CLEAR:
                    if kind == "hca" and name in PMA_ERROR_COUNTERS:
                        base = cum[r, :, t - 1] if t > 0 else st[r, :]
                        cum[r, :, t:] -= base[:, None]
                    continue
                if kind == "gpu" and name in GPU_LIFETIME:
                    if replaced is None:
                        continue
                    base = cum[r, replaced, t - 1] if t > 0 else st[r, replaced]
                    cum[r, replaced, t:] -= base
                    continue
                base = cum[r, :, t - 1] if t > 0 else st[r, :]
                cum[r, :, t:] -= base[:, None]
            state[name][nodes] = cum[:, :, -1]
            out[name] = cum
        return out

    def _render(self, blk: Block, act, tp, z_gpu, z_node, app_xids) -> dict[str, pa.Table]:
        topo = self.topo
        nodes, ts, dt = blk.nodes, blk.ts, blk.dt
        B, T, G, H = len(nodes), len(ts), topo.gpus_per_node, topo.hcas_per_node
        d = blk.deltas
        # aggregate ECC moves with volatile
        d["ecc_corrected_aggregate"] = d.get("ecc_corrected_volatile", 0)
        blk.resets.sort(key=lambda x: x[1])
        reboots = [x for x in blk.resets if x[2] != PMA_CLEAR]
        for r, t, replaced in reboots:
            # replacement GPUs get new identities; reboots clear pending remaps and volatile flags
            if replaced is not None:
                self.generation[nodes[r], replaced] += 1
                self.remap_failed[nodes[r], replaced] = False
            self.remap_pending[nodes[r], :] = False
        gpu_c = self._accumulate(blk, "gpu", GPU_COUNTERS)
        hca_c = self._accumulate(blk, "hca", HCA_COUNTERS)
        node_c = self._accumulate(blk, "node", NODE_COUNTERS)

        # analog GPU values
        a = (act * tp)[:, None, :] * np.ones((1, G, 1))
        hang = blk.hang[:, None, :]
        util = np.where(hang, 100.0, np.clip(100.0 * a + 1.5 * z_gpu[0], 0, 100))
        power = IDLE_W + (TDP_W - IDLE_W - 30.0) * a + self.gpu_power_offset[nodes][:, :, None] * (a > 0.1) + 6.0 * z_gpu[1]
        power = np.where(hang, IDLE_W + 150.0, power)
        temp = 31.0 + 40.0 * a + self.gpu_temp_offset[nodes][:, :, None] + 0.6 * z_gpu[0] + blk.temp_add
        amp = self.site_temp_amp[nodes]
        if amp.any():  # the room follows the day: warmest at 15:00 UTC
            hour = (ts / NS / 3600.0) % 24.0
            temp = temp + (amp[:, None] * np.sin(2 * np.pi * (hour - 9.0) / 24.0)[None, :])[:, None, :]
        hbm_t = temp + 4.0 + 0.4 * z_gpu[1] + 0.3 * blk.temp_add + blk.hbm_add
        bits = np.where(a < 0.05, np.uint64(0x1), np.uint64(0)) | blk.clock_bits
        bits = bits | np.where(power > TDP_W - 15, np.uint64(0x4), np.uint64(0))
        bits = bits | np.where(temp > 87.0, np.uint64(0x20), np.uint64(0)) | np.where(temp > 92.0, np.uint64(0x40), np.uint64(0))
        sm = np.where(a < 0.05, SM_IDLE_MHZ, SM_CLOCK_MHZ - 30.0 * np.maximum(temp - 87.0, 0) - 200.0 * ((blk.clock_bits & np.uint64(0x8)) > 0))
        sm = (np.round(sm / 15.0) * 15).astype(np.int32)
        power = np.round(np.maximum(power, 40.0))
        lost = blk.gpu_lost
        energy = self.energy[nodes][:, :, None] + np.cumsum(np.where(lost, 0.0, power) * dt[:, None, :], axis=2)
        for r, t, _ in reboots:
            base = energy[r, :, t - 1] if t > 0 else self.energy[nodes[r]]
            energy[r, :, t:] -= base[:, None]
        self.energy[nodes] = energy[:, :, -1]

        # Derived driver events: a new remapped row is Xid 63 (and a pending remap); a jump in the
        # corrected-ECC rate over the driver's window past XID92_RATE_PER_S is Xid 92 (on its rising edge).
        remap = gpu_c["remapped_rows_correctable"]
        dremap = np.broadcast_to(d.get("remapped_rows_correctable", 0), (B, G, T))
        pending = np.logical_or.accumulate(np.concatenate(
            [self.remap_pending[nodes][:, :, None], dremap > 0], axis=2), axis=2)[:, :, 1:]
        for r, t, _ in reboots:
            pending[r, :, t:] = np.logical_or.accumulate(dremap[r, :, t:] > 0, axis=1)
        self.remap_pending[nodes] = pending[:, :, -1]
        for r, g, t in zip(*np.nonzero(dremap > 0)):
            self._xid(blk, int(r), int(g), int(t), 63)
        # a block without corrected ECC still moves the driver's window on: its samples count as zero
        ce = blk.deltas.get("ecc_corrected_volatile")
        if ce is None:
            ce = np.zeros((B, G, T), np.int64)
        hot = self._xid92_state(nodes, ts, blk.prev0, ce, dt)
        edge = hot & ~np.concatenate([self.ce_hot[nodes][:, :, None], hot[:, :, :-1]], axis=2)
        self.ce_hot[nodes] = hot[:, :, -1]
        for r, g, t in zip(*np.nonzero(edge)):
            self._xid(blk, int(r), int(g), int(t), 92)
        failure = self.remap_failed[nodes][:, :, None] | blk.remap_failure
        self.remap_failed[nodes] = failure[:, :, -1]
        for r, t, g, x in app_xids:
            if blk.in_service[r, t] and not blk.gpu_lost[r, g, t]:
                self._xid(blk, r, g, t, int(x), pid=True)

        out = {}
        keep_gpu = np.broadcast_to(blk.in_service[:, None, :], (B, G, T))
        keep_hca = np.broadcast_to(blk.in_service[:, None, :], (B, H, T))
        if self.short_nodes:  # a smaller node type: the absent components' rows are dropped
            keep_gpu = keep_gpu & (np.arange(G)[None, :] < self.n_gpus[nodes][:, None])[:, :, None]
            keep_hca = keep_hca & (np.arange(H)[None, :] < self.n_hcas[nodes][:, None])[:, :, None]
        row_ts = ts if blk.row_ts is None else blk.row_ts
        gen_max = np.broadcast_to(self.pcie_gen[nodes][:, None, None], (B, G, T))
        idle_gen = self.idle_downtrain[nodes][:, None, None] & (a < 0.05)
        pcie_gen = np.where(idle_gen, np.int8(1), gen_max).astype(np.int8) if idle_gen.any() else gen_max
        nvlinks = self.nvlinks[nodes][:, None, None]
        gcols = {
            "gpu": np.broadcast_to(np.arange(G, dtype=np.int16)[None, :, None], (B, G, T)),
            "uuid": self._uuids(nodes),
            "pci_bus_id": pa.array([topo.gpu_bus_id(g) for g in range(G)], sch.STR),
            "temperature_c": (np.round(temp).astype(np.float32), lost),
            "hbm_temperature_c": (np.round(hbm_t).astype(np.float32), lost),
            "power_w": (power, lost),
            "energy_j": (np.round(energy * 1000.0) / 1000.0, lost),
            "sm_clock_mhz": (sm, lost),
            "mem_clock_mhz": (np.full((B, G, T), MEM_CLOCK_MHZ, np.int32), lost),
            "utilization_pct": (np.round(util).astype(np.float32), lost),
            "clock_event_reasons": (bits, lost),
            "ecc_corrected_volatile": (gpu_c["ecc_corrected_volatile"], lost),
            "ecc_uncorrected_volatile": (gpu_c["ecc_uncorrected_volatile"], lost),
            "ecc_corrected_aggregate": (gpu_c["ecc_corrected_aggregate"], lost),
            "ecc_uncorrected_aggregate": (gpu_c["ecc_uncorrected_aggregate"], lost),
            "remapped_rows_correctable": (remap, lost),
            "remapped_rows_uncorrectable": (gpu_c["remapped_rows_uncorrectable"], lost),
            "remapped_rows_pending": (pending, lost),
            "remapped_rows_failure": (failure, lost),
            "pcie_replay_counter": (gpu_c["pcie_replay_counter"], lost),
            "pcie_link_gen": (pcie_gen, lost),
            "pcie_link_gen_max": (gen_max, lost),
            "pcie_link_width": (blk.pcie_width, lost),
            "pcie_link_width_max": (np.full((B, G, T), PCIE_WIDTH, np.int8), lost),
            "gpu_lost": lost,
        }
        gcols.update(self._fabric_columns(nodes, (B, G, T), lost, blk.fabric_health))
        out["gpu"] = self._table("gpu", nodes, row_ts, G, gcols, keep_gpu)
        links_up = np.maximum(nvlinks - blk.links_down, 0).astype(np.int16)
        ncols = {
            "gpu": gcols["gpu"],
            "replay_errors": (gpu_c["replay_errors"], lost),
            "recovery_errors": (gpu_c["recovery_errors"], lost),
            "crc_flit_errors": (gpu_c["crc_flit_errors"], lost),
            "crc_data_errors": (gpu_c["crc_data_errors"], lost),
            "tx_kib": (gpu_c["tx_kib"], lost),
            "rx_kib": (gpu_c["rx_kib"], lost),
            "links_up": (links_up, lost),
            "links_total": (np.broadcast_to(nvlinks, (B, G, T)).astype(np.int16), lost),
        }
        out["nvlink"] = self._table("nvlink", nodes, row_ts, G, ncols, keep_gpu)

        down = blk.port_down
        rcols = {
            "device": pa.array([topo.hca_device(h) for h in range(H)], sch.STR),
            "port": np.ones((B, H, T), np.int16),
            "state": np.where(down, 1, 4).astype(np.int8),
            "phys_state": np.where(down, 2, 5).astype(np.int8),
            "rate_gbps": np.full((B, H, T), RATE_GBPS),
            "link_layer": pa.array([topo.link_layer] * H, sch.STR),
        }
        for name, width in sch.IB_PORT_COUNTERS.items():
            v = hca_c[name]
            if width < 32:
                v = np.minimum(v, (1 << width) - 1)       # narrow IB error counters stick at the top
            elif width == 32:
                v = v & 0xFFFFFFFF                          # port_xmit_wait wraps
            rcols[name] = v
        for name in MLX5_PRESENT + (MLX5_ROCE_ONLY if topo.link_layer == "Ethernet" else ()):
            rcols[name] = np.full((B, H, T), 10, np.int64) if name == "lifespan" else hca_c[name] & 0xFFFFFFFF
        out["rdma_port"] = self._table("rdma_port", nodes, row_ts, H, rcols, keep_hca)

        keep_node = blk.in_service[:, None, :]
        one = (B, 1, T)
        ecols = {
            "iface": pa.array(["eth0"], sch.STR),
            "operstate": pa.array(["up"], sch.STR),
            "carrier": np.ones(one, bool),
            "speed_mbps": np.full(one, 100000, np.int64),
            "mtu": np.full(one, 9000, np.int32),
        }
        for name in NETDEV_COUNTERS:
            ecols[name] = node_c[name]
        out["netdev"] = self._table("netdev", nodes, row_ts, 1, ecols, keep_node)
        hcols = {name: node_c[name] for name in HOST_COUNTERS}
        hcols["Tcp_CurrEstab"] = (40 + 3 * np.abs(z_node[2])).astype(np.int64)[:, None, :]
        out["host_net"] = self._table("host_net", nodes, row_ts, 1, hcols, keep_node)

        if topo.sites > 1:
            out["path_probe"] = self._probes(blk, z_node, row_ts)
        events = self._present(blk.events) if self.short_nodes else blk.events
        out["events"] = sch.to_table("events", sorted(events, key=lambda e: (e["node"], e["ts"]))) \
            if events else sch.schema("events").empty_table()
        return out

    def _present(self, events: list) -> list:
        """The events of components the node type has (the physics runs on the largest type)."""
        index = {name: i for i, name in enumerate(self.topo.names)}
        out = []
        for e in events:
            n = index[e["node"]]
            if e.get("gpu") is not None and e["gpu"] >= self.n_gpus[n]:
                continue
            dev = e.get("device")
            if dev and dev.startswith("mlx5_") and int(dev[5:]) >= self.n_hcas[n]:
                continue
            out.append(e)
        return out

    def _probes(self, blk, z_node, row_ts):
        topo = self.topo
        nodes, ts = blk.nodes, blk.ts
        B, T = len(nodes), len(ts)
        sites = topo.site_of[nodes]
        peers = [s for s in range(topo.sites)]
        P = topo.sites - 1
        peer_idx = np.array([[p for p in peers if p != s] for s in sites])  # (B, P)
        sent = 5
        loss = np.clip(blk.probe_loss + 0.002 * np.abs(z_node[3]), 0, 1)
        recv = np.round(sent * (1.0 - loss)).astype(np.int32)
        rtt = 18.0 + 1.5 * np.abs(z_node[3]) + blk.probe_rtt_add
        peer_names = np.array([f"probe.{topo.site_name(s)}:7443" for s in range(topo.sites)], dtype=object)
        rows = B * P * T
        keep = np.broadcast_to(blk.in_service[:, None, :], (B, P, T)).reshape(-1)
        recv3 = np.broadcast_to(recv[:, None, :], (B, P, T)).reshape(-1)
        cols = {
            "ts": pa.array(np.broadcast_to(row_ts if row_ts.ndim == 1 else row_ts[:, None, :], (B, P, T))
                           .reshape(-1)).cast(sch.TS),
            "node": pa.array(np.repeat(np.array(topo.names, dtype=object)[nodes], P * T), sch.STR),
            "peer": pa.array(np.repeat(peer_names[peer_idx].reshape(-1), T), sch.STR),
            "peer_site": pa.array(np.repeat(np.array([topo.site_name(s) for s in range(topo.sites)],
                                                     dtype=object)[peer_idx].reshape(-1), T), sch.STR),
            "sent": pa.array(np.full(rows, sent, np.int32)),
            "received": pa.array(recv3),
            "loss_ratio": pa.array(1.0 - recv3 / sent),
            "rtt_ms": pa.array(np.broadcast_to(np.round(rtt, 3)[:, None, :], (B, P, T)).reshape(-1), mask=recv3 == 0),
        }
        table = pa.Table.from_pydict(cols, schema=sch.schema("path_probe"))
        return table if keep.all() else table.filter(pa.array(keep))

    def _fabric_columns(self, nodes, shape: tuple, lost: np.ndarray, health: np.ndarray | None = None) -> dict:
        """The gpu table's fabric columns: registered in a multi-node NVLink domain, healthy unless an
        episode set `health` (the masks per GPU and sample), null (no fabric information) where NVLink
        stays inside the node."""
        domain = self.topo.nvlink_domain_of[nodes]
        if (domain < 0).all():
            return {}
        none = np.broadcast_to((domain < 0)[:, None, None], shape) | lost
        G = shape[1]
        cluster = [self.topo.fabric_cluster(int(d)) if d >= 0 else (None, None) for d in domain]
        info = fabric.FabricInfo(bytes(16), 0, 0, fabric.STATE_COMPLETED, fabric.HEALTHY_MASK, 1)
        clique = np.array([c or 0 for _, c in cluster], dtype=np.uint32)[:, None, None]
        cols: dict = {"fabric_cluster_uuid": [[u] * G for u, _ in cluster],
                      "nvlink_domain": [[fabric.nvlink_domain(u, c)] * G for u, c in cluster],
                      "fabric_clique_id": (np.broadcast_to(clique, shape), none)}
        if health is None:
            for name, value in fabric.gpu_columns(info).items():
                if name not in cols and value is not None:
                    cols[name] = (np.broadcast_to(np.asarray(value), shape), none)
            return cols
        masks, index = np.unique(health, return_inverse=True)
        # Assumption (nvml.h names the summaries, not when each is given): a GPU whose mask shows a
        # condition but that still reaches its domain has limited capacity.
        summary = {v: k for k, v in fabric.HEALTH_SUMMARIES.items()}
        each = [fabric.gpu_columns(fabric.FabricInfo(
            bytes(16), 0, 0, fabric.STATE_COMPLETED, int(m),
            summary["healthy" if m == fabric.HEALTHY_MASK else "limited capacity"])) for m in masks]
        for name, value in each[0].items():
            if name not in cols and value is not None:
                cols[name] = (np.array([e[name] for e in each])[index.reshape(shape)], none)
        return cols

    def _uuids(self, nodes):
        G = self.topo.gpus_per_node
        gen = self.generation[nodes]
        return [[f"GPU-{_uuid(self.seed, int(n), g, int(gen[i, g]))}" for g in range(G)] for i, n in enumerate(nodes)]

    def _table(self, table: str, nodes, ts, C: int, cols: dict, keep) -> pa.Table:
        """Rows ordered (node, component, time): one node's rows are contiguous, and within a
        component the counters run in time order, which is what delta encoding compresses best.
        Rows not kept are dropped from the numpy arrays, before any string is made."""
        B, T = len(nodes), ts.shape[-1]
        sel = None if keep.all() else np.ascontiguousarray(_flat(keep, (B, C, T)))
        n = B * C * T if sel is None else int(sel.sum())

        def pick(a: np.ndarray) -> np.ndarray:
            return a if sel is None else a[sel]

        schema = sch.schema(table)
        arrays = []
        for field in schema:
            name = field.name
            if name == "ts":
                ts3 = ts if ts.ndim == 1 else ts[:, None, :]  # (T,) or per node (B, T) when jittered
                arrays.append(pa.array(pick(np.broadcast_to(ts3, (B, C, T)).reshape(-1))).cast(sch.TS))
            elif name == "node":
                idx = pick(np.repeat(np.arange(B, dtype=np.int32), C * T))
                dic = pa.array([self.topo.names[int(x)] for x in nodes], sch.STR)
                arrays.append(pa.DictionaryArray.from_arrays(pa.array(idx), dic).cast(sch.STR))
            elif name not in cols:
                arrays.append(pa.nulls(n, field.type))
            else:
                v = cols[name]
                if isinstance(v, pa.Array):  # one value per component
                    idx = pick(np.tile(np.repeat(np.arange(C, dtype=np.int32), T), B))
                    arrays.append(pa.DictionaryArray.from_arrays(pa.array(idx), v).cast(field.type))
                    continue
                if isinstance(v, list):      # one value per (node, component)
                    flat = pa.array([x for row in v for x in row], sch.STR)
                    idx = pick(np.repeat(np.arange(B * C, dtype=np.int32), T))
                    arrays.append(pa.DictionaryArray.from_arrays(pa.array(idx), flat).cast(field.type))
                    continue
                mask = None
                if isinstance(v, tuple):
                    v, mask = v
                    if not mask.any():
                        mask = None
                    else:
                        mask = pick(_flat(mask, (B, C, T)))
                        if not mask.any():
                            mask = None
                v = pick(_flat(v, (B, C, T)))
                np_type = np.dtype(field.type.to_pandas_dtype())
                if v.dtype != np_type:
                    if v.dtype.kind in "iu" and np_type.kind in "iu" and v.dtype.itemsize == np_type.itemsize \
                            and v.flags.c_contiguous:
                        v = v.view(np_type)  # counters are never negative: reinterpret, do not copy
                    else:
                        v = v.astype(np_type)
                arrays.append(pa.array(v, type=field.type, mask=mask))
        return pa.Table.from_arrays(arrays, schema=schema)


def _flat(v: np.ndarray, shape: tuple) -> np.ndarray:
    v = np.asarray(v)
    return v.reshape(-1) if v.shape == shape else np.broadcast_to(v, shape).reshape(-1)


def _sparse_poisson(rng: np.random.Generator, rate: np.ndarray, dt: np.ndarray) -> np.ndarray:
    """Poisson event counts (B, C, T) for per-device rates (B, C) per second over steps dt (B, T),
    drawn as a total per device then scattered over the steps: O(events), not O(B*C*T) draws."""
    B, C = rate.shape
    T = dt.shape[1]
    span = dt.sum(axis=1)  # (B,)
    dense = rate * span[:, None] > 4 * T  # busy devices: a draw per step is cheaper than scattering
    dense_rate = rate
    if dense.any():
        rate = np.where(dense, 0.0, rate)
    counts = rng.poisson(rate * span[:, None])
    total = int(counts.sum())
    out = np.zeros((B, C, T), np.int64)
    for b, c in zip(*np.nonzero(dense)):
        out[b, c] = rng.poisson(dense_rate[b, c] * dt[b])
    if total == 0:
        return out
    flat_bc = np.repeat(np.arange(B * C), counts.reshape(-1))
    # place each event in a step with probability proportional to the step's length
    u = rng.random(total)
    if T == 1:
        t = np.zeros(total, np.int64)
    elif np.all(dt == dt[:, :1]):
        t = np.minimum((u * T).astype(np.int64), T - 1)
    else:
        cdf = np.cumsum(dt, axis=1) / span[:, None]
        b = flat_bc // C
        t = np.array([min(int(np.searchsorted(cdf[bi], ui)), T - 1) for bi, ui in zip(b, u)], np.int64)
    np.add.at(out.reshape(-1), flat_bc * T + t, 1)
    return out


def _uuid(seed: int, node: int, gpu: int, gen: int) -> str:
    h = hashlib.blake2b(f"{seed}/{node}/{gpu}/{gen}".encode(), digest_size=16).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
