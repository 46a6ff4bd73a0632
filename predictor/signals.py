"""Base signals: schema-v1 rows reduced to one vector per node and time step (stage 1 of the features).

Reads the telemetry tables of foreshock/schema.py (gpu, nvlink, rdma_port, netdev, host_net,
path_probe, events) and turns raw cumulative counters and gauges into per-step *base signals*:
the errors a node's GPUs, links and ports counted in the step, the hottest GPU, ports down, Xids by
class, and so on. Everything downstream (windows, baselines, peers: features.py) reads only these.

Two halves, used identically by the offline pipeline (a whole node partition at once) and the online
scorer (batches as they arrive):

* `SampleStage.samples(table, batch)`: per-row values, with counter *deltas* taken against the
  previous sample of the same entity (GPU, port, interface), carried across batches in the stage's
  state. A counter that goes down is a wrap when it can wrap (port_xmit_wait and the 32-bit mlx5
  hw_counters) and was near the top of its width, and otherwise a clear or a reset (the delta is
  then the new value: what it counted since). InfiniBand PMA error counters saturate at their
  maximum and are cleared, never wrapped; a saturated counter is flagged (`ib_counter_saturated`).
  A delta that spans a gap (a missed sample, a collector outage) is scaled to one step's worth of
  the elapsed time, so a gap's errors do not land in one step as a burst. An entity sampled less
  often than once a step (a 2- or 5-minute collector: its SPREAD_AFTER_GAPS-th gap in a row, each of
  at most OUTAGE_STEPS steps) has each delta spread instead, in equal shares, over its own step and
  the steps after it that the span covers, its gauges held there: every step reads the rate of the last
  sample, as a once-a-step collector would show it one interval later, and windowed counts and the
  steps with data do not shrink with the interval (docs/predictor.md, "Telemetry interval").
  A duplicate or late row (not newer than the entity's last sample) is dropped and counted.
* `reduce_steps(table, samples)`: per (node, step) sums, maxima and minima. Only exact operations
  are used (sums of integer-valued deltas, max, min), so the result does not depend on how the
  rows were batched or ordered: the offline and online paths give bit-identical base signals.

The signals are declared as data in BASE_SIGNALS (name, kind, description) and per-table
REDUCTIONS (which sample column, which reducer), the way dcgm-exporter declares its fields.
A missing or unsupported value stays NaN, never 0.

The NVLink fabric's signals (FABRIC_SIGNALS) come from the same rows by the same reductions but are a
group of their own, after BASE_SIGNALS (STEP_NAMES: what `finish` returns), so that the feature columns
over them come after every older model's (features.py). Per node and step, from the gpu table: whether
any of its GPUs' fabric health mask reports each field of foreshock/fabric.py's HEALTH_FIELDS unhealthy
(degraded bandwidth, access-timeout recovery, an incorrect configuration, ...), and whether any GPU that
should be registered with an NVLink fabric is not (fabric.registration_failed: a GPU with a registration
state, an NVL72 tray's or an HGX baseboard's, whose registration is not completed or failed); 1.0 or 0.0
from the GPUs that report it, NaN where no GPU does (no NVSwitch behind it, an older driver, a mask
field the GPU does not support, fabric info v1 without a mask): never 0 for "healthy" where nothing was
said. From the events table: NVSwitch SXids by the class the driver printed, fatal and non-fatal, the
Correctable ones among the non-fatal, as the driver files them (collectors/sxid.py, SEVERITY); a line
without a class (the details the driver prints after every SXid, a report it gives no class) counts as
none. Whatever their number, since Foreshock keeps no SXid number table. A value the data cannot mean (a
fabric state or a health-mask field nvml.h does not define, a completed registration without its
status, an SXid row of a severity the collector never writes or without its code) is left out of the
signal and counted by reason in the stage's `stats.malformed` (MALFORMED), never an error.

The warming group (WARMING_SIGNALS) comes last, from the gpu table's two temperatures: per GPU sample the
HBM temperature less the die's (nvmlDeviceGetTemperatureV and field 82, NVML_FI_DEV_MEMORY_TEMP), and per
node and step the largest of those gaps less their mean over the node's GPU samples. NaN where no GPU
reports both temperatures.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from foreshock import fabric
from foreshock import schema as sch
from foreshock import xid as xidcat
from foreshock.collectors import sxid as sxidcat
from foreshock.predictor import onset

STEP_SECONDS = 60
STEP_NS = STEP_SECONDS * 1_000_000_000

# Clock-event reasons that mean thermal or hardware slowdown (signals.md: 0x20 SwThermal, 0x40 HwThermal,
# 0x8 HwSlowdown).
THERMAL_REASONS = 0x20 | 0x40 | 0x8


@dataclass(frozen=True)
class BaseSignal:
    name: str
    kind: str          # count (a per-step count of errors/events), gauge, flag (0/1), peer (see features)
    text: str          # what it is, in words: used by explanations ("HBM corrected ECC errors")
    unit: str = ""
    entity: str = ""   # the entity kind a per-entity maximum names (GPU, port)


def _c(name, text, unit="errors", entity=""):
    return BaseSignal(name, "count", text, unit, entity)


def _g(name, text, unit=""):
    return BaseSignal(name, "gauge", text, unit)


def _f(name, text):
    return BaseSignal(name, "flag", text)


BASE_SIGNALS: tuple[BaseSignal, ...] = (
    # gpu
    _c("ecc_sbe", "HBM corrected (single-bit) ECC errors on the worst GPU", entity="GPU"),
    _c("ecc_dbe", "HBM uncorrected (double-bit) ECC errors"),
    _c("remap_correctable", "HBM rows remapped for correctable errors", "rows"),
    _c("remap_uncorrectable", "HBM rows remapped for uncorrectable errors", "rows"),
    _f("remap_pending", "an HBM row remap pending"),
    _f("remap_failure", "an HBM row remap failure"),
    _c("pcie_replay", "PCIe replays on the worst GPU", "replays", entity="GPU"),
    _g("pcie_width_deficit", "PCIe lanes below the link's maximum width", "lanes"),
    _g("pcie_gen_deficit", "PCIe generations below the link's maximum", "gens"),
    _g("temp_max", "hottest GPU temperature", "degC"),
    _g("temp_spread", "temperature gap between the hottest and coolest GPU (each at its peak in the step)", "degC"),
    _g("hbm_temp_max", "hottest HBM temperature", "degC"),
    _g("thermal_throttle_frac", "share of GPU samples in thermal or hardware slowdown", "ratio"),
    _g("sm_clock_min", "lowest SM clock", "MHz"),
    _g("remap_rows_total", "HBM rows remapped over the worst GPU's life", "rows"),
    _f("gpu_lost", "a GPU lost (off the bus)"),
    # nvlink
    _c("nvl_replay", "NVLink replay errors on the worst GPU", entity="GPU"),
    _c("nvl_recovery", "NVLink recovery errors on the worst GPU", entity="GPU"),
    _c("nvl_crc", "NVLink CRC (flit and data) errors on the worst GPU", entity="GPU"),
    _c("nvl_ecc", "NVLink data ECC errors on the worst GPU", entity="GPU"),
    _c("nvl_err_gpu_max", "NVLink errors on the worst GPU", entity="GPU"),
    _g("nvl_links_down", "NVLink links down on the worst GPU", "links"),
    _c("nvl_traffic", "NVLink traffic per GPU", "KiB"),
    # rdma_port
    _c("ib_symbol_error", "InfiniBand/RoCE symbol errors on the worst port", entity="port"),
    _c("ib_link_error_recovery", "InfiniBand link error recoveries on the worst port", "recoveries", entity="port"),
    _c("ib_link_downed", "InfiniBand link-down events (link_downed) on the worst port", "events", entity="port"),
    _c("ib_rcv_errors", "InfiniBand receive errors on the worst port", entity="port"),
    _c("ib_link_integrity", "InfiniBand local link integrity errors on the worst port", entity="port"),
    _c("ib_buffer_overrun", "InfiniBand excessive buffer overrun errors on the worst port", entity="port"),
    _c("ib_xmit_discards", "InfiniBand transmit discards on the worst port", "packets", entity="port"),
    _c("ib_xmit_wait", "InfiniBand transmit wait (congestion)", "ticks"),
    _c("ib_ack_timeout", "RDMA local ACK timeouts on the worst port", "timeouts", entity="port"),
    _c("ib_out_of_sequence", "RDMA out-of-sequence packets on the worst port", "packets", entity="port"),
    _c("ib_packet_seq_err", "RDMA packet sequence errors on the worst port", entity="port"),
    _c("ib_retrans", "RoCE adaptive retransmissions on the worst port", "retransmissions", entity="port"),
    _c("ib_retries_exceeded", "RDMA transport retries exceeded on the worst port", entity="port"),
    _c("ib_cnp", "congestion notification packets (CNPs)", "packets"),
    _c("ib_link_err_port_max", "link errors on the worst InfiniBand port", entity="port"),
    _g("ib_port_down_frac", "share of InfiniBand port samples not active/LinkUp", "ratio"),
    _f("ib_counter_saturated", "an InfiniBand error counter saturated at its maximum"),
    _c("ib_traffic", "RDMA traffic per port", "bytes"),
    # netdev
    _c("eth_carrier_changes", "Ethernet carrier changes (link flaps)", "flaps"),
    _c("eth_errors", "Ethernet receive/transmit errors"),
    _c("eth_drops", "Ethernet dropped packets", "packets"),
    _g("eth_down_frac", "share of Ethernet interface samples without carrier", "ratio"),
    # host_net
    _c("tcp_retrans", "TCP retransmitted segments", "segments"),
    _c("tcp_out", "TCP segments sent", "segments"),
    _g("tcp_retrans_ratio", "TCP retransmission ratio", "ratio"),
    _c("tcp_timeouts", "TCP retransmission timeouts", "timeouts"),
    # path_probe
    _g("probe_rtt_max", "worst round-trip time to a peer site", "ms"),
    _g("probe_loss_max", "worst probe loss to a peer site", "ratio"),
    # events
    _c("xid_fatal", "fatal Xid errors", "events"),
    _c("xid_precursor", "early-warning Xids (63, 92, Nonfatal NVLink)", "events"),
    _c("xid_application", "application Xids (13, 31, 43, ...)", "events"),
    _c("xid_nvlink", "NVLink Xids (74, 137, 144-150)", "events"),
    _c("link_state_events", "link state change events", "events"),
    _c("nic_error_events", "NIC driver error events", "events"),
    _c("gpu_lost_events", "GPU lost events", "events"),
)
BASE_NAMES: tuple[str, ...] = tuple(s.name for s in BASE_SIGNALS)
BASE_INDEX = {name: i for i, name in enumerate(BASE_NAMES)}

# The NVLink fabric (module docstring): a flag per health-mask field (named by its gpu-table column),
# the registration flag, and the SXid counts by the driver's class.
_FABRIC_TEXT = {
    "fabric_degraded_bw": "a GPU's NVLink bandwidth degraded (fabric health mask)",
    "fabric_route_recovery": "NVLink fabric route recovery in progress on a GPU (fabric health mask)",
    "fabric_route_unhealthy": "an unhealthy NVLink fabric route on a GPU (fabric health mask)",
    "fabric_access_timeout_recovery": "a GPU recovered from an NVLink access timeout (fabric health mask)",
    "fabric_incorrect_configuration": "a GPU's NVLink fabric configuration incorrect (fabric health mask)",
    "fabric_gfm_disconnected": "the global fabric manager disconnected from a GPU (fabric health mask)",
}
FABRIC_REGISTRATION = "fabric_registration_failed"
SXID_FATAL, SXID_NONFATAL = "sxid_fatal", "sxid_nonfatal"
# By the severity collectors/sxid.py writes for the class: Correctable SXids share Non-fatal's.
SXID_CLASSES = {SXID_FATAL: sxidcat.SEVERITY["Fatal"], SXID_NONFATAL: sxidcat.SEVERITY["Non-fatal"]}
FABRIC_SIGNALS: tuple[BaseSignal, ...] = (
    *(_f(f.column, _FABRIC_TEXT[f.column]) for f in fabric.HEALTH_FIELDS),
    _f(FABRIC_REGISTRATION, "a GPU's NVLink fabric registration not completed or failed"),
    _c(SXID_FATAL, "fatal NVSwitch SXids", "events"),
    _c(SXID_NONFATAL, "non-fatal NVSwitch SXids (correctable ones too)", "events"),
)
FABRIC_NAMES: tuple[str, ...] = tuple(s.name for s in FABRIC_SIGNALS)
FABRIC_FLAGS: tuple[str, ...] = tuple(s.name for s in FABRIC_SIGNALS if s.kind == "flag")
FABRIC_COUNTS: tuple[str, ...] = tuple(s.name for s in FABRIC_SIGNALS if s.kind == "count")
# A GPU's HBM warming apart from its die (module docstring): per node and step, the largest of its GPUs'
# HBM-over-die temperature gap, less the mean of that gap over its GPUs. The load, the room, the rack
# and a GPU's place in the airflow move a GPU's die and its HBM together and every GPU of a node alike;
# HBM that heats on its own (failing stacks, more refresh and more errors to correct) moves only its
# own GPU's gap. A group of its own after the fabric's, so that the feature columns over it come after
# every older model's (features.WARMING).
WARMING_SIGNALS: tuple[BaseSignal, ...] = (
    _g("hbm_gap_excess", "one GPU's HBM warmer than its die, beyond the node's other GPUs", "degC"),
)
WARMING_NAMES: tuple[str, ...] = tuple(s.name for s in WARMING_SIGNALS)
# A GPU whose corrected ECC starts and does not stop (predictor/onset.py): per node and step, the largest of
# its GPUs' onset values, the whole ten-minute bins of the last five hours in which the GPU counted, where it
# seldom counted before (0: it counts as usual; NaN: no GPU judged yet). A group of its own after the
# warming's (features.ONSET).
ONSET_SIGNALS: tuple[BaseSignal, ...] = (
    _g("ecc_onset_bins", "ten-minute bins in which a GPU that seldom counted corrected ECC counted", "bins"),
)
ONSET_NAMES: tuple[str, ...] = tuple(s.name for s in ONSET_SIGNALS)
# What `finish` returns per (node, step): the base signals, then the fabric's, the warming's and the onset's.
STEP_NAMES: tuple[str, ...] = BASE_NAMES + FABRIC_NAMES + WARMING_NAMES + ONSET_NAMES
STEP_INDEX = {name: i for i, name in enumerate(STEP_NAMES)}
BY_NAME = {s.name: s for s in BASE_SIGNALS + FABRIC_SIGNALS + WARMING_SIGNALS + ONSET_SIGNALS}
# Reasons a row's fabric reading is left out (module docstring), counted in SampleStage.stats.malformed.
MALFORMED = ("fabric_state_undefined", "fabric_mask_undefined", "sxid_unknown_class", "sxid_no_code")


@dataclass(frozen=True)
class Counter_:
    """A cumulative counter: the sample column gets the delta of `columns` (summed) per entity."""
    sample: str
    columns: tuple[str, ...]
    width: int | None  # hardware width in bits, for wrap detection; None = 64-bit / unknown


def _ib_width(name: str) -> int | None:
    """The width a decrease of the counter may wrap at; None: a decrease is a clear or a reset.

    The IB PMA error counters (schema.IB_PORT_COUNTERS under 32 bits) saturate at their maximum and
    are cleared (by a fabric manager, `perfquery -x`, a reboot), never wrapped: IBTA vol. 1, 16.1.3.5
    (PortCounters). Read as a wrap, a symbol_error cleared at 60,000 would count 5,539 errors. port_xmit_wait (32-bit) and the mlx5 hw_counters (32-bit) do wrap on busy ports."""
    if name in sch.IB_PORT_COUNTERS:
        w = sch.IB_PORT_COUNTERS[name]
        return None if w >= 64 or w < 32 else w
    return 32


# Per table: entity key columns, counters to difference, and how samples reduce to signals.
# Reducers: sum (over samples and entities), max, min, emax (per-entity sum in the step, then the max over
# entities: "on the worst GPU"), and events are counted by predicate.
ENTITY = {t: sch.ENTITY_KEYS[t] for t in ("gpu", "nvlink", "rdma_port", "netdev", "host_net", "path_probe")}

COUNTERS: dict[str, tuple[Counter_, ...]] = {
    "gpu": (
        Counter_("ecc_sbe", ("ecc_corrected_volatile",), None),
        Counter_("ecc_dbe", ("ecc_uncorrected_volatile",), None),
        Counter_("remap_correctable", ("remapped_rows_correctable",), None),
        Counter_("remap_uncorrectable", ("remapped_rows_uncorrectable",), None),
        Counter_("pcie_replay", ("pcie_replay_counter",), None),
    ),
    "nvlink": (
        Counter_("nvl_replay", ("replay_errors",), None),
        Counter_("nvl_recovery", ("recovery_errors",), None),
        Counter_("nvl_crc", ("crc_flit_errors", "crc_data_errors"), None),
        Counter_("nvl_ecc", ("ecc_data_errors",), None),
        Counter_("nvl_traffic", ("tx_kib", "rx_kib"), None),
    ),
    "rdma_port": (
        Counter_("ib_symbol_error", ("symbol_error",), _ib_width("symbol_error")),
        Counter_("ib_link_error_recovery", ("link_error_recovery",), _ib_width("link_error_recovery")),
        Counter_("ib_link_downed", ("link_downed",), _ib_width("link_downed")),
        Counter_("ib_rcv_errors", ("port_rcv_errors",), _ib_width("port_rcv_errors")),
        Counter_("ib_link_integrity", ("local_link_integrity_errors",), _ib_width("local_link_integrity_errors")),
        Counter_("ib_buffer_overrun", ("excessive_buffer_overrun_errors",), _ib_width("excessive_buffer_overrun_errors")),
        Counter_("ib_xmit_discards", ("port_xmit_discards",), _ib_width("port_xmit_discards")),
        Counter_("ib_xmit_wait", ("port_xmit_wait",), _ib_width("port_xmit_wait")),
        Counter_("ib_ack_timeout", ("local_ack_timeout_err",), 32),
        Counter_("ib_out_of_sequence", ("out_of_sequence",), 32),
        Counter_("ib_packet_seq_err", ("packet_seq_err",), 32),
        Counter_("ib_retrans", ("roce_adp_retrans",), 32),
        Counter_("ib_retries_exceeded", ("req_transport_retries_exceeded",), 32),
        Counter_("ib_cnp", ("np_cnp_sent", "rp_cnp_handled"), 32),
        Counter_("ib_traffic", ("port_xmit_bytes", "port_rcv_bytes"), None),
    ),
    "netdev": (
        Counter_("eth_carrier_changes", ("carrier_changes",), None),
        Counter_("eth_errors", ("rx_errors", "tx_errors"), None),
        Counter_("eth_drops", ("rx_dropped", "tx_dropped"), None),
    ),
    "host_net": (
        Counter_("tcp_retrans", ("Tcp_RetransSegs",), None),
        Counter_("tcp_out", ("Tcp_OutSegs",), None),
        Counter_("tcp_timeouts", ("TcpExt_TCPTimeouts",), None),
    ),
    "path_probe": (),
}
IB_SATURATING = tuple(name for name, w in sch.IB_PORT_COUNTERS.items() if w < 64 and name != "port_xmit_wait")
IB_LINK_ERRORS = ("ib_symbol_error", "ib_link_error_recovery", "ib_link_downed", "ib_rcv_errors", "ib_link_integrity")
NVL_ERRORS = ("nvl_replay", "nvl_recovery", "nvl_crc", "nvl_ecc")

# Counters summed over the node's entities: traffic and congestion, judged against the node's job
# peers. Every error counter reduces to its worst entity ("emax"): a failing device shows as itself,
# and the chronic noise of healthy devices does not grow with how many GPUs or ports a node has, so
# a 4-GPU node reads like an 8-GPU one.
NODE_TOTALS = ("ib_traffic", "ib_xmit_wait", "ib_cnp")

# (signal, sample column, reducer)
REDUCTIONS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "gpu": (
        ("ecc_sbe", "ecc_sbe", "emax"),
        ("ecc_dbe", "ecc_dbe", "sum"), ("remap_correctable", "remap_correctable", "sum"),
        ("remap_uncorrectable", "remap_uncorrectable", "sum"),
        ("remap_pending", "remap_pending", "max"), ("remap_failure", "remap_failure", "max"),
        ("pcie_replay", "pcie_replay", "emax"), ("pcie_width_deficit", "pcie_width_deficit", "max"),
        ("pcie_gen_deficit", "pcie_gen_deficit", "max"), ("temp_max", "temperature_c", "max"),
        ("_temp_coolest_peak", "temperature_c", "emin_max"), ("hbm_temp_max", "hbm_temperature_c", "max"),
        ("_throttled", "throttled", "sum"), ("_gpu_samples", "one", "sum"),
        ("sm_clock_min", "sm_clock_mhz", "min"), ("gpu_lost", "gpu_lost", "max"),
        ("remap_rows_total", "remap_rows_total", "max"),
        *((name, name, "max") for name in FABRIC_FLAGS),
        ("_hbm_gap_max", "hbm_gap", "max"), ("_hbm_gap_sum", "hbm_gap", "sum"),
        ("_hbm_gap_known", "hbm_gap_known", "sum"), ("ecc_onset_bins", "ecc_onset", "max"),
    ),
    "nvlink": (
        ("nvl_replay", "nvl_replay", "emax"), ("nvl_recovery", "nvl_recovery", "emax"),
        ("nvl_crc", "nvl_crc", "emax"), ("nvl_ecc", "nvl_ecc", "emax"),
        ("nvl_err_gpu_max", "nvl_errors", "emax"), ("nvl_links_down", "links_down", "max"),
        ("nvl_traffic", "nvl_traffic", "sum"), ("_nvl_samples", "one", "sum"),
        ("_nvl_gpu_samples", "one", "emax"),
    ),
    "rdma_port": tuple((c.sample, c.sample, "sum" if c.sample in NODE_TOTALS else "emax")
                       for c in COUNTERS["rdma_port"]) + (
        ("ib_link_err_port_max", "ib_link_errors", "emax"), ("_ib_down", "port_down", "sum"),
        ("_ib_samples", "one", "sum"), ("_ib_port_samples", "one", "emax"),
        ("ib_counter_saturated", "saturated", "max"),
    ),
    "netdev": (
        ("eth_carrier_changes", "eth_carrier_changes", "sum"), ("eth_errors", "eth_errors", "sum"),
        ("eth_drops", "eth_drops", "sum"), ("_eth_nocarrier", "no_carrier", "sum"),
        ("_eth_samples", "one", "sum"),
    ),
    "host_net": (
        ("tcp_retrans", "tcp_retrans", "sum"), ("tcp_out", "tcp_out", "sum"),
        ("tcp_timeouts", "tcp_timeouts", "sum"),
    ),
    "path_probe": (("probe_rtt_max", "rtt_ms", "max"), ("probe_loss_max", "loss_ratio", "max")),
    "events": (
        ("xid_fatal", "xid_fatal", "sum"), ("xid_precursor", "xid_precursor", "sum"),
        ("xid_application", "xid_application", "sum"), ("xid_nvlink", "xid_nvlink", "sum"),
        ("link_state_events", "link_state", "sum"), ("nic_error_events", "nic_error", "sum"),
        ("gpu_lost_events", "gpu_lost_event", "sum"),
        *((name, name, "sum") for name in FABRIC_COUNTS),
    ),
}
TABLES = tuple(REDUCTIONS)


def _needed_columns(table: str) -> list[str]:
    cols = ["ts", "node", *ENTITY.get(table, ())]
    extra = {
        "gpu": ["temperature_c", "hbm_temperature_c", "clock_event_reasons", "sm_clock_mhz", "gpu_lost",
                "remapped_rows_pending", "remapped_rows_failure", "pcie_link_width", "pcie_link_width_max",
                "pcie_link_gen", "pcie_link_gen_max", "fabric_state", "fabric_status", "fabric_health_mask"],
        "nvlink": ["links_up", "links_total"],
        "rdma_port": ["state", "phys_state", *IB_SATURATING],
        "netdev": ["carrier"],
        "path_probe": ["rtt_ms", "loss_ratio"],
        "events": ["kind", "severity", "xid", "occurrences", "sxid"],
    }.get(table, [])
    for c in COUNTERS.get(table, ()):
        extra.extend(c.columns)
    out = []
    for c in cols + extra:
        if c not in out:
            out.append(c)
    return out


def counter_delta(cur: np.ndarray, prev: np.ndarray, width: int | None) -> np.ndarray:
    """Delta of a cumulative counter between two samples: wrap near the top of `width`, else reset.

    NaN in, NaN out (unsupported stays unknown); no previous sample (NaN prev) gives 0.
    """
    d = cur - prev
    down = d < 0
    if down.any():
        fixed = cur.copy()
        if width is not None:
            top = float(2 ** width)
            wrap = down & (prev > 0.75 * top)
            fixed = np.where(wrap, cur + top - prev, cur)
        d = np.where(down, fixed, d)
    return np.where(np.isnan(prev) & ~np.isnan(cur), 0.0, d)


GAP_FACTOR = 1.5        # a delta spanning more than this many steps is a gap's, not one step's
# Gap-scaled deltas and the HBM-over-die temperature gap are rounded to 1/64: dyadic, so their sums stay
# exact in any order (a step's rows may reach the online scorer in several batches).
RATE_QUANTUM = 64.0
# A sampling interval, not a missed sample: an entity's fourth gap in a row. Missed samples at random
# (a few per cent of a once-a-minute collector's) make four gaps in a row about never, so histories
# sampled every step keep their features; a collector's first three coarse deltas are scaled as gaps.
SPREAD_AFTER_GAPS = 4
OUTAGE_STEPS = 10       # a longer span is a collector outage, not a sampling interval: scaled, never spread


def gap_scale(ts: np.ndarray, prev_ts: np.ndarray, step_ns: int) -> np.ndarray | None:
    """Per row, one step over the time its delta spans when that exceeds GAP_FACTOR steps, else 1;
    None when no row spans a gap (the usual case: nothing to scale)."""
    has_prev = prev_ts > np.iinfo(np.int64).min
    span = np.where(has_prev, ts - np.where(has_prev, prev_ts, ts), 0)
    gap = span > GAP_FACTOR * step_ns
    if not gap.any():
        return None
    return np.where(gap, step_ns / np.where(gap, span, 1).astype(np.float64), 1.0)


def gap_runs(gap: np.ndarray, first: np.ndarray, carried: np.ndarray) -> np.ndarray:
    """Per row (rows sorted by entity, then time): how many gaps in a row its entity's samples end with
    at this row, 0 where the row is not a gap. `first` marks each entity's first row of the batch and
    `carried` the run its entity ended the previous batch with (read at first rows only)."""
    idx = np.arange(len(gap))
    start = np.maximum.accumulate(np.where(~gap | first, idx, 0))
    run = idx - start + np.where(gap[start] & first[start], 1 + carried[start], 0)
    return np.where(gap, run, 0)


def spread_shares(total: np.ndarray, share: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """Share `share` (0-based) of `shares` equal shares of each delta, rounded to 1/RATE_QUANTUM as
    differences of rounded cumulative fractions, so a delta's shares add up to it exactly."""
    hi = np.round(total * ((share + 1) / shares) * RATE_QUANTUM)
    lo = np.round(total * (share / shares) * RATE_QUANTUM)
    return (hi - lo) / RATE_QUANTUM


def per_step(delta: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """A delta scaled to one step's worth, rounded to 1/RATE_QUANTUM so that sums of deltas stay
    exact in any order (the offline and online paths add them in different orders)."""
    return np.where(scale < 1.0, np.round(delta * scale * RATE_QUANTUM) / RATE_QUANTUM, delta)


@dataclass
class StageStats:
    rows: Counter
    dropped_late: Counter
    malformed: Counter   # rows whose fabric reading was left out, by reason (MALFORMED)
    spread: Counter      # steps filled with a share of a coarsely sampled entity's delta, by table

    @classmethod
    def new(cls):
        return cls(Counter(), Counter(), Counter(), Counter())


NODE_SHIFT = 1 << 20   # entity key = node code * NODE_SHIFT + entity code
STEP_SHIFT = 1 << 32   # step key = node code * STEP_SHIFT + step


@dataclass
class Samples:
    """A block of per-row sample values: node code, step, entity key, and the sample columns."""
    node: np.ndarray
    step: np.ndarray
    key: np.ndarray
    cols: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.step)

    def select(self, mask: np.ndarray) -> "Samples":
        return Samples(self.node[mask], self.step[mask], self.key[mask], {k: v[mask] for k, v in self.cols.items()})

    @staticmethod
    def concat(blocks: list["Samples"]) -> "Samples":
        blocks = [b for b in blocks if len(b)]
        if len(blocks) == 1:
            return blocks[0]
        if not blocks:
            return Samples.empty()
        names = blocks[0].cols.keys()
        return Samples(np.concatenate([b.node for b in blocks]), np.concatenate([b.step for b in blocks]),
                       np.concatenate([b.key for b in blocks]),
                       {k: np.concatenate([b.cols[k] for b in blocks]) for k in names})

    @staticmethod
    def empty() -> "Samples":
        z = np.zeros(0, dtype=np.int64)
        return Samples(z, z, z, {})


def _float(batch: pa.Table, name: str) -> np.ndarray:
    if name not in batch.column_names:
        return np.full(batch.num_rows, np.nan)
    col = batch.column(name)
    if not pa.types.is_floating(col.type):
        col = pc.cast(col, pa.float64(), safe=False)
    return col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def _codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list]:
    """(per-row code, the distinct values) of a column, nulls as the value None."""
    enc = pc.dictionary_encode(col).combine_chunks()
    idx = enc.indices.to_numpy(zero_copy_only=False)
    values = enc.dictionary.to_pylist()
    if enc.null_count:
        idx = np.where(np.isnan(idx.astype(np.float64)), len(values), idx)
        values = values + [None]
    return idx.astype(np.int64), values


def _find_sorted(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position in sorted_keys, found) of each key; sorted_keys is not empty."""
    pos = np.clip(np.searchsorted(sorted_keys, keys), 0, len(sorted_keys) - 1)
    return pos, sorted_keys[pos] == keys


class SampleStage:
    """Per-row sample values with counter deltas; carries each entity's last sample across batches.

    The state is bounded by the number of entities (nodes x GPUs/ports/interfaces) it has seen. Node
    codes are assigned in order of first sight (`node_code`), so a caller can keep them in step
    with its own node index.
    """

    def __init__(self, step_seconds: int = STEP_SECONDS):
        self.step_ns = int(step_seconds) * 1_000_000_000
        self.node_index: dict[str, int] = {}
        self.node_names: list[str] = []
        self._entity_index: dict[tuple, int] = {}
        self.entity_labels: list[str] = []
        # table -> (sorted entity keys, last ts, last raw counter values [n, c], gaps in a row (gap_runs))
        self._last: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.onset = onset.OnsetTracker()   # each GPU's corrected-ECC onset (ONSET_SIGNALS)
        self.stats = StageStats.new()

    def node_code(self, name: str) -> int:
        code = self.node_index.get(name)
        if code is None:
            code = self.node_index[name] = len(self.node_names)
            self.node_names.append(name)
        return code

    def _node_codes(self, batch: pa.Table) -> np.ndarray:
        idx, values = _codes(batch.column("node"))
        return np.array([self.node_code(str(v)) for v in values], dtype=np.int64)[idx]

    def _entity_codes(self, table: str, batch: pa.Table) -> np.ndarray:
        keys = ENTITY.get(table, ())
        n = batch.num_rows
        if not keys:
            return np.zeros(n, dtype=np.int64)
        parts, dicts = [], []
        for k in keys:
            idx, values = _codes(batch.column(k))
            parts.append(idx)
            dicts.append(values)
        combo = parts[0]
        for p_, d in zip(parts[1:], dicts[1:]):
            combo = combo * (len(d) + 1) + p_
        uniq, inv = np.unique(combo, return_inverse=True)
        out = np.empty(len(uniq), dtype=np.int64)
        for j, c in enumerate(uniq):
            vals = []
            for d in reversed(dicts):
                vals.append(d[c % (len(d) + 1)] if c % (len(d) + 1) < len(d) else None)
                c //= (len(d) + 1)
            vals = tuple(reversed(vals))
            label = (f"GPU {vals[0]}" if table in ("gpu", "nvlink") else
                     f"{vals[0]}/{vals[1]}" if table == "rdma_port" else str(vals[0]))
            ent = self._entity_index.get((table, vals))
            if ent is None:
                ent = self._entity_index[(table, vals)] = len(self.entity_labels)
                self.entity_labels.append(label)
            out[j] = ent
        return out[inv]

    def entity_label(self, key: int) -> str:
        return self.entity_labels[int(key) % NODE_SHIFT]

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """What carries across a restart (OnlineScorer.save_state): the node and entity codes (JSON)
        and each entity's last sample per table (arrays), so the first counter delta after a restart
        is the counter's growth since the last sample before it, scaled over the gap like any gap."""
        meta = {"nodes": list(self.node_names),
                "entities": [[table, list(vals), code, self.entity_labels[code]]
                             for (table, vals), code in self._entity_index.items()],
                "tables": sorted(self._last)}
        arrays = {}
        for table, (keys, ts, vals, runs) in self._last.items():
            arrays[f"last.{table}.keys"], arrays[f"last.{table}.ts"], arrays[f"last.{table}.vals"] = keys, ts, vals
            arrays[f"last.{table}.gaps"] = runs
        arrays.update(self.onset.state())
        return meta, arrays

    @classmethod
    def from_state(cls, meta: dict, arrays: dict[str, np.ndarray], step_seconds: int = STEP_SECONDS) -> "SampleStage":
        """The inverse of state(); ValueError (naming what) when the parts do not fit together."""
        stage = cls(step_seconds)
        for name in meta["nodes"]:
            stage.node_code(str(name))
        labels: dict[int, str] = {}
        for table, vals, code, label in meta["entities"]:
            stage._entity_index[(str(table), tuple(vals))] = int(code)
            labels[int(code)] = str(label)
        if sorted(labels) != list(range(len(labels))):
            raise ValueError("sample stage: entity codes are not 0..n-1")
        stage.entity_labels = [labels[c] for c in range(len(labels))]
        for table in meta["tables"]:
            if table not in COUNTERS:
                raise ValueError(f"sample stage: unknown table {table!r}")
            keys = np.asarray(arrays[f"last.{table}.keys"], dtype=np.int64)
            ts = np.asarray(arrays[f"last.{table}.ts"], dtype=np.int64)
            vals = np.asarray(arrays[f"last.{table}.vals"], dtype=np.float64)
            # without the runs (a checkpoint that has none) every entity starts a new run
            runs = np.asarray(arrays.get(f"last.{table}.gaps", np.zeros(len(keys))), dtype=np.int64)
            width = sum(len(spec.columns) for spec in COUNTERS[table])
            if (not (len(keys) == len(ts) == len(vals) == len(runs) and vals.shape[1:] == (width,))
                    or np.any(np.diff(keys) <= 0)):
                raise ValueError(f"sample stage: table {table!r}: inconsistent last samples")
            stage._last[table] = (keys, ts, vals, runs)
        stage.onset = onset.OnsetTracker.from_state(arrays)
        return stage

    def samples(self, table: str, batch: pa.Table) -> Samples:
        """Rows of one schema-v1 table (any nodes) to sample values."""
        if table not in REDUCTIONS:
            raise sch.SchemaError(f"table {table!r} has no base signals; known: {list(REDUCTIONS)}")
        self.stats.rows[table] += batch.num_rows
        if batch.num_rows == 0:
            return Samples.empty()
        ts = pc.cast(batch.column("ts"), pa.int64()).to_numpy(zero_copy_only=False).astype(np.int64)
        node = self._node_codes(batch)
        if table == "events":
            return self._event_samples(batch, ts, node)
        key = node * NODE_SHIFT + self._entity_codes(table, batch)
        order = np.lexsort((ts, key))
        ts, node, key = ts[order], node[order], key[order]
        counters = COUNTERS[table]
        raw_cols = [c for spec in counters for c in spec.columns]
        raw = {c: _float(batch, c)[order] for c in raw_cols}
        extra = {c: _float(batch, c)[order] for c in _needed_columns(table)
                 if c not in raw and c not in ("ts", "node", *ENTITY.get(table, ())) and table != "events"}
        while True:
            n = len(ts)
            first = np.ones(n, dtype=bool)
            first[1:] = key[1:] != key[:-1]
            prev_ts = np.empty(n, dtype=np.int64)
            prev_ts[1:] = ts[:-1]
            prev_ts[first] = np.iinfo(np.int64).min
            prev = {}
            for c in raw_cols:
                p_ = np.empty(n)
                p_[1:] = raw[c][:-1]
                p_[first] = np.nan
                prev[c] = p_
            carried = np.zeros(n, dtype=np.int64)
            state = self._last.get(table)
            if state is not None and len(state[0]):
                skeys, sts, svals, sruns = state
                fi = np.flatnonzero(first)
                pos, hit = _find_sorted(skeys, key[fi])
                rows, pos = fi[hit], pos[hit]
                prev_ts[rows] = sts[pos]
                carried[rows] = sruns[pos]
                for j, c in enumerate(raw_cols):
                    prev[c][rows] = svals[pos, j]
            late = ts <= prev_ts
            if not late.any():
                break
            # duplicates and rows not newer than their entity's last sample are dropped
            self.stats.dropped_late[table] += int(late.sum())
            keep = ~late
            ts, node, key = ts[keep], node[keep], key[keep]
            raw = {c: v[keep] for c, v in raw.items()}
            extra = {c: v[keep] for c, v in extra.items()}
            if len(ts) == 0:
                return Samples.empty()
        cols: dict[str, np.ndarray] = {}
        scale = gap_scale(ts, prev_ts, self.step_ns)
        runs = np.zeros(n, dtype=np.int64) if scale is None else gap_runs(scale < 1.0, first, carried)
        # rows spread over the steps their span covers (module docstring), into `shares` rows each
        shares = None
        if scale is not None and runs.max() >= SPREAD_AFTER_GAPS:
            span_steps = (ts - np.where(runs > 0, prev_ts, ts)) / self.step_ns
            spread = (runs >= SPREAD_AFTER_GAPS) & (span_steps <= OUTAGE_STEPS)
            if spread.any():
                shares = np.where(spread, np.clip(np.rint(span_steps), 2, OUTAGE_STEPS), 1).astype(np.int64)
        for spec in counters:
            total = None
            for c in spec.columns:
                d = counter_delta(raw[c], prev[c], spec.width)
                total = d if total is None else total + d
            cols[spec.sample] = total if scale is None else per_step(total, scale)
            if shares is not None:
                cols[spec.sample] = np.where(spread, total, cols[spec.sample])
        step = ts // self.step_ns
        real = None
        if shares is not None:
            src = np.repeat(np.arange(n), shares)
            share = np.arange(len(src)) - np.repeat(np.cumsum(shares) - shares, shares)
            for name, v in cols.items():
                v = v[src]
                cols[name] = np.where(spread[src], spread_shares(v, share, shares[src]), v)
            self.stats.spread[table] += len(src) - n
            real = share == 0
            node_out, step_out, key_out = node[src], step[src] + share, key[src]
            extra_out, raw_out = {c: v[src] for c, v in extra.items()}, {c: v[src] for c, v in raw.items()}
        else:
            node_out, step_out, key_out, extra_out, raw_out = node, step, key, extra, raw
        self._table_samples(table, extra_out, raw_out, cols, len(step_out), real)
        if table == "gpu":
            cols["ecc_onset"] = self.onset.update(key_out, step_out, cols["ecc_sbe"], self.step_ns // 1_000_000_000)
        # carry each entity's last sample
        last = np.ones(len(ts), dtype=bool)
        last[:-1] = key[1:] != key[:-1]
        new_keys, new_ts = key[last], ts[last]
        new_vals = (np.column_stack([raw[c][last] for c in raw_cols]) if raw_cols
                    else np.zeros((int(last.sum()), 0)))
        self._carry(table, new_keys, new_ts, new_vals, np.minimum(runs[last], SPREAD_AFTER_GAPS))
        return Samples(node_out, step_out, key_out, cols)

    def _carry(self, table: str, keys: np.ndarray, ts: np.ndarray, vals: np.ndarray, runs: np.ndarray) -> None:
        """Each entity's last sample (keys sorted and distinct) into the carried state. Entities seen
        before are updated in place: a batch holds a few nodes, the state every entity of the cluster
        (300k NVLink links at 2,048 nodes), so merging and re-sorting all of it per batch was the
        ingest's largest cost. Only a batch with new entities re-sorts."""
        state = self._last.get(table)
        if state is None or not len(state[0]):
            self._last[table] = (keys.copy(), ts.copy(), np.array(vals, dtype=np.float64), runs.copy())
            return
        skeys, sts, svals, sruns = state
        pos, hit = _find_sorted(skeys, keys)
        sts[pos[hit]] = ts[hit]
        svals[pos[hit]] = vals[hit]
        sruns[pos[hit]] = runs[hit]
        if hit.all():
            return
        miss = ~hit
        keys = np.concatenate([skeys, keys[miss]])
        o = np.argsort(keys, kind="stable")
        self._last[table] = (keys[o], np.concatenate([sts, ts[miss]])[o],
                             np.concatenate([svals, vals[miss]])[o], np.concatenate([sruns, runs[miss]])[o])

    def _table_samples(self, table: str, col: dict, raw: dict, out: dict, n: int,
                       real: np.ndarray | None = None) -> None:
        """The table's sample columns besides its counters' deltas, into `out`. `real` marks the rows that
        are samples, not a spread delta's later steps (None: all are), for counting what was left out."""
        out["one"] = np.ones(n)
        if table == "gpu":
            out["temperature_c"] = col["temperature_c"]
            out["hbm_temperature_c"] = col["hbm_temperature_c"]
            gap = np.round((col["hbm_temperature_c"] - col["temperature_c"]) * RATE_QUANTUM) / RATE_QUANTUM
            out["hbm_gap"] = gap
            out["hbm_gap_known"] = (~np.isnan(gap)).astype(np.float64)
            out["sm_clock_mhz"] = col["sm_clock_mhz"]
            reasons = col["clock_event_reasons"]
            thr = np.full(n, np.nan)
            ok = ~np.isnan(reasons)
            thr[ok] = ((reasons[ok].astype(np.uint64) & np.uint64(THERMAL_REASONS)) != 0).astype(float)
            out["throttled"] = thr
            out["gpu_lost"] = col["gpu_lost"]
            out["remap_pending"] = col["remapped_rows_pending"]
            out["remap_failure"] = col["remapped_rows_failure"]
            out["pcie_width_deficit"] = np.maximum(col["pcie_link_width_max"] - col["pcie_link_width"], 0)
            out["pcie_gen_deficit"] = np.maximum(col["pcie_link_gen_max"] - col["pcie_link_gen"], 0)
            out["remap_rows_total"] = raw["remapped_rows_correctable"] + raw["remapped_rows_uncorrectable"]
            undefined = np.zeros(n, dtype=bool)
            for name, (flag, bad) in fabric.unhealthy_flags(col["fabric_health_mask"]).items():
                out[name] = flag
                undefined |= bad
            out[FABRIC_REGISTRATION], bad_state = fabric.registration_failed(col["fabric_state"], col["fabric_status"])
            for reason, bad in (("fabric_mask_undefined", undefined), ("fabric_state_undefined", bad_state)):
                if real is not None:
                    bad = bad & real
                if bad.any():
                    self.stats.malformed[reason] += int(bad.sum())
        elif table == "nvlink":
            out["nvl_errors"] = _nansum([out[s_] for s_ in NVL_ERRORS])
            out["links_down"] = np.maximum(col["links_total"] - col["links_up"], 0)
        elif table == "rdma_port":
            out["ib_link_errors"] = _nansum([out[s_] for s_ in IB_LINK_ERRORS])
            state, phys = col["state"], col["phys_state"]
            out["port_down"] = np.where(np.isnan(state), np.nan,
                                        ((state != 4) | (~np.isnan(phys) & (phys != 5))).astype(float))
            sat = np.zeros(n)
            for name in IB_SATURATING:
                v = raw[name] if name in raw else col[name]
                sat = np.maximum(sat, (v >= float(2 ** sch.IB_PORT_COUNTERS[name] - 1)).astype(float))
            out["saturated"] = sat
        elif table == "netdev":
            carrier = col["carrier"]
            out["no_carrier"] = np.where(np.isnan(carrier), np.nan, 1.0 - carrier)
        elif table == "path_probe":
            out["rtt_ms"] = col["rtt_ms"]
            out["loss_ratio"] = col["loss_ratio"]

    def _event_samples(self, batch: pa.Table, ts: np.ndarray, node: np.ndarray) -> Samples:
        def is_(col, value):
            if col not in batch.column_names:
                return np.zeros(batch.num_rows, dtype=bool)
            return pc.fill_null(pc.equal(batch.column(col), value), False).to_numpy(zero_copy_only=False)

        klass, nvlink = _xid_classes(batch, is_("kind", "xid"))
        # A row the collector folded stands for `occurrences` lines (null: one), and counts as many.
        n = _float(batch, "occurrences")
        n = np.where(np.isnan(n) | (n < 1), 1.0, n)
        cols = {
            "xid_fatal": (klass == "fatal") * n,
            "xid_precursor": (klass == "precursor") * n,
            "xid_application": (klass == "application") * n,
            "xid_nvlink": nvlink * n,
            "link_state": is_("kind", "link_state") * n,
            "nic_error": is_("kind", "nic_error") * n,
            "gpu_lost_event": is_("kind", "gpu_lost") * n,
        }
        cols.update(self._sxid_counts(batch, is_("kind", "sxid"), n))
        return Samples(node, ts // self.step_ns, node * NODE_SHIFT, cols)

    def _sxid_counts(self, batch: pa.Table, is_sxid: np.ndarray, n: np.ndarray) -> dict[str, np.ndarray]:
        """The SXid counts of event rows by the driver's class (SXID_CLASSES); a line without a class
        counts as none; a row of a severity the collector never writes, or without its code, counts as
        none and is counted malformed."""
        out = {name: np.zeros(len(n)) for name in SXID_CLASSES}
        if not is_sxid.any():
            return out
        sev = (batch.column("severity").to_numpy(zero_copy_only=False) if "severity" in batch.column_names
               else np.full(len(n), None, dtype=object))
        code = _float(batch, "sxid")
        no_code = is_sxid & ~(code >= 0)
        classed = np.zeros(len(n), dtype=bool)
        for severity in sxidcat.SEVERITIES:
            classed |= sev == severity
        unknown = is_sxid & ~no_code & ~classed
        for reason, bad in (("sxid_no_code", no_code), ("sxid_unknown_class", unknown)):
            if bad.any():
                self.stats.malformed[reason] += int(bad.sum())
        ok = is_sxid & ~no_code & ~unknown
        for name, severity in SXID_CLASSES.items():
            out[name] = (ok & (sev == severity)) * n
        return out


def _xid_classes(batch: pa.Table, is_xid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the Xid catalogue's class of an Xid row ("" for other rows), and whether it is an NVLink Xid."""
    klass = np.full(batch.num_rows, "", dtype=object)
    nvlink = np.zeros(batch.num_rows, dtype=bool)
    rows = np.flatnonzero(is_xid)
    if not rows.size:
        return klass, nvlink
    codes = _float(batch, "xid")[rows]
    sev = (batch.column("severity").take(pa.array(rows)).to_pylist() if "severity" in batch.column_names
           else [None] * rows.size)
    memo: dict = {}
    for i, code, s in zip(rows.tolist(), codes.tolist(), sev):
        key = (code, s)
        if key not in memo:
            memo[key] = (xidcat.classify(code, s), xidcat.lookup(code).nvlink)
        klass[i], nvlink[i] = memo[key]
    return klass, nvlink


def _nansum(arrays: list[np.ndarray]) -> np.ndarray:
    stack = np.vstack(arrays)
    out = np.where(np.isnan(stack), 0.0, stack).sum(axis=0)
    return np.where(np.isnan(stack).all(axis=0), np.nan, out)


@dataclass
class StepSignals:
    """Per (node, step) signals: keys = node code * STEP_SHIFT + step, values [G, len(names)]."""
    keys: np.ndarray
    names: tuple[str, ...]
    values: np.ndarray

    @property
    def node(self) -> np.ndarray:
        return self.keys // STEP_SHIFT

    @property
    def step(self) -> np.ndarray:
        return self.keys % STEP_SHIFT

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[:, self.names.index(name)]

    def row(self, i: int) -> dict[str, float]:
        return dict(zip(self.names, self.values[i].tolist()))


def _segments(sorted_group: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.flatnonzero(sorted_group[1:] != sorted_group[:-1]) + 1])


def _nondecreasing(a: np.ndarray) -> bool:
    return len(a) < 2 or bool((a[1:] >= a[:-1]).all())


def group_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(distinct keys ascending, segment starts in sorted order, the sorting order or None if the keys
    were already sorted: a batch comes from SampleStage sorted by entity key, so no sort is needed)."""
    order = None if _nondecreasing(keys) else np.argsort(keys, kind="stable")
    sk = keys if order is None else keys[order]
    if len(sk) == 0:
        return sk, np.zeros(0, dtype=np.intp), order
    starts = _segments(sk)
    return sk[starts], starts, order


def _sorted_by(primary: np.ndarray, secondary: np.ndarray) -> bool:
    """Rows already in (primary, secondary) order (what np.lexsort((secondary, primary)) would give)."""
    if len(primary) < 2:
        return True
    dp = primary[1:] - primary[:-1]
    return bool(((dp > 0) | ((dp == 0) & (secondary[1:] >= secondary[:-1]))).all())


def reduce_steps(table: str, s: Samples) -> StepSignals:
    """Sample values of one table to signals per (node, step). Exact: independent of batching and order.

    Sums are of integer-valued columns (deltas, counts), so their order does not matter; max and min
    are order-free. A sum over only unknown values is unknown (NaN), not 0.

    Reducers (REDUCTIONS): "sum", "max", "min" over the step's rows; "emax" the largest per-entity sum
    (the worst GPU's count); "emin_max" the smallest per-entity maximum (the coolest GPU's peak).
    A signal that compares entities takes each entity's own peak, never a maximum and a minimum from
    different samples: with several samples per step, a gauge's swing over time (load changing on
    every GPU at once) would read as a gap between devices, and the feature would depend on the
    sampling interval.
    """
    spec = REDUCTIONS[table]
    names = tuple(sig for sig, _, _ in spec)
    if len(s) == 0:
        return StepSignals(np.zeros(0, np.int64), names, np.zeros((0, len(names))))
    gk = s.node * STEP_SHIFT + s.step
    # one step's batch arrives sorted by entity key (SampleStage sorts it): then nothing to sort, and
    # the identity order is what the stable lexsort would return
    order = None if _sorted_by(gk, s.key) else np.lexsort((s.key, gk))
    gk_sorted = gk if order is None else gk[order]
    starts = _segments(gk_sorted)
    keys = gk_sorted[starts]
    key_sorted = s.key if order is None else s.key[order]
    # segments of (group, entity) for the per-entity maxima
    ent_starts = np.concatenate([[0], np.flatnonzero((gk_sorted[1:] != gk_sorted[:-1]) | (key_sorted[1:] != key_sorted[:-1])) + 1])
    ent_group = np.searchsorted(starts, ent_starts, side="right") - 1
    ent_group_starts = _segments(ent_group)
    out = np.empty((len(keys), len(names)))
    for j, (_sig, column, how) in enumerate(spec):
        v = s.cols[column] if order is None else s.cols[column][order]
        known = ~np.isnan(v)
        if how in ("sum", "emax"):
            seg = starts if how == "sum" else ent_starts
            total = np.add.reduceat(np.where(known, v, 0.0), seg)
            count = np.add.reduceat(known.astype(np.float64), seg)
            total = np.where(count > 0, total, np.nan)
            out[:, j] = total if how == "sum" else np.fmax.reduceat(total, ent_group_starts)
        elif how == "max":
            out[:, j] = np.fmax.reduceat(v, starts)
        elif how == "min":
            out[:, j] = np.fmin.reduceat(v, starts)
        elif how == "emin_max":
            out[:, j] = np.fmin.reduceat(np.fmax.reduceat(v, ent_starts), ent_group_starts)
        else:  # pragma: no cover - the table above is fixed
            raise ValueError(how)
    return StepSignals(keys, names, out)


# finish's derived signals as kernels.derive_columns reads them: (kind, result, operands...), kind 0:
# a - b, 1: a / b, 2: floor(a * b / c) where c > 0, 3: a / b where b > 0, 4: a - b / c where c > 0;
# the numpy path below is the written reference
_DERIVED = ((0, "temp_spread", "temp_max", "_temp_coolest_peak"),
            (1, "thermal_throttle_frac", "_throttled", "_gpu_samples"),
            (1, "ib_port_down_frac", "_ib_down", "_ib_samples"),
            (1, "eth_down_frac", "_eth_nocarrier", "_eth_samples"),
            (2, "ib_traffic", "ib_traffic", "_ib_port_samples", "_ib_samples"),
            (2, "nvl_traffic", "nvl_traffic", "_nvl_gpu_samples", "_nvl_samples"),
            (3, "tcp_retrans_ratio", "tcp_retrans", "tcp_out"),
            (4, "hbm_gap_excess", "_hbm_gap_max", "_hbm_gap_sum", "_hbm_gap_known"))


def finish(blocks: list[StepSignals], kernel: bool = False) -> StepSignals:
    """Join the per-table signals of the same (node, step) and derive the ratios; names STEP_NAMES
    (the base signals, then the fabric's, then the warming's). kernel: when every table reports the same (node, step)s,
    the columns copied and the ratios derived row by row in compiled kernels where numba is importable
    (the online round); False: column by column in numpy, the written reference (the same values)."""
    from foreshock.predictor import kernels

    blocks = [b for b in blocks if len(b)]
    if not blocks:
        return StepSignals(np.zeros(0, np.int64), STEP_NAMES, np.zeros((0, len(STEP_NAMES))))
    # every table reporting the same (node, step)s is the usual case: then no key join is needed
    same = all(len(b) == len(blocks[0]) and np.array_equal(b.keys, blocks[0].keys) for b in blocks[1:])
    keys = blocks[0].keys if same else np.unique(np.concatenate([b.keys for b in blocks]))
    values = np.full((len(keys), len(STEP_NAMES)), np.nan)
    if same and kernel and kernels.AVAILABLE:
        # the helpers a derived signal reads are columns too, NaN where no table gave them
        names = list(dict.fromkeys([name for b in blocks for name in b.names if name not in STEP_INDEX]
                                   + [n for op in _DERIVED for n in op[2:] if n not in BASE_INDEX]))
        block = np.full((len(keys), len(names)), np.nan)

        def at(name):
            if name in BASE_INDEX:
                return BASE_INDEX[name]
            return STEP_INDEX[name] if name in STEP_INDEX else -names.index(name) - 1

        for b in blocks:
            dest = np.array([at(name) for name in b.names], dtype=np.int64)
            kernels.scatter_columns(np.ascontiguousarray(b.values, dtype=np.float64), dest, values, block)
        ops = np.array([[kind, at(result)] + [at(n) for n in operands] + [0] * (3 - len(operands))
                        for kind, result, *operands in _DERIVED], dtype=np.int64)
        kernels.derive_columns(values, block, ops)
        return StepSignals(keys, STEP_NAMES, values)
    helpers: dict[str, np.ndarray] = {}   # the reductions that only feed a derived signal
    for b in blocks:
        pos = slice(None) if same else np.searchsorted(keys, b.keys)
        for j, name in enumerate(b.names):
            k = STEP_INDEX.get(name)
            if k is not None:
                values[pos, k] = b.values[:, j]
            else:
                col = helpers.get(name)
                if col is None:
                    col = helpers[name] = np.full(len(keys), np.nan)
                col[pos] = b.values[:, j]
    nan = np.full(len(keys), np.nan)

    def get(name):
        k = BASE_INDEX.get(name)
        return values[:, k] if k is not None else helpers.get(name, nan)

    with np.errstate(invalid="ignore", divide="ignore"):
        derived = {
            "temp_spread": get("temp_max") - get("_temp_coolest_peak"),
            "thermal_throttle_frac": get("_throttled") / get("_gpu_samples"),
            "ib_port_down_frac": get("_ib_down") / get("_ib_samples"),
            "eth_down_frac": get("_eth_nocarrier") / get("_eth_samples"),
        }
        # traffic per device (the node's total over its ports or GPUs with samples), so that a 4-HCA
        # node reads like an 8-HCA one beside its job peers; whole units keep group sums exact
        for name, samples, per_entity in (("ib_traffic", "_ib_samples", "_ib_port_samples"),
                                          ("nvl_traffic", "_nvl_samples", "_nvl_gpu_samples")):
            n = get(samples)
            derived[name] = np.where(n > 0, np.floor(get(name) * get(per_entity) / np.where(n > 0, n, 1.0)), np.nan)
        sent = get("tcp_out")
        derived["tcp_retrans_ratio"] = np.where(sent > 0, get("tcp_retrans") / np.where(sent > 0, sent, 1.0), np.nan)
        known = get("_hbm_gap_known")
        derived["hbm_gap_excess"] = np.where(known > 0, get("_hbm_gap_max") - get("_hbm_gap_sum") / np.where(
            known > 0, known, 1.0), np.nan)
    for name, v in derived.items():
        values[:, STEP_INDEX[name]] = v
    return StepSignals(keys, STEP_NAMES, values)


def node_base_signals(tables: dict[str, pa.Table], step_seconds: int = STEP_SECONDS,
                      malformed: Counter | None = None, spread: Counter | None = None) -> StepSignals:
    """The offline path for one node partition: every table at once, one row per step with data.
    `malformed` gets the stage's counts of fabric readings left out (MALFORMED), `spread` its counts of
    steps filled with a coarsely sampled entity's delta (StageStats.spread)."""
    stage = SampleStage(step_seconds)
    blocks = []
    for table in TABLES:
        data = tables.get(table)
        if data is None or data.num_rows == 0:
            continue
        blocks.append(reduce_steps(table, stage.samples(table, data)))
    if malformed is not None:
        malformed.update(stage.stats.malformed)
    if spread is not None:
        spread.update(stage.stats.spread)
    return finish(blocks)
