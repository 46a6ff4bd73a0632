"""Small hand-built schema-v1 telemetry for the predictor's tests and benchmarks.

Not the cluster simulator (foreshock.simulator, issue 3): a few nodes with 8 GPUs, NVLink and 2 HCAs,
healthy noise, and optionally one node whose HBM corrected ECC errors climb before it fails, written
as exactly the schema-v1 tables (foreshock.schema.to_table), so the real offline and online code
paths run on them. Also a tiny model directory trained on random features, so registry and online
tests need no simulator run.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from foreshock import schema as sch

T0_NS = 1_780_000_040 * 1_000_000_000  # a step boundary plus 20 s: rows fall inside steps


def _ts(ns: np.ndarray) -> pa.Array:
    return pa.array(ns.astype(np.int64), type=pa.int64()).cast(sch.TS)


def node_tables(node: str, steps: int, *, interval_s: int = 60, seed: int = 0, gpus: int = 8, hcas: int = 2,
                ecc_ramp_from: int | None = None, fail_at: int | None = None,
                wrap_port_counter: bool = False, t0_ns: int = T0_NS) -> dict[str, pa.Table]:
    """Telemetry of one node over `steps` samples; a ramp of corrected ECC on GPU 3 from a step on."""
    rng = np.random.default_rng(seed)
    n = steps if fail_at is None else min(steps, fail_at)
    ts = t0_ns + np.arange(n, dtype=np.int64) * interval_s * 1_000_000_000
    out = {}
    # gpu
    g_ts = np.repeat(ts, gpus)
    g_idx = np.tile(np.arange(gpus), n)
    ecc = np.cumsum(rng.poisson(0.002, (n, gpus)), axis=0)
    if ecc_ramp_from is not None:
        k = np.clip(np.arange(n) - ecc_ramp_from, 0, None)
        ecc[:, 3] += (k * k // 4)
    temp = 55 + 3 * rng.standard_normal((n, gpus)) + np.arange(gpus)[None, :] * 0.5
    gpu = pd.DataFrame({
        "node": node, "gpu": g_idx.astype(np.int16),
        "temperature_c": temp.ravel().astype(np.float32),
        "hbm_temperature_c": (temp + 5).ravel().astype(np.float32),
        "power_w": 500.0 + rng.random(n * gpus) * 100,
        "sm_clock_mhz": np.full(n * gpus, 1980, dtype=np.int32),
        "clock_event_reasons": np.zeros(n * gpus, dtype=np.uint64),
        "ecc_corrected_volatile": ecc.ravel().astype(np.uint64),
        "ecc_uncorrected_volatile": np.zeros(n * gpus, dtype=np.uint64),
        "remapped_rows_correctable": np.zeros(n * gpus, dtype=np.uint64),
        "remapped_rows_uncorrectable": np.zeros(n * gpus, dtype=np.uint64),
        "remapped_rows_pending": np.zeros(n * gpus, dtype=bool),
        "remapped_rows_failure": np.zeros(n * gpus, dtype=bool),
        "pcie_replay_counter": np.cumsum(rng.poisson(0.01, (n, gpus)), axis=0).ravel().astype(np.uint64),
        "pcie_link_gen": np.full(n * gpus, 5, dtype=np.int8), "pcie_link_gen_max": np.full(n * gpus, 5, dtype=np.int8),
        "pcie_link_width": np.full(n * gpus, 16, dtype=np.int8), "pcie_link_width_max": np.full(n * gpus, 16, dtype=np.int8),
        "gpu_lost": np.zeros(n * gpus, dtype=bool),
    })
    t = pa.Table.from_pandas(gpu, preserve_index=False)
    out["gpu"] = sch.conform("gpu", t.append_column("ts", _ts(g_ts)))
    # nvlink
    nv = pd.DataFrame({
        "node": node, "gpu": g_idx.astype(np.int16),
        "replay_errors": np.cumsum(rng.poisson(0.01, (n, gpus)), axis=0).ravel().astype(np.uint64),
        "recovery_errors": np.zeros(n * gpus, dtype=np.uint64),
        "crc_flit_errors": np.cumsum(rng.poisson(0.02, (n, gpus)), axis=0).ravel().astype(np.uint64),
        "crc_data_errors": np.zeros(n * gpus, dtype=np.uint64),
        "tx_kib": np.cumsum(rng.integers(1_000_000, 2_000_000, (n, gpus)), axis=0).ravel().astype(np.uint64),
        "rx_kib": np.cumsum(rng.integers(1_000_000, 2_000_000, (n, gpus)), axis=0).ravel().astype(np.uint64),
        "links_up": np.full(n * gpus, 18, dtype=np.int16), "links_total": np.full(n * gpus, 18, dtype=np.int16),
    })
    t = pa.Table.from_pandas(nv, preserve_index=False)
    out["nvlink"] = sch.conform("nvlink", t.append_column("ts", _ts(g_ts)))
    # rdma_port
    r_ts = np.repeat(ts, hcas)
    sym = np.cumsum(rng.poisson(0.01, (n, hcas)), axis=0)
    wait = np.cumsum(rng.integers(0, 5_000_000, (n, hcas)), axis=0)
    if wrap_port_counter:
        wait = wait % (2 ** 32)
    rd = pd.DataFrame({
        "node": node, "device": [f"mlx5_{i}" for i in range(hcas)] * n,
        "port": np.ones(n * hcas, dtype=np.int16), "state": np.full(n * hcas, 4, dtype=np.int8),
        "phys_state": np.full(n * hcas, 5, dtype=np.int8), "rate_gbps": 400.0, "link_layer": "InfiniBand",
        "symbol_error": sym.ravel().astype(np.uint64),
        "link_error_recovery": np.zeros(n * hcas, dtype=np.uint64), "link_downed": np.zeros(n * hcas, dtype=np.uint64),
        "port_rcv_errors": np.zeros(n * hcas, dtype=np.uint64),
        "port_xmit_wait": wait.ravel().astype(np.uint64),
        "port_xmit_bytes": np.cumsum(rng.integers(10**9, 2 * 10**9, (n, hcas)), axis=0).ravel().astype(np.uint64),
        "port_rcv_bytes": np.cumsum(rng.integers(10**9, 2 * 10**9, (n, hcas)), axis=0).ravel().astype(np.uint64),
        "local_ack_timeout_err": np.cumsum(rng.poisson(0.02, (n, hcas)), axis=0).ravel().astype(np.uint64),
    })
    t = pa.Table.from_pandas(rd, preserve_index=False)
    out["rdma_port"] = sch.conform("rdma_port", t.append_column("ts", _ts(r_ts)))
    # host_net
    hn = pd.DataFrame({"node": node,
                       "Tcp_OutSegs": np.cumsum(rng.integers(1000, 2000, n)).astype(np.int64),
                       "Tcp_RetransSegs": np.cumsum(rng.poisson(1.0, n)).astype(np.int64)})
    t = pa.Table.from_pandas(hn, preserve_index=False)
    out["host_net"] = sch.conform("host_net", t.append_column("ts", _ts(ts)))
    # events: an application Xid now and then, early-warning Xids during the ramp
    ev_rows = []
    for i in np.flatnonzero(rng.random(n) < 0.01):
        ev_rows.append({"ts": pd.Timestamp(int(ts[i]) + 7_000_000_000, tz="UTC"), "node": node, "kind": "xid",
                        "source": "simulator", "severity": "application", "xid": 13, "gpu": 1})
    if ecc_ramp_from is not None:
        for i in range(ecc_ramp_from + 5, n, 7):
            ev_rows.append({"ts": pd.Timestamp(int(ts[i]) + 3_000_000_000, tz="UTC"), "node": node, "kind": "xid",
                            "source": "simulator", "severity": "precursor", "xid": 92, "gpu": 3})
    out["events"] = sch.to_table("events", ev_rows)
    return out


def ingest_sample(scorer, tables: dict[str, dict[str, pa.Table]], k: int) -> None:
    """Every node's `k`-th sample of each of its node_tables, ingested by an online scorer, as a
    collector's minute arrives."""
    for node_tables_ in tables.values():
        for name, t in node_tables_.items():
            scorer.ingest(name, t.slice(k, 1))


def inventory(nodes: list[str], *, leaf_of=None, job_of=None, site: str = "site-a", t0_ns: int = T0_NS) -> pa.Table:
    leaf_of = leaf_of or (lambda i: f"leaf-{i // 4}")
    job_of = job_of or (lambda i: "job-1")
    rows = [{"ts": pd.Timestamp(t0_ns - 60_000_000_000, tz="UTC"), "node": n, "site": site, "spine": "spine-0",
             "leaf_switch": leaf_of(i), "job": job_of(i), "gpus": 8, "hcas": 2} for i, n in enumerate(nodes)]
    return sch.to_table("inventory", rows)


def step_times(placement: dict[str, list[tuple[str, int]]], seconds: float, *, period_s: float = 10.0,
               slow: dict[tuple[str, int], float] | None = None, unmeasured: set[tuple[str, int]] | None = None,
               seed: int = 0, t0_ns: int = T0_NS) -> pa.Table:
    """`step_times` rows of jobs stepping every `period_s` for `seconds` from t0_ns: placement[job] is its
    ranks as (node, rank); half of a step is the rank's compute (a rank in `slow` takes that factor
    longer), jittered by 1 %, and each rank's step ends up to 50 ms apart. A (job, rank) in
    `unmeasured` sends no compute part."""
    rng = np.random.default_rng(seed)
    slow, unmeasured = slow or {}, unmeasured or set()
    cols: dict[str, list] = {k: [] for k in ("ts", "node", "job", "rank", "step", "step_seconds", "compute_seconds")}
    for job, ranks in placement.items():
        n_steps = int(seconds // period_s)
        for node, rank in ranks:
            factor = slow.get((job, rank), 1.0)
            compute = 0.5 * period_s * factor * (1.0 + 0.01 * (2.0 * rng.random(n_steps) - 1.0))
            total = np.maximum(compute, 0.5 * period_s * max(slow.get((job, r), 1.0) for _, r in ranks) * 1.01) \
                + 0.5 * period_s
            end = t0_ns + ((np.arange(n_steps) + 1) * period_s * 1e9).astype(np.int64) \
                + rng.integers(0, 50_000_000, n_steps)
            cols["ts"].append(end)
            cols["node"] += [node] * n_steps
            cols["job"] += [job] * n_steps
            cols["rank"].append(np.full(n_steps, rank, dtype=np.int32))
            cols["step"].append(np.arange(n_steps, dtype=np.int64))
            cols["step_seconds"].append(total)
            cols["compute_seconds"].append(np.full(n_steps, np.nan) if (job, rank) in unmeasured else compute)
    compute = np.concatenate(cols["compute_seconds"])
    return pa.Table.from_arrays([
        _ts(np.concatenate(cols["ts"])), pa.array(cols["node"], sch.STR), pa.array(cols["job"], sch.STR),
        pa.nulls(len(compute), pa.int64()), pa.array(np.concatenate(cols["rank"])),
        pa.array(np.concatenate(cols["step"])), pa.array(np.concatenate(cols["step_seconds"])),
        pa.array(compute, mask=np.isnan(compute)),
    ], schema=sch.schema("step_times"))


def tiny_model_dir(path, *, seed: int = 0):
    """A model directory with a small calibrated model on random features (for registry/online tests)."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.frozen import FrozenEstimator

    from foreshock.predictor import features as ft
    from foreshock.predictor import model as mdl
    from foreshock.predictor import registry

    rng = np.random.default_rng(seed)
    X = rng.random((4000, ft.N_FEATURES)).astype(np.float32)
    j = ft.FEATURE_NAMES.index("ecc_sbe_30m")
    X[:, j] = rng.poisson(1.0, 4000)
    y = (X[:, j] >= 4).astype(int)
    X[y == 1, j] += 50
    # no trend ratios: on these random windows a ratio would separate the classes by accident
    Xm = X[:, :ft.N_MODEL]       # the estimator's columns; the reference below is full width
    est = mdl.make_model(max_iter=10, trend_ratios=False).fit(Xm, y)
    cal = CalibratedClassifierCV(FrozenEstimator(est), method="sigmoid").fit(Xm, y)
    manifest = {"version": "tiny-test", "horizon_seconds": 1800, "thresholds": {"2": 0.5},
                "recommended_threshold": 0.5, "budget": 2.0,
                "reference_features": np.median(X[y == 0], axis=0).tolist(),
                "training": {"note": "random features, tests only"}}
    registry.save_model(path, cal, manifest, baselines={"rule": mdl.RuleBaseline().fit()})
    return path


def pcie_replay_model_dir(path, *, version: str = "test-pcie-1", calibrated: bool = False, rows: int = 3000,
                          max_iter: int = 30, seed: int = 0):
    """A model directory whose model says a climbing PCIe replay rate means failure (healthy links
    replay now and then, 0-20 a window; failing ones 500-1e6), for the service's tests and benchmarks,
    which drive it with real telemetry. `calibrated`: wrapped as train.py wraps the shipped model
    (sigmoid over the frozen pipeline), so the service runs its compiled path."""
    from foreshock.predictor import features as ft
    from foreshock.predictor import model as mdl
    from foreshock.predictor import registry

    rng = np.random.default_rng(seed)
    X = np.abs(rng.normal(0, 0.01, (rows, ft.N_MODEL))).astype(np.float32)   # the estimator's columns
    pos = rng.random(rows) < 0.3
    for name in ("pcie_replay_1m", "pcie_replay_5m", "pcie_replay_30m"):
        col = ft.FEATURE_NAMES.index(name)
        X[:, col] = rng.uniform(0, 20, rows)
        X[pos, col] = rng.uniform(500, 1e6, pos.sum())
    est = mdl.make_model(max_iter=max_iter).fit(X, pos.astype(int))
    if calibrated:
        from sklearn.calibration import CalibratedClassifierCV
        from sklearn.frozen import FrozenEstimator

        est = CalibratedClassifierCV(FrozenEstimator(est), method="sigmoid").fit(X, pos.astype(int))
    registry.save_model(path, est, {"version": version, "horizon_seconds": 1800,
                                    "thresholds": {"2.0": 0.5}, "recommended_threshold": 0.5})
    return path
