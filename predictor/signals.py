"""Base signals: schema-v1 rows reduced to one vector per node and time step (stage 1 of the features).

Reads the telemetry tables of foreshock/schema.py (gpu, nvlink, rdma_port, netdev, host_net,
path_probe, events) and turns raw cumulative counters and gauges into per-step *base signals*:
the errors a node's GPUs, links and ports counted in the step, the hottest GPU, ports down, Xids by
class, and so on. Everything downstream (windows, baselines, peers: features.py) reads only these.

Two halves, used identically by the offline pipeline (a whole node partition at once) and the online
scorer (batches as they arrive):

* `SampleStage.samples(table, batch)`: per-row values, with counter *deltas* taken against the
  previous sample of the same entity (GPU, port, interface), carried across batches in the stage's
  state. A counter that goes down is a wrap when it was near the top of its hardware width (the
  IB counters of schema.IB_PORT_COUNTERS, the 32-bit mlx5 hw_counters) and a reset otherwise (the
  delta is then the new value: what it counted since the reset). InfiniBand PMA counters saturate
  at their maximum rather than wrap; a saturated counter is flagged (`ib_counter_saturated`).
  A duplicate or late row (not newer than the entity's last sample) is dropped and counted.
* `reduce_steps(table, samples)`: per (node, step) sums, maxima and minima. Only exact operations
  are used (sums of integer-valued deltas, max, min), so the result does not depend on how the
  rows were batched or ordered: the offline and online paths give bit-identical base signals.

The signals are declared as data in BASE_SIGNALS (name, kind, description) and per-table
REDUCTIONS (which sample column, which reducer), the way dcgm-exporter declares its fields.
A missing or unsupported value stays NaN, never 0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from foreshock import schema as sch

STEP_SECONDS = 60
STEP_NS = STEP_SECONDS * 1_000_000_000

# Clock-event reasons that mean thermal or hardware slowdown (signals.md: 0x20 SwThermal, 0x40 HwThermal,
# 0x8 HwSlowdown).
THERMAL_REASONS = 0x20 | 0x40 | 0x8
NVLINK_XIDS = (74, 137, 144, 145, 146, 147, 148, 149, 150)


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
    _c("ecc_sbe", "HBM corrected (single-bit) ECC errors"),
    _c("ecc_sbe_gpu_max", "HBM corrected ECC errors on the worst GPU", entity="GPU"),
    _c("ecc_dbe", "HBM uncorrected (double-bit) ECC errors"),
    _c("remap_correctable", "HBM rows remapped for correctable errors", "rows"),
    _c("remap_uncorrectable", "HBM rows remapped for uncorrectable errors", "rows"),
    _f("remap_pending", "an HBM row remap pending"),
    _f("remap_failure", "an HBM row remap failure"),
    _c("pcie_replay", "PCIe replays", "replays"),
    _g("pcie_width_deficit", "PCIe lanes below the link's maximum width", "lanes"),
    _g("pcie_gen_deficit", "PCIe generations below the link's maximum", "gens"),
    _g("temp_max", "hottest GPU temperature", "degC"),
    _g("temp_spread", "temperature gap between the hottest and coolest GPU", "degC"),
    _g("hbm_temp_max", "hottest HBM temperature", "degC"),
    _g("thermal_throttle_frac", "share of GPU samples in thermal or hardware slowdown", "ratio"),
    _g("sm_clock_min", "lowest SM clock", "MHz"),
    _f("gpu_lost", "a GPU lost (off the bus)"),
    # nvlink
    _c("nvl_replay", "NVLink replay errors"),
    _c("nvl_recovery", "NVLink recovery errors"),
    _c("nvl_crc", "NVLink CRC (flit and data) errors"),
    _c("nvl_ecc", "NVLink data ECC errors"),
    _c("nvl_err_gpu_max", "NVLink errors on the worst GPU", entity="GPU"),
    _g("nvl_links_down", "NVLink links down on the worst GPU", "links"),
    _c("nvl_traffic", "NVLink traffic", "KiB"),
    # rdma_port
    _c("ib_symbol_error", "InfiniBand/RoCE symbol errors"),
    _c("ib_link_error_recovery", "InfiniBand link error recoveries", "recoveries"),
    _c("ib_link_downed", "InfiniBand link-down events (link_downed)", "events"),
    _c("ib_rcv_errors", "InfiniBand receive errors"),
    _c("ib_link_integrity", "InfiniBand local link integrity errors"),
    _c("ib_buffer_overrun", "InfiniBand excessive buffer overrun errors"),
    _c("ib_xmit_discards", "InfiniBand transmit discards", "packets"),
    _c("ib_xmit_wait", "InfiniBand transmit wait (congestion)", "ticks"),
    _c("ib_ack_timeout", "RDMA local ACK timeouts", "timeouts"),
    _c("ib_out_of_sequence", "RDMA out-of-sequence packets", "packets"),
    _c("ib_packet_seq_err", "RDMA packet sequence errors"),
    _c("ib_retrans", "RoCE adaptive retransmissions", "retransmissions"),
    _c("ib_retries_exceeded", "RDMA transport retries exceeded"),
    _c("ib_cnp", "congestion notification packets (CNPs)", "packets"),
    _c("ib_link_err_port_max", "link errors on the worst InfiniBand port", entity="port"),
    _g("ib_port_down_frac", "share of InfiniBand port samples not active/LinkUp", "ratio"),
    _f("ib_counter_saturated", "an InfiniBand error counter saturated at its maximum"),
    _c("ib_traffic", "RDMA traffic", "bytes"),
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
BY_NAME = {s.name: s for s in BASE_SIGNALS}


@dataclass(frozen=True)
class Counter_:
    """A cumulative counter: the sample column gets the delta of `columns` (summed) per entity."""
    sample: str
    columns: tuple[str, ...]
    width: int | None  # hardware width in bits, for wrap detection; None = 64-bit / unknown


def _ib_width(name: str) -> int | None:
    if name in sch.IB_PORT_COUNTERS:
        w = sch.IB_PORT_COUNTERS[name]
        return None if w >= 64 else w
    return 32  # mlx5 hw_counters are 32-bit


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

# (signal, sample column, reducer)
REDUCTIONS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "gpu": (
        ("ecc_sbe", "ecc_sbe", "sum"), ("ecc_sbe_gpu_max", "ecc_sbe", "emax"),
        ("ecc_dbe", "ecc_dbe", "sum"), ("remap_correctable", "remap_correctable", "sum"),
        ("remap_uncorrectable", "remap_uncorrectable", "sum"),
        ("remap_pending", "remap_pending", "max"), ("remap_failure", "remap_failure", "max"),
        ("pcie_replay", "pcie_replay", "sum"), ("pcie_width_deficit", "pcie_width_deficit", "max"),
        ("pcie_gen_deficit", "pcie_gen_deficit", "max"), ("temp_max", "temperature_c", "max"),
        ("_temp_min", "temperature_c", "min"), ("hbm_temp_max", "hbm_temperature_c", "max"),
        ("_throttled", "throttled", "sum"), ("_gpu_samples", "one", "sum"),
        ("sm_clock_min", "sm_clock_mhz", "min"), ("gpu_lost", "gpu_lost", "max"),
    ),
    "nvlink": (
        ("nvl_replay", "nvl_replay", "sum"), ("nvl_recovery", "nvl_recovery", "sum"),
        ("nvl_crc", "nvl_crc", "sum"), ("nvl_ecc", "nvl_ecc", "sum"),
        ("nvl_err_gpu_max", "nvl_errors", "emax"), ("nvl_links_down", "links_down", "max"),
        ("nvl_traffic", "nvl_traffic", "sum"),
    ),
    "rdma_port": tuple((c.sample, c.sample, "sum") for c in COUNTERS["rdma_port"]) + (
        ("ib_link_err_port_max", "ib_link_errors", "emax"), ("_ib_down", "port_down", "sum"),
        ("_ib_samples", "one", "sum"), ("ib_counter_saturated", "saturated", "max"),
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
    ),
}
TABLES = tuple(REDUCTIONS)


def _needed_columns(table: str) -> list[str]:
    cols = ["ts", "node", *ENTITY.get(table, ())]
    extra = {
        "gpu": ["temperature_c", "hbm_temperature_c", "clock_event_reasons", "sm_clock_mhz", "gpu_lost",
                "remapped_rows_pending", "remapped_rows_failure", "pcie_link_width", "pcie_link_width_max",
                "pcie_link_gen", "pcie_link_gen_max"],
        "nvlink": ["links_up", "links_total"],
        "rdma_port": ["state", "phys_state", *IB_SATURATING],
        "netdev": ["carrier"],
        "path_probe": ["rtt_ms", "loss_ratio"],
        "events": ["kind", "severity", "xid"],
    }.get(table, [])
    for c in COUNTERS.get(table, ()):
        extra.extend(c.columns)
    out = []
    for c in cols + extra:
        if c not in out:
            out.append(c)
    return out


def _num(df: pd.DataFrame, col: str) -> np.ndarray:
    if col not in df:
        return np.full(len(df), np.nan)
    return pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)


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


@dataclass
class StageStats:
    rows: Counter
    dropped_late: Counter

    @classmethod
    def new(cls):
        return cls(Counter(), Counter())


class SampleStage:
    """Per-row sample values with counter deltas; carries each entity's last sample across batches.

    The state is bounded by the number of entities (nodes x GPUs/ports/interfaces) it has seen.
    """

    def __init__(self, step_seconds: int = STEP_SECONDS):
        self.step_ns = int(step_seconds) * 1_000_000_000
        # table -> DataFrame indexed by entity key: last ts and the raw counter columns
        self._last: dict[str, pd.DataFrame] = {}
        self.stats = StageStats.new()

    def forget_nodes(self, nodes) -> None:
        nodes = set(nodes)
        for table, last in self._last.items():
            keep = ~last["node"].isin(nodes)
            self._last[table] = last[keep]

    def samples(self, table: str, batch: pa.Table | pd.DataFrame) -> pd.DataFrame:
        """Rows of one schema-v1 table to sample values (node, step, entity key, sample columns)."""
        if table not in REDUCTIONS:
            raise sch.SchemaError(f"table {table!r} has no base signals; known: {list(REDUCTIONS)}")
        df = self._frame(table, batch)
        self.stats.rows[table] += len(df)
        if table == "events":
            return self._event_samples(df)
        if len(df) == 0:
            return pd.DataFrame(columns=["node", "step", "key"])
        keys = ENTITY[table]
        key = df["node"].astype(str)
        for k in keys:
            key = key + "\x1f" + df[k].astype(str)
        df["key"] = key.to_numpy()
        df = df.sort_values(["key", "ts"], kind="stable").reset_index(drop=True)
        counters = COUNTERS[table]
        raw_cols = [c for spec in counters for c in spec.columns]
        # previous sample of each row: the row before it of the same entity, or the carried state
        same = np.zeros(len(df), dtype=bool)
        kv = df["key"].to_numpy()
        same[1:] = kv[1:] == kv[:-1]
        first_idx = np.flatnonzero(~same)
        last_state = self._last.get(table)
        prev_ts = np.empty(len(df), dtype=np.int64)
        tsv = df["ts"].to_numpy()
        prev_ts[1:] = tsv[:-1]
        prev_ts[first_idx] = np.iinfo(np.int64).min
        raw = {c: _num(df, c) for c in raw_cols}
        prev_raw = {}
        for c in raw_cols:
            p = np.empty(len(df))
            p[1:] = raw[c][:-1]
            p[first_idx] = np.nan
            prev_raw[c] = p
        if last_state is not None and len(last_state):
            firsts = kv[first_idx]
            hit = last_state.reindex(firsts)
            found = hit["ts"].notna().to_numpy()
            rows = first_idx[found]
            prev_ts[rows] = hit["ts"].to_numpy()[found].astype(np.int64)
            for c in raw_cols:
                prev_raw[c][rows] = hit[c].to_numpy(dtype=np.float64)[found]
        # duplicates and late rows (not newer than the entity's last sample) are dropped
        late = tsv <= prev_ts
        if late.any():
            self.stats.dropped_late[table] += int(late.sum())
            # a late row must not become anyone's "previous": re-run without it
            df = df[~late].drop(columns=["key"])
            self.stats.rows[table] -= len(df)
            return self.samples(table, df) if len(df) else pd.DataFrame(columns=["node", "step", "key"])
        out = pd.DataFrame({"node": df["node"].to_numpy(), "step": tsv // self.step_ns, "key": kv})
        for spec in counters:
            total = None
            for c in spec.columns:
                d = counter_delta(raw[c], prev_raw[c], spec.width)
                total = d if total is None else total + d
            out[spec.sample] = total
        self._table_samples(table, df, out)
        # carry each entity's last sample
        last_idx = np.append(first_idx[1:] - 1, len(df) - 1)
        new_last = pd.DataFrame({"node": df["node"].to_numpy()[last_idx], "ts": tsv[last_idx]},
                                index=pd.Index(kv[last_idx], name="key"))
        for c in raw_cols:
            new_last[c] = raw[c][last_idx]
        if last_state is not None and len(last_state):
            new_last = pd.concat([last_state[~last_state.index.isin(new_last.index)], new_last])
        self._last[table] = new_last
        return out

    def _frame(self, table: str, batch) -> pd.DataFrame:
        if isinstance(batch, pd.DataFrame):
            return batch.reset_index(drop=True)
        cols = [c for c in _needed_columns(table) if c in batch.column_names]
        batch = batch.select(cols)
        ts = batch.column("ts")
        if pa.types.is_timestamp(ts.type):
            batch = batch.set_column(batch.column_names.index("ts"), "ts", pc.cast(ts, pa.int64()))
        df = batch.to_pandas()
        df["ts"] = df["ts"].astype(np.int64)
        return df

    def _table_samples(self, table: str, df: pd.DataFrame, out: pd.DataFrame) -> None:
        n = len(df)
        out["one"] = np.ones(n)
        if table == "gpu":
            out["temperature_c"] = _num(df, "temperature_c")
            out["hbm_temperature_c"] = _num(df, "hbm_temperature_c")
            out["sm_clock_mhz"] = _num(df, "sm_clock_mhz")
            reasons = _num(df, "clock_event_reasons")
            thr = np.full(n, np.nan)
            ok = ~np.isnan(reasons)
            thr[ok] = ((reasons[ok].astype(np.uint64) & np.uint64(THERMAL_REASONS)) != 0).astype(float)
            out["throttled"] = thr
            out["gpu_lost"] = _num(df, "gpu_lost")
            out["remap_pending"] = _num(df, "remapped_rows_pending")
            out["remap_failure"] = _num(df, "remapped_rows_failure")
            out["pcie_width_deficit"] = np.maximum(_num(df, "pcie_link_width_max") - _num(df, "pcie_link_width"), 0)
            out["pcie_gen_deficit"] = np.maximum(_num(df, "pcie_link_gen_max") - _num(df, "pcie_link_gen"), 0)
        elif table == "nvlink":
            out["nvl_errors"] = np.nansum([out[s].to_numpy() for s in NVL_ERRORS], axis=0)
            out["links_down"] = np.maximum(_num(df, "links_total") - _num(df, "links_up"), 0)
        elif table == "rdma_port":
            out["ib_link_errors"] = np.nansum([out[s].to_numpy() for s in IB_LINK_ERRORS], axis=0)
            state, phys = _num(df, "state"), _num(df, "phys_state")
            down = np.where(np.isnan(state), np.nan, ((state != 4) | (~np.isnan(phys) & (phys != 5))).astype(float))
            out["port_down"] = down
            sat = np.zeros(n)
            for name in IB_SATURATING:
                v = _num(df, name)
                sat = np.maximum(sat, (v >= float(2 ** sch.IB_PORT_COUNTERS[name] - 1)).astype(float))
            out["saturated"] = sat
        elif table == "netdev":
            carrier = _num(df, "carrier")
            out["no_carrier"] = np.where(np.isnan(carrier), np.nan, 1.0 - carrier)
        elif table == "path_probe":
            out["rtt_ms"] = _num(df, "rtt_ms")
            out["loss_ratio"] = _num(df, "loss_ratio")

    def _event_samples(self, df: pd.DataFrame) -> pd.DataFrame:
        n = len(df)
        out = pd.DataFrame({"node": df["node"].to_numpy() if n else [], "step": (df["ts"].to_numpy() // self.step_ns) if n else []})
        out["key"] = out["node"]
        if n == 0:
            return out
        kind = df["kind"].astype(str).to_numpy()
        sev = df["severity"].astype(str).to_numpy() if "severity" in df else np.full(n, "")
        xid = _num(df, "xid")
        is_xid = kind == "xid"
        out["xid_fatal"] = (is_xid & (sev == "fatal")).astype(float)
        out["xid_precursor"] = (is_xid & (sev == "precursor")).astype(float)
        out["xid_application"] = (is_xid & (sev == "application")).astype(float)
        out["xid_nvlink"] = (is_xid & np.isin(xid, NVLINK_XIDS)).astype(float)
        out["link_state"] = (kind == "link_state").astype(float)
        out["nic_error"] = (kind == "nic_error").astype(float)
        out["gpu_lost_event"] = (kind == "gpu_lost").astype(float)
        return out


def reduce_steps(table: str, samples: pd.DataFrame) -> pd.DataFrame:
    """Sample values of one table to base signals per (node, step). Exact: independent of batching."""
    spec = REDUCTIONS[table]
    names = [s for s, _, _ in spec]
    if samples is None or len(samples) == 0:
        return pd.DataFrame(columns=names, index=pd.MultiIndex.from_arrays([[], []], names=["node", "step"]))
    g = samples.groupby(["node", "step"], sort=True)
    cols = {}
    for signal, column, how in spec:
        if how == "emax":
            per_entity = samples.groupby(["node", "step", "key"], sort=True)[column].sum(min_count=1)
            cols[signal] = per_entity.groupby(level=[0, 1]).max()
        elif how == "sum":
            cols[signal] = g[column].sum(min_count=1)
        elif how == "max":
            cols[signal] = g[column].max()
        elif how == "min":
            cols[signal] = g[column].min()
        else:  # pragma: no cover - the table above is fixed
            raise ValueError(how)
    return pd.DataFrame(cols)


def finish(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Join the per-table step frames of the same steps and derive the ratio signals; columns BASE_NAMES."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=list(BASE_NAMES),
                            index=pd.MultiIndex.from_arrays([[], []], names=["node", "step"]))
    joined = frames[0].join(frames[1:], how="outer") if len(frames) > 1 else frames[0]
    out = joined.reindex(columns=list(BASE_NAMES) + [c for c in joined.columns if c.startswith("_")])

    def col(name):
        return out[name] if name in out else pd.Series(np.nan, index=out.index)

    out["temp_spread"] = col("temp_max") - col("_temp_min")
    out["thermal_throttle_frac"] = col("_throttled") / col("_gpu_samples")
    out["ib_port_down_frac"] = col("_ib_down") / col("_ib_samples")
    out["eth_down_frac"] = col("_eth_nocarrier") / col("_eth_samples")
    retrans, sent = col("tcp_retrans"), col("tcp_out")
    out["tcp_retrans_ratio"] = retrans / sent.where(sent > 0)
    return out[list(BASE_NAMES)].astype(np.float64)


def node_base_signals(tables: dict[str, pa.Table], step_seconds: int = STEP_SECONDS) -> pd.DataFrame:
    """The offline path for one node partition: every table at once, one row per (node, step) with data."""
    stage = SampleStage(step_seconds)
    frames = []
    for table in TABLES:
        data = tables.get(table)
        if data is None or data.num_rows == 0:
            continue
        frames.append(reduce_steps(table, stage.samples(table, data)))
    return finish(frames)
