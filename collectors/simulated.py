"""Source `simulated`: a live node without the hardware, so the demo and tests have counters that move.

The contract with the cluster simulator (foreshock.simulator, issue 3) is the `NodeModel` protocol:

    class NodeModel(Protocol):
        node: str
        def sample(self, ts_ns: int) -> dict[str, pyarrow.Table]: ...

`sample` returns schema-v1 tables (foreshock.schema) keyed by table name, for the node's state at
`ts_ns` (nanoseconds since the epoch, UTC); it is called once per sweep with increasing times, so a
model may keep state between calls. `SimulatedSource(node_model=...)` turns any such model into a
collector source: the simulator's live cluster hands it its per-node models (with faults injected), and
the collector writes and streams their tables exactly as it does real ones.

`SimpleNodeModel` is the default model: N GPUs and M HCAs whose counters evolve over time. Traffic
follows a training step's rhythm (compute, then an all-reduce burst on NVLink and the HCAs), there are
sporadic benign errors (corrected ECC, NVLink replays, symbol errors, retransmissions), and every
counter is cumulative, as real hardware gives them. It is deterministic for a seed and a sequence of
sample times.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

from foreshock import schema as sch

from .base import Source


@runtime_checkable
class NodeModel(Protocol):
    """What SimulatedSource needs of a node model (see the module docstring)."""

    node: str

    def sample(self, ts_ns: int) -> dict[str, pa.Table]: ...


def _ts(ts_ns: int, n: int) -> pa.Array:
    return pa.array([ts_ns] * n, sch.TS)


def build_table(name: str, n: int, columns: dict[str, object]) -> pa.Table:
    """A schema-v1 table of n rows from the given columns (arrays or lists); the others are null."""
    schema = sch.schema(name)
    arrays = []
    for f in schema:
        col = columns.get(f.name)
        if col is None:
            arrays.append(pa.nulls(n, f.type))
        elif isinstance(col, pa.Array):
            arrays.append(col if col.type.equals(f.type) else col.cast(f.type))
        else:
            arrays.append(pa.array(col, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


class SimpleNodeModel:
    """A node of `gpus` GPUs (18 NVLinks each) and `hcas` 400G InfiniBand HCAs, evolving over time."""

    def __init__(self, node: str, *, gpus: int = 8, hcas: int = 8, seed: int = 0, step_seconds: float = 2.0,
                 comm_fraction: float = 0.4, error_rate: float = 1e-3):
        self.node = node
        self.gpus, self.hcas = gpus, hcas
        self.step_seconds = step_seconds
        self.comm_fraction = comm_fraction
        self.error_rate = error_rate  # benign errors per counter per second
        self._rng = np.random.default_rng(seed)
        self._last_ts: int | None = None
        g, h = gpus, hcas
        self.energy_j = np.full(g, 1.0e6) + self._rng.uniform(0, 1e5, g)
        self.ecc_corrected = np.zeros(g, np.uint64)
        self.pcie_replay = np.zeros(g, np.uint64)
        self.nvl_err = np.zeros((4, g), np.uint64)  # replay, recovery, crc_flit, crc_data
        self.nvl_tx = np.zeros(g, np.uint64)
        self.nvl_rx = np.zeros(g, np.uint64)
        self.ib_bytes = np.zeros((2, h), np.uint64)  # xmit, rcv
        self.ib_packets = np.zeros((2, h), np.uint64)
        self.ib_wait = np.zeros(h, np.uint64)
        self.ib_symbol = np.zeros(h, np.uint64)
        self.ib_retrans = np.zeros(h, np.uint64)  # roce_adp_retrans / out_of_sequence stand-in
        self.eth_bytes = np.zeros(2, np.uint64)
        self.tcp = np.array([10_000, 20_000, 0], np.int64)  # OutSegs, InSegs, RetransSegs
        self._static = {
            "gpu": {"gpu": pa.array(np.arange(g, dtype=np.int16)),
                    "uuid": pa.array([f"GPU-sim-{node}-{i}" for i in range(g)], pa.string()),
                    "pci_bus_id": pa.array([f"0000:{0x18 + 0x10 * i:02x}:00.0" for i in range(g)], pa.string())},
            "rdma": {"device": pa.array([f"mlx5_{i}" for i in range(h)], pa.string()),
                     "port": pa.array(np.ones(h, np.int16))},
        }

    def _comm_active(self, ts_ns: int) -> bool:
        phase = (ts_ns / 1e9) % self.step_seconds / self.step_seconds
        return phase >= 1.0 - self.comm_fraction

    def _errors(self, shape, dt: float) -> np.ndarray:
        return self._rng.poisson(self.error_rate * dt, shape).astype(np.uint64)

    def sample(self, ts_ns: int) -> dict[str, pa.Table]:
        dt = 1.0 if self._last_ts is None else min(max((ts_ns - self._last_ts) / 1e9, 0.0), 60.0)
        self._last_ts = ts_ns
        comm = self._comm_active(ts_ns)
        rng = self._rng
        g, h = self.gpus, self.hcas
        util = np.where(comm, 35.0, 97.0) + rng.normal(0, 1.0, g)
        power = np.where(comm, 420.0, 650.0) + rng.normal(0, 5.0, g)
        self.energy_j += power * dt
        temp = 48.0 + util * 0.2 + rng.normal(0, 0.3, g)
        self.ecc_corrected += self._errors(g, dt)
        self.pcie_replay += self._errors(g, dt)
        self.nvl_err += self._errors((4, g), dt)
        nvl_rate = (150e6 if comm else 2e6) * dt  # KiB per GPU per interval
        self.nvl_tx += np.uint64(int(nvl_rate)) + rng.integers(0, 1000, g).astype(np.uint64)
        self.nvl_rx += np.uint64(int(nvl_rate)) + rng.integers(0, 1000, g).astype(np.uint64)
        ib_rate = (45e9 if comm else 0.2e9) * dt  # bytes per HCA per interval
        inc = (ib_rate + rng.integers(0, 1 << 20, (2, h))).astype(np.uint64)
        self.ib_bytes += inc
        self.ib_packets += inc // np.uint64(4096)
        self.ib_wait += (rng.integers(0, 5000, h) if comm else rng.integers(0, 10, h)).astype(np.uint64)
        self.ib_symbol += self._errors(h, dt)
        self.ib_retrans += self._errors(h, dt)
        self.eth_bytes += np.uint64(int(1e6 * dt))
        self.tcp += np.array([int(100 * dt), int(120 * dt), int(rng.poisson(0.01 * dt))], np.int64)

        gs, rs = self._static["gpu"], self._static["rdma"]
        out = {
            "gpu": build_table("gpu", g, {
                "ts": _ts(ts_ns, g), "node": pa.array([self.node] * g, pa.string()), **gs,
                "temperature_c": temp.astype(np.float32), "hbm_temperature_c": (temp + 4).astype(np.float32),
                "power_w": power, "energy_j": self.energy_j.copy(),
                "sm_clock_mhz": np.full(g, 1980, np.int32), "mem_clock_mhz": np.full(g, 2619, np.int32),
                "utilization_pct": util.astype(np.float32), "clock_event_reasons": np.zeros(g, np.uint64),
                "ecc_corrected_volatile": self.ecc_corrected.copy(),
                "ecc_uncorrected_volatile": np.zeros(g, np.uint64),
                "ecc_corrected_aggregate": self.ecc_corrected + np.uint64(3),
                "ecc_uncorrected_aggregate": np.zeros(g, np.uint64),
                "remapped_rows_correctable": np.zeros(g, np.uint64),
                "remapped_rows_uncorrectable": np.zeros(g, np.uint64),
                "remapped_rows_pending": np.zeros(g, bool), "remapped_rows_failure": np.zeros(g, bool),
                "pcie_replay_counter": self.pcie_replay.copy(),
                "pcie_link_gen": np.full(g, 5, np.int8), "pcie_link_gen_max": np.full(g, 5, np.int8),
                "pcie_link_width": np.full(g, 16, np.int8), "pcie_link_width_max": np.full(g, 16, np.int8),
                "gpu_lost": np.zeros(g, bool),
            }),
            "nvlink": build_table("nvlink", g, {
                "ts": _ts(ts_ns, g), "node": pa.array([self.node] * g, pa.string()), "gpu": gs["gpu"],
                "replay_errors": self.nvl_err[0].copy(), "recovery_errors": self.nvl_err[1].copy(),
                "crc_flit_errors": self.nvl_err[2].copy(), "crc_data_errors": self.nvl_err[3].copy(),
                "tx_kib": self.nvl_tx.copy(), "rx_kib": self.nvl_rx.copy(),
                "links_up": np.full(g, 18, np.int16), "links_total": np.full(g, 18, np.int16),
            }),
            "rdma_port": build_table("rdma_port", h, {
                "ts": _ts(ts_ns, h), "node": pa.array([self.node] * h, pa.string()), **rs,
                "state": np.full(h, 4, np.int8), "phys_state": np.full(h, 5, np.int8),
                "rate_gbps": np.full(h, 400.0), "link_layer": pa.array(["InfiniBand"] * h, pa.string()),
                "port_xmit_bytes": self.ib_bytes[0].copy(), "port_rcv_bytes": self.ib_bytes[1].copy(),
                "port_xmit_packets": self.ib_packets[0].copy(), "port_rcv_packets": self.ib_packets[1].copy(),
                "port_xmit_wait": self.ib_wait.copy(), "symbol_error": self.ib_symbol.copy(),
                "link_downed": np.zeros(h, np.uint64), "link_error_recovery": np.zeros(h, np.uint64),
                "port_rcv_errors": np.zeros(h, np.uint64), "port_xmit_discards": np.zeros(h, np.uint64),
                "out_of_sequence": self.ib_retrans.copy(), "local_ack_timeout_err": np.zeros(h, np.uint64),
            }),
            "netdev": build_table("netdev", 1, {
                "ts": _ts(ts_ns, 1), "node": [self.node], "iface": ["eth0"], "operstate": ["up"],
                "carrier": [True], "carrier_changes": [2], "carrier_up_count": [1], "carrier_down_count": [1],
                "speed_mbps": [100_000], "mtu": [9000],
                "rx_bytes": [int(self.eth_bytes[0])], "tx_bytes": [int(self.eth_bytes[1])],
            }),
            "host_net": build_table("host_net", 1, {
                "ts": _ts(ts_ns, 1), "node": [self.node], "Tcp_OutSegs": [int(self.tcp[0])],
                "Tcp_InSegs": [int(self.tcp[1])], "Tcp_RetransSegs": [int(self.tcp[2])],
            }),
        }
        return out


class SimulatedSource(Source):
    name = "simulated"
    tables = ("gpu", "nvlink", "rdma_port", "netdev", "host_net", "events")

    def __init__(self, node: str, *, node_model: NodeModel | None = None, gpus: int = 8, hcas: int = 8,
                 seed: int = 0):
        super().__init__(node)
        if node_model is not None and not isinstance(node_model, NodeModel):
            raise TypeError(f"node_model {node_model!r} lacks the NodeModel protocol (node, sample(ts_ns))")
        self.model = node_model if node_model is not None else SimpleNodeModel(node, gpus=gpus, hcas=hcas,
                                                                               seed=seed)

    def sweep(self, ts_ns: int) -> dict[str, pa.Table]:
        tables = self.model.sample(ts_ns)
        for name in tables:
            sch.schema(name)  # an unknown table name is the model's bug: refuse it now, by name
        return tables
