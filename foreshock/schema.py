"""Schema v1: the Arrow schemas of every Foreshock telemetry table, defined once.

Every table is declared as data (a tuple of `Field` rows: name, Arrow type, unit, help), the way
dcgm-exporter declares its fields, and the Arrow schemas, docs/schema.md and the validators are all
derived from these declarations. Counters are stored raw and cumulative, exactly as the hardware gives
them, in the unit the parser normalised them to (bytes, not 4-byte words; watts, not milliwatts);
a value the hardware does not support is null, never 0.

Where the signals come from: ../shared/reference/signals.md (NVML calls, sysfs files, widths).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from foreshock import fabric

SCHEMA_VERSION = 1

TS = pa.timestamp("ns", tz="UTC")
U64 = pa.uint64()
U32 = pa.uint32()
I64 = pa.int64()
I32 = pa.int32()
I16 = pa.int16()
I8 = pa.int8()
F64 = pa.float64()
F32 = pa.float32()
STR = pa.string()
BOOL = pa.bool_()


@dataclass(frozen=True)
class Field:
    name: str
    type: pa.DataType
    unit: str
    help: str
    nullable: bool = True


def _key(name: str, type_: pa.DataType, help_: str) -> Field:
    return Field(name, type_, "", help_, nullable=False)


COMMON = (
    _key("ts", TS, "Sample time, nanoseconds since the epoch, UTC."),
    _key("node", STR, "Node name (hostname, or --node)."),
)

GPU = COMMON + (
    _key("gpu", I16, "NVML device index."),
    Field("uuid", STR, "", "GPU UUID (nvmlDeviceGetUUID)."),
    Field("pci_bus_id", STR, "", "PCI bus id, DDDD:BB:DD.F, lower case."),
    Field("temperature_c", F32, "degC", "GPU core temperature (nvmlDeviceGetTemperatureV)."),
    Field("hbm_temperature_c", F32, "degC", "HBM temperature (field 82, NVML_FI_DEV_MEMORY_TEMP)."),
    Field("power_w", F64, "W", "Power draw (nvmlDeviceGetPowerUsage, mW normalised to W)."),
    Field("energy_j", F64, "J", "Energy since driver load (nvmlDeviceGetTotalEnergyConsumption, mJ to J)."),
    Field("sm_clock_mhz", I32, "MHz", "SM clock."),
    Field("mem_clock_mhz", I32, "MHz", "Memory clock."),
    Field("utilization_pct", F32, "%", "GPU utilisation (nvmlDeviceGetUtilizationRates.gpu)."),
    Field("clock_event_reasons", U64, "bitmask", "nvmlDeviceGetCurrentClocksEventReasons (0x20 SwThermal, 0x40 HwThermal, 0x8 HwSlowdown)."),
    Field("ecc_corrected_volatile", U64, "errors", "Corrected ECC errors since driver load."),
    Field("ecc_uncorrected_volatile", U64, "errors", "Uncorrected ECC errors since driver load."),
    Field("ecc_corrected_aggregate", U64, "errors", "Corrected ECC errors, lifetime."),
    Field("ecc_uncorrected_aggregate", U64, "errors", "Uncorrected ECC errors, lifetime."),
    Field("remapped_rows_correctable", U64, "rows", "Rows remapped for correctable errors (nvmlDeviceGetRemappedRows)."),
    Field("remapped_rows_uncorrectable", U64, "rows", "Rows remapped for uncorrectable errors."),
    Field("remapped_rows_pending", BOOL, "", "A row remap is pending (needs a GPU reset)."),
    Field("remapped_rows_failure", BOOL, "", "A row remap failed."),
    Field("pcie_replay_counter", U64, "replays", "PCIe replay counter (nvmlDeviceGetPcieReplayCounter)."),
    Field("pcie_link_gen", I8, "", "Current PCIe link generation."),
    Field("pcie_link_gen_max", I8, "", "Maximum PCIe link generation."),
    Field("pcie_link_width", I8, "lanes", "Current PCIe link width."),
    Field("pcie_link_width_max", I8, "lanes", "Maximum PCIe link width."),
    Field("gpu_lost", BOOL, "", "NVML answered NVML_ERROR_GPU_IS_LOST (follows Xid 79).", nullable=False),
    # GPU fabric information (nvmlDeviceGetGpuFabricInfoV; foreshock/fabric.py): null on GPUs and drivers
    # without it, and where the state is NVML_GPU_FABRIC_STATE_NOT_SUPPORTED.
    Field("fabric_state", I8, "", "Fabric registration state (.state: 1 not started, 2 in progress, 3 completed)."),
    Field("fabric_status", I32, "", "Fabric registration result (.status, an NVML return code, 0 success), "
          "valid once the state is completed."),
    Field("fabric_cluster_uuid", STR, "", "Fabric cluster UUID (.clusterUuid); null when all zero (NVLink "
          "inside the node)."),
    Field("fabric_clique_id", U32, "", "Fabric clique id (.cliqueId): the GPUs that reach each other over NVLink."),
    Field("nvlink_domain", STR, "", "\"<cluster uuid>/<clique id>\" once registered (completed, success, a "
          "cluster UUID), else null (foreshock/fabric.py, nvlink_domain)."),
    Field("fabric_health_mask", U32, "bitmask", "Fabric health mask (.healthMask, fabric info v2), raw; "
          "decoded in the fabric_* columns below."),
    Field("fabric_health_summary", I8, "", "Fabric health summary (.healthSummary, fabric info v3: "
          "1 healthy, 2 unhealthy, 3 limited capacity)."),
    *(Field(f.column, I8 if f.codes else BOOL, "", f.help) for f in fabric.HEALTH_FIELDS),
)

NVLINK_ERROR_COUNTERS = (
    Field("replay_errors", U64, "errors", "NVLink DL replay errors (NVML_NVLINK_ERROR_DL_REPLAY)."),
    Field("recovery_errors", U64, "errors", "NVLink DL recovery errors (NVML_NVLINK_ERROR_DL_RECOVERY)."),
    Field("crc_flit_errors", U64, "errors", "NVLink flit CRC errors (NVML_NVLINK_ERROR_DL_CRC_FLIT)."),
    Field("crc_data_errors", U64, "errors", "NVLink data CRC errors (NVML_NVLINK_ERROR_DL_CRC_DATA)."),
    Field("ecc_data_errors", U64, "errors", "NVLink data ECC errors (NVML_NVLINK_ERROR_DL_ECC_DATA), where present."),
)

NVLINK = COMMON + (
    _key("gpu", I16, "NVML device index."),
    *NVLINK_ERROR_COUNTERS,
    Field("tx_kib", U64, "KiB", "NVLink data transmitted, cumulative (field 138)."),
    Field("rx_kib", U64, "KiB", "NVLink data received, cumulative (field 139)."),
    Field("links_up", I16, "links", "Links in state up."),
    Field("links_total", I16, "links", "Links the GPU has (field 91)."),
)

NVLINK_LINK = COMMON + (
    _key("gpu", I16, "NVML device index."),
    _key("link", I16, "NVLink link index."),
    Field("up", BOOL, "", "nvmlDeviceGetNvLinkState."),
    *NVLINK_ERROR_COUNTERS,
)

# counters/ of an InfiniBand port (drivers/infiniband/core/sysfs.c), with their hardware widths.
# port_xmit_data/port_rcv_data count 4-byte words and are stored in bytes under *_bytes names.
IB_PORT_COUNTERS: dict[str, int] = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    "port_xmit_wait": 32,
    "port_xmit_bytes": 64,
    "port_rcv_bytes": 64,
    "port_xmit_packets": 64,
    "port_rcv_packets": 64,
    "unicast_xmit_packets": 64,
    "unicast_rcv_packets": 64,
    "multicast_xmit_packets": 64,
    "multicast_rcv_packets": 64,
}
# sysfs file name -> column, where they differ (the data counters are words in sysfs, bytes here).
IB_WORD_COUNTERS = {"port_xmit_data": "port_xmit_bytes", "port_rcv_data": "port_rcv_bytes"}

# hw_counters/ of mlx5 (drivers/infiniband/hw/mlx5/counters.c); 32-bit ones wrap at 2^32.
MLX5_HW_COUNTERS: tuple[str, ...] = (
    "rx_write_requests", "rx_read_requests", "rx_atomic_requests", "rx_dct_connect",
    "out_of_buffer", "out_of_sequence", "duplicate_request", "rnr_nak_retry_err",
    "packet_seq_err", "implied_nak_seq_err", "local_ack_timeout_err",
    "resp_local_length_error", "resp_cqe_error", "req_cqe_error", "req_remote_invalid_request",
    "req_remote_access_errors", "resp_remote_access_errors", "resp_cqe_flush_error",
    "req_cqe_flush_error", "req_transport_retries_exceeded", "req_rnr_retries_exceeded",
    "roce_adp_retrans", "roce_adp_retrans_to", "roce_slow_restart", "roce_slow_restart_cnps",
    "roce_slow_restart_trans", "rp_cnp_ignored", "rp_cnp_handled", "np_ecn_marked_roce_packets",
    "np_cnp_sent", "rx_icrc_encapsulated", "lifespan",
)

RDMA_PORT = COMMON + (
    _key("device", STR, "RDMA device name (mlx5_0, ...)."),
    _key("port", I16, "Port number."),
    Field("state", I8, "", "Logical port state number (0 NOP, 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER)."),
    Field("phys_state", I8, "", "Physical port state number (1 Sleep ... 5 LinkUp, 6 LinkErrorRecovery, 7 PhyTest)."),
    Field("rate_gbps", F64, "Gb/s", "Port rate, from `rate` (\"400 Gb/sec (4X NDR)\")."),
    Field("link_layer", STR, "", "InfiniBand or Ethernet (RoCE)."),
    *(
        Field(name, U64, "bytes" if name.endswith("_bytes") else "count",
              f"counters/{ {v: k for k, v in IB_WORD_COUNTERS.items()}.get(name, name)} ({width}-bit)"
              + (", 4-byte words converted to bytes" if name.endswith("_bytes") else ""))
        for name, width in IB_PORT_COUNTERS.items()
    ),
    *(Field(name, U64, "count", f"hw_counters/{name} (mlx5)") for name in MLX5_HW_COUNTERS),
    Field("extra_counters", pa.map_(STR, U64), "count",
          "counters/ and hw_counters/ files this schema does not name, under their sysfs names, so nothing is lost."),
)

# statistics/ of a net device (Documentation/ABI/testing/sysfs-class-net-statistics).
NETDEV_STATISTICS: tuple[str, ...] = (
    "rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_errors", "tx_errors",
    "rx_dropped", "tx_dropped", "multicast", "collisions", "rx_length_errors", "rx_over_errors",
    "rx_crc_errors", "rx_frame_errors", "rx_fifo_errors", "rx_missed_errors",
    "tx_aborted_errors", "tx_carrier_errors", "tx_fifo_errors", "tx_heartbeat_errors",
    "tx_window_errors", "rx_compressed", "tx_compressed", "rx_nohandler",
)

NETDEV = COMMON + (
    _key("iface", STR, "Interface name."),
    Field("operstate", STR, "", "RFC 2863 operational state (up, down, lowerlayerdown, ...)."),
    Field("carrier", BOOL, "", "Carrier present (null when the interface is down and the kernel refuses the read)."),
    Field("carrier_changes", U64, "count", "Carrier changes (link flaps)."),
    Field("carrier_up_count", U64, "count", "Carrier up transitions."),
    Field("carrier_down_count", U64, "count", "Carrier down transitions."),
    Field("speed_mbps", I64, "Mb/s", "Link speed; null when the kernel reports -1 (unknown)."),
    Field("mtu", I32, "bytes", "MTU."),
    *(Field(name, U64, "bytes" if name.endswith("bytes") else "count", f"statistics/{name}")
      for name in NETDEV_STATISTICS),
)

# /proc/net/snmp "Tcp:" and /proc/net/netstat "TcpExt:" fields that signal path trouble.
TCP_SNMP_FIELDS: tuple[str, ...] = (
    "ActiveOpens", "PassiveOpens", "AttemptFails", "EstabResets", "CurrEstab",
    "InSegs", "OutSegs", "RetransSegs", "InErrs", "OutRsts",
)
TCPEXT_FIELDS: tuple[str, ...] = (
    "TCPTimeouts", "TCPLossProbes", "TCPSynRetrans", "TCPLostRetransmit", "TCPSpuriousRTOs",
    "TCPRcvQDrop", "TCPBacklogDrop", "ListenDrops", "ListenOverflows", "TCPFastRetrans",
    "TCPSlowStartRetrans", "TCPRetransFail", "TCPAbortOnTimeout",
)

HOST_NET = COMMON + (
    *(Field(f"Tcp_{name}", I64, "count", f"/proc/net/snmp Tcp: {name}") for name in TCP_SNMP_FIELDS),
    *(Field(f"TcpExt_{name}", I64, "count", f"/proc/net/netstat TcpExt: {name}") for name in TCPEXT_FIELDS),
)

# Active probes are one row per peer, so they have a table of their own beside host_net.
PATH_PROBE = COMMON + (
    _key("peer", STR, "Probe target, host:port."),
    Field("peer_site", STR, "", "Site of the peer, from the configuration."),
    Field("sent", I32, "probes", "Probes sent in this sweep."),
    Field("received", I32, "probes", "Probes answered."),
    Field("loss_ratio", F64, "ratio", "1 - received/sent."),
    Field("rtt_ms", F64, "ms", "Median round-trip time of the answered probes; null when none were."),
)

EVENTS = COMMON + (
    _key("kind", STR, "xid | sxid | gpu_lost | link_state | nic_error."),
    _key("source", STR, "nvml | kmsg | sysfs | simulator."),
    Field("severity", STR, "", "precursor | application | fatal | info (for Xids: the Xid catalogue, foreshock/xid.py; "
          "for SXids: the class the driver printed, collectors/sxid.py)."),
    Field("xid", I32, "", "Xid code, for kind=xid."),
    Field("gpu", I16, "", "NVML device index, where known."),
    Field("pci_bus_id", STR, "", "PCI bus id of the device the event names, lower case."),
    Field("pid", I64, "", "Process id the driver names, when it names one."),
    Field("process_name", STR, "", "Process name the driver names."),
    Field("device", STR, "", "NIC / RDMA device or interface the event names; the NVSwitch (nvswitchN), for kind=sxid."),
    Field("port", I16, "", "Port, for RDMA link events."),
    Field("message", STR, "", "The driver's text, unparsed remainder."),
    Field("seq", I64, "", "/dev/kmsg sequence number (dedupe across restarts); of a folded row, its last line's."),
    Field("sxid", I32, "", "NVSwitch SXid code, for kind=sxid (collectors/sxid.py)."),
    Field("link", I16, "", "NVSwitch link the SXid names, if it names one."),
    # Added within v1, nullable: files and collectors without them read as one occurrence per row.
    Field("occurrences", I64, "count", "Occurrences this row stands for: repeats of one Xid folded by the collector "
          "(docs/collectors.md); null: 1."),
    Field("first_ts", TS, "", "First occurrence a folded row covers; null: ts."),
    Field("last_ts", TS, "", "Last occurrence a folded row covers; null: ts."),
)

# Topology labels: who shares a leaf switch, a site, an NVLink domain, a job. Written at start-up and
# whenever the labels change, from the configuration (operators) or the simulator.
INVENTORY = COMMON + (
    Field("site", STR, "", "Site (data centre) name."),
    Field("spine", STR, "", "Spine switch group."),
    Field("leaf_switch", STR, "", "Leaf switch the node's HCAs attach to."),
    Field("nvlink_domain", STR, "", "Multi-node NVLink domain (an NVL72 rack): \"<fabric cluster uuid>/<clique id>\" of "
          "its GPUs (the gpu table's nvlink_domain); null where NVLink stays inside the node."),
    Field("job", STR, "", "Job running on the node, if known."),
    Field("gpus", I16, "", "GPUs in the node."),
    Field("hcas", I16, "", "HCAs in the node."),
)

# The NVLink fabric's systemd services (foreshock/fabric.py, FABRIC_SERVICES), from `systemctl show`
# (collectors/systemd.py): one row per installed unit at each poll; a unit not installed has no row.
SYSTEMD_UNIT = COMMON + (
    _key("unit", STR, "Unit name (nvidia-fabricmanager.service, nvidia-imex.service)."),
    Field("load_state", STR, "", "LoadState (loaded, masked, error, ...)."),
    Field("active_state", STR, "", "ActiveState (active, inactive, failed, activating, deactivating, reloading)."),
    Field("sub_state", STR, "", "SubState (running, exited, dead, failed, auto-restart, ...)."),
    Field("result", STR, "", "Result of the unit's last run (success, exit-code, signal, core-dump, timeout, ...)."),
    Field("n_restarts", U32, "restarts", "NRestarts: automatic restarts since the unit was last started "
          "(systemd >= 235)."),
)

# A job's step times, one row per (rank, step): what the migrator reports to the control plane (jobs.proto
# ReportStepTimes), archived by the service (docs/service.md, "The archive"), and what `foreshock simulate`
# writes for its jobs (docs/simulator.md, "Step times").
STEP_TIMES = (
    _key("ts", TS, "When the step ended: the simulator's step end; in the service's archive, the end the rank sent "
         "(jobs.proto StepTime.end_ns, its host's wall clock), or, from a migrator that sends none, when the "
         "service took the report (at most the migrator's report interval late)."),
    _key("node", STR, "Node the rank ran on for the step (its placement's node)."),
    _key("job", STR, "Job: the Jobs API's job_id; in a simulated dataset, the inventory's job label."),
    Field("generation", I64, "", "The job's placement generation when the service took the report "
          "(jobs.proto RegisterJobResponse.generation); null where there is none (the simulator)."),
    _key("rank", I32, "The rank, as the job numbers them."),
    _key("step", I64, "Step number, as the job counts them."),
    Field("step_seconds", F64, "s", "The whole step on this rank, collective waits included.", nullable=False),
    Field("compute_seconds", F64, "s", "The rank's own part: from the step's start to its entry into the gradient "
          "all-reduce, the part that differs between the ranks of a synchronous job; null: not measured."),
)

INCIDENTS = COMMON + (
    Field("incident_id", STR, "", "Unique id."),
    Field("scope", STR, "", "node | switch | site | nvlink_domain: what `node` names."),
    Field("affected_nodes", pa.list_(STR), "", "Nodes the incident took out (the blast radius)."),
    Field("category", STR, "", "Root-cause category (failure-figures.md names: faulty_gpu, gpu_hbm, ...)."),
    Field("component", STR, "", "Component: gpu3, mlx5_2/1, leaf-7, ..."),
    Field("description", STR, "", "Free text."),
    Field("has_precursor", BOOL, "", "Whether the category is one that shows precursors (evaluation only)."),
    Field("precursor_start", TS, "", "Ground-truth start of the precursor (simulator only; features must never read it)."),
    Field("repaired_at", TS, "", "When the node was back in service."),
)

TABLES: dict[str, tuple[Field, ...]] = {
    "gpu": GPU,
    "nvlink": NVLINK,
    "nvlink_link": NVLINK_LINK,
    "rdma_port": RDMA_PORT,
    "netdev": NETDEV,
    "host_net": HOST_NET,
    "path_probe": PATH_PROBE,
    "events": EVENTS,
    "inventory": INVENTORY,
    "incidents": INCIDENTS,
    "systemd_unit": SYSTEMD_UNIT,
    "step_times": STEP_TIMES,
}

# Columns that identify an entity within a node, used by dedupe and by feature builders.
ENTITY_KEYS: dict[str, tuple[str, ...]] = {
    "gpu": ("gpu",),
    "nvlink": ("gpu",),
    "nvlink_link": ("gpu", "link"),
    "rdma_port": ("device", "port"),
    "netdev": ("iface",),
    "host_net": (),
    "path_probe": ("peer",),
    "events": (),
    "inventory": (),
    "incidents": ("incident_id",),
    "systemd_unit": ("unit",),
    "step_times": ("job", "rank"),
}


def _arrow_schema(table: str, fields: tuple[Field, ...]) -> pa.Schema:
    return pa.schema(
        [pa.field(f.name, f.type, nullable=f.nullable, metadata={"unit": f.unit, "help": f.help}) for f in fields],
        metadata={"foreshock.table": table, "foreshock.schema_version": str(SCHEMA_VERSION)},
    )


SCHEMAS: dict[str, pa.Schema] = {name: _arrow_schema(name, fields) for name, fields in TABLES.items()}
_NOT_NULL: dict[str, tuple[int, ...]] = {name: tuple(i for i, f in enumerate(fields) if not f.nullable)
                                         for name, fields in TABLES.items()}


class SchemaError(ValueError):
    """Rows that do not fit a schema-v1 table; the message names the table and the column."""


def schema(table: str) -> pa.Schema:
    try:
        return SCHEMAS[table]
    except KeyError:
        raise SchemaError(f"unknown table {table!r}; schema v1 has {sorted(SCHEMAS)}") from None


def ipc_stream(table: pa.Table, schema: pa.Schema | None = None) -> bytes:
    """A table as one Arrow IPC stream, written with `schema` (default: its own): the bytes of
    TableRows.arrow_ipc (telemetry.proto), ForwardAck.step_times (coordinator.proto) and the service's
    pipes to its worker and archive processes. pyarrow.ipc.open_stream reads it back."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema if schema is None else schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def empty_row(table: str) -> dict:
    """A row of the table with every column null, to be filled in by a source."""
    return dict.fromkeys(schema(table).names)


def to_table(table: str, rows: list[dict]) -> pa.Table:
    """Rows (dicts keyed by column) to an Arrow table of the exact schema; missing keys become null."""
    sch = schema(table)
    try:
        return pa.Table.from_pylist(rows, schema=sch)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
        raise SchemaError(f"table {table!r}: rows do not fit schema v1: {exc}") from exc


def conform(table: str, data: pa.Table) -> pa.Table:
    """Cast an Arrow table to the table's schema: columns in order, absent ones null, extra ones refused.

    Used on anything that crosses a boundary (a file read back, a batch streamed from a collector).
    """
    sch = schema(table)
    if data.schema.equals(sch, check_metadata=True):
        # Already schema v1 (a source built it with this schema): only the not-null check remains.
        # Field access on these metadata-rich schemas costs microseconds each; the hot path skips it.
        for i in _NOT_NULL[table]:
            if data.column(i).null_count:
                f = sch.field(i)
                raise SchemaError(f"table {table!r}: column {f.name!r} must not be null "
                                  f"({data.column(i).null_count} of {data.num_rows} rows are)")
        return data
    names = set(data.column_names)
    extra = names - set(sch.names)
    if extra:
        raise SchemaError(f"table {table!r}: unknown columns {sorted(extra)}")
    columns = []
    for f in sch:
        if f.name in names:
            col = data.column(f.name)
            if not col.type.equals(f.type):
                try:
                    col = col.cast(f.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise SchemaError(f"table {table!r}: column {f.name!r} of type {col.type} "
                                      f"does not cast to {f.type}: {exc}") from exc
        else:
            col = pa.nulls(data.num_rows, f.type)
        if not f.nullable and col.null_count:
            raise SchemaError(f"table {table!r}: column {f.name!r} must not be null "
                              f"({col.null_count} of {data.num_rows} rows are)")
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=sch)


def markdown() -> str:
    """docs/schema.md's table reference, generated from the declarations above (a test keeps it in sync)."""
    out = []
    for name, fields in TABLES.items():
        out.append(f"### `{name}`\n\n| column | type | unit | meaning |\n|---|---|---|---|")
        for f in fields:
            null = "" if f.nullable else " (not null)"
            out.append(f"| `{f.name}` | {f.type}{null} | {f.unit} | {f.help.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)
