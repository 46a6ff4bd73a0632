"""The NVLink fabric's signals and features: health-mask and registration flags, SXids by class."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from foreshock import fabric
from foreshock import schema as sch
from foreshock.collectors import kmsg
from foreshock.collectors.nvml import FakeNvml, NvmlSource
from foreshock.collectors.sxid import parse_sxid
from foreshock.predictor import explain as ex
from foreshock.predictor import features as ft
from foreshock.predictor import signals as sg

T0 = 1_780_000_020 * 1_000_000_000
STEP = sg.STEP_NS
SXID_LINES = Path(__file__).resolve().parents[1] / "examples" / "kmsg" / "sxid-lines.txt"
NVML_ERROR_INSUFFICIENT_RESOURCES = 23   # nvml.h: what a fabric manager out of resources leaves as the status


def _ts(ns: int) -> pd.Timestamp:
    return pd.Timestamp(ns, tz="UTC")


def _gpu(gpu: int, ts: int, info: fabric.FabricInfo | None, **override) -> dict:
    return {"ts": _ts(ts), "node": "n1", "gpu": gpu, "temperature_c": 50.0, **fabric.gpu_columns(info), **override}


def _info(mask: int | None = fabric.HEALTHY_MASK, state: int = fabric.STATE_COMPLETED, status: int = 0):
    return fabric.FabricInfo(bytes(range(1, 17)), status, 3, state, mask, 1)


def _base(table: str, rows: list[dict]):
    return _base_table(table, sch.to_table(table, rows))


def _base_table(table: str, data: pa.Table):
    bad = Counter()
    return sg.node_base_signals({table: data}, malformed=bad), bad


def test_a_degraded_bandwidth_bit_raises_the_flag_and_a_gpu_without_fabric_info_gives_nan_not_0():
    degraded = fabric.with_unhealthy(fabric.HEALTHY_MASK, "fabric_degraded_bw")
    rows = [_gpu(0, T0, _info()), _gpu(1, T0, _info(degraded)),          # step 0: one GPU degraded
            _gpu(0, T0 + STEP, _info()), _gpu(1, T0 + STEP, None),      # step 1: the other has no fabric info
            _gpu(0, T0 + 2 * STEP, None), _gpu(1, T0 + 2 * STEP, None),  # step 2: an HGX node's GPUs
            _gpu(0, T0 + 3 * STEP, _info(None)),                        # step 3: fabric info v1, no mask
            ]
    base, bad = _base("gpu", rows)
    assert base["fabric_degraded_bw"].tolist()[:2] == [1.0, 0.0]
    assert np.isnan(base["fabric_degraded_bw"][2]) and np.isnan(base["fabric_degraded_bw"][3])
    assert base["fabric_access_timeout_recovery"].tolist()[:2] == [0.0, 0.0]
    assert base["fabric_registration_failed"].tolist()[:2] == [0.0, 0.0] and np.isnan(base["fabric_registration_failed"][2])
    assert base["fabric_registration_failed"][3] == 0.0    # registered, only its health unknown
    assert not bad
    # an incorrect configuration is any defined code but "none"; the mask field of GPUs that lack it is 0: unknown
    wrong = (fabric.HEALTHY_MASK & ~(0xF << 8)) | (5 << 8)        # insufficient NVLinks
    base, _ = _base("gpu", [_gpu(0, T0, _info(wrong)), _gpu(0, T0 + STEP, _info(0))])
    assert base["fabric_incorrect_configuration"][0] == 1.0 and np.isnan(base["fabric_incorrect_configuration"][1])
    assert base["fabric_degraded_bw"][0] == 0.0


def test_a_registration_not_completed_or_failed_raises_the_flag_and_undefined_values_are_counted():
    rows = [_gpu(0, T0, _info(state=fabric.STATE_IN_PROGRESS)),
            _gpu(0, T0 + STEP, _info(state=fabric.STATE_NOT_STARTED)),
            _gpu(0, T0 + 2 * STEP, _info(status=999)),                   # completed, but failed
            _gpu(0, T0 + 3 * STEP, _info()),
            _gpu(0, T0 + 4 * STEP, _info(), fabric_state=7),             # a state nvml.h does not define
            _gpu(0, T0 + 5 * STEP, _info(), fabric_status=None),         # completed without its status
            _gpu(0, T0 + 6 * STEP, _info(), fabric_health_mask=3 | fabric.HEALTHY_MASK),   # degraded_bw = 3
            ]
    base, bad = _base("gpu", rows)
    flag = base["fabric_registration_failed"]
    assert flag[:4].tolist() == [1.0, 1.0, 1.0, 0.0] and np.isnan(flag[4]) and np.isnan(flag[5])
    assert np.isnan(base["fabric_degraded_bw"][6]) and base["fabric_access_timeout_recovery"][6] == 0.0
    assert bad == {"fabric_state_undefined": 2, "fabric_mask_undefined": 1}
    assert np.isfinite(base["temp_max"]).all()    # the rest of a malformed row still counts


def _sxid_row(line: str, ts: int = T0, **override) -> dict:
    return {"ts": _ts(ts), "node": "n1", "source": "kmsg", **parse_sxid(line), **override}


FATAL = "nvidia-nvswitch0: SXid (PCI:0000:a9:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"
DETAIL = "nvidia-nvswitch0: SXid (PCI:0000:a9:00.0): 20034, Severity 1 Engine instance 30 Sub-engine instance 00"
NONFATAL = "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)"
CORRECTABLE = "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12345, Correctable, Link 02 something corrected"
CORRECTABLE_DETAIL = "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12345, Severity 0 Engine instance 02 Sub-engine instance 00"
UNKNOWN_NUMBER = "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 77777, Non-fatal, Link 02 an SXid no guide lists"


def test_sxids_are_counted_by_the_class_the_driver_printed_and_malformed_rows_skipped_and_counted():
    rows = [_sxid_row(FATAL), _sxid_row(DETAIL), _sxid_row(NONFATAL), _sxid_row(CORRECTABLE),
            _sxid_row(CORRECTABLE_DETAIL),                          # a detail line is never an SXid of its own
            _sxid_row(UNKNOWN_NUMBER),                              # counted by its class, whatever its number
            _sxid_row(NONFATAL, occurrences=4),                     # a folded row stands for its lines
            _sxid_row(NONFATAL, severity="urgent"),                 # a class the collector never writes
            _sxid_row(NONFATAL, severity=None),
            _sxid_row(FATAL, sxid=None),                            # an SXid row without its code
            {"ts": _ts(T0), "node": "n1", "kind": "xid", "source": "kmsg", "severity": "fatal", "xid": 79}]
    base, bad = _base("events", rows)
    r = base.row(0)
    # the correctable SXid among the non-fatal ones, as the driver files it; the detail lines count as none
    assert (r["sxid_fatal"], r["sxid_nonfatal"], r["xid_fatal"]) == (1, 7, 1)
    assert bad == {"sxid_unknown_class": 2, "sxid_no_code": 1}
    # a step with events but no SXid reads 0; a step without events rows reads unknown
    base, _ = _base("events", [{"ts": _ts(T0 + STEP), "node": "n1", "kind": "link_state", "source": "sysfs"}])
    assert base.row(0)["sxid_fatal"] == 0


def test_replayed_kernel_log_lines_count_each_sxid_once_by_its_class(tmp_path):
    """The real lines (examples/kmsg/sxid-lines.txt: SXids of both classes, each fatal and non-fatal one
    with its detail lines where the source quotes them) and a correctable SXid with the detail line the
    driver prints after it, through the kmsg source into the signals."""
    real = [ln for ln in SXID_LINES.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    log = tmp_path / "dmesg.txt"
    log.write_text("\n".join([*real, CORRECTABLE, CORRECTABLE_DETAIL]) + "\n")
    events = kmsg.KmsgSource("hgx-01", path=str(log), boot_ns=T0).sweep(T0)["events"]
    assert events.num_rows == len(real) + 2
    base, bad = _base_table("events", events)
    # 20034 fatal; 12028, 19084, 28006 non-fatal, and the correctable one: five detail lines counted as none
    assert (base["sxid_fatal"].sum(), base["sxid_nonfatal"].sum()) == (1, 4) and not bad


def _nvml_gpu_rows(*infos) -> pa.Table:
    """The gpu table the nvml source writes for GPUs whose fabric information is `infos` (None: the
    driver answers NOT_SUPPORTED for the call)."""
    fake = FakeNvml.hopper(len(infos))
    for g, info in zip(fake.gpus, infos):
        if info is not None:
            g.values["gpu_fabric_info"] = info
    src = NvmlSource("n1", backend=fake, xid_events=False)
    gpu = src.sweep(T0)["gpu"]
    assert src.errors == 0
    return gpu


def _registration(*infos) -> float:
    base, bad = _base_table("gpu", _nvml_gpu_rows(*infos))
    assert not bad
    return base["fabric_registration_failed"][0]


ZERO_UUID = bytes(16)


def test_a_single_node_gpu_without_a_fabric_does_not_raise_the_registration_flag():
    # a GPU with no NVSwitch behind it: the call is NOT_SUPPORTED, or it answers state NOT_SUPPORTED
    assert np.isnan(_registration(None))
    assert np.isnan(_registration(fabric.FabricInfo(ZERO_UUID, 0, 0, fabric.STATE_NOT_SUPPORTED)))
    assert np.isnan(_registration(None, fabric.FabricInfo(ZERO_UUID, 0, 0, fabric.STATE_NOT_SUPPORTED, 0, 0)))
    # a row that holds NOT_SUPPORTED itself (another writer's) reads the same: no fabric, not malformed
    base, bad = _base("gpu", [_gpu(0, T0, None, fabric_state=fabric.STATE_NOT_SUPPORTED, fabric_status=0)])
    assert np.isnan(base["fabric_registration_failed"][0]) and not bad


def test_an_hgx_gpu_behind_its_baseboards_nvswitches_is_judged_by_its_registration_too():
    # registered with a zero cluster UUID: in no multi-node domain, but registered
    assert _registration(fabric.FabricInfo(ZERO_UUID, 0, 0, fabric.STATE_COMPLETED)) == 0.0
    # its fabric manager down: the registration stays in progress and the GPU reaches no NVLink peer
    assert _registration(fabric.FabricInfo(ZERO_UUID, 0, 0, fabric.STATE_IN_PROGRESS)) == 1.0


def test_an_nvl72_gpu_whose_registration_failed_raises_the_flag():
    uuid = bytes(range(1, 17))
    healthy = fabric.FabricInfo(uuid, 0, 7, fabric.STATE_COMPLETED, fabric.HEALTHY_MASK, 1)
    assert _registration(healthy, healthy) == 0.0
    # completed with an error: no cluster UUID, no clique, as a fabric manager out of resources leaves it
    failed = fabric.FabricInfo(ZERO_UUID, NVML_ERROR_INSUFFICIENT_RESOURCES, 0, fabric.STATE_COMPLETED, 0, 0)
    assert _registration(healthy, failed) == 1.0
    assert _registration(healthy, fabric.FabricInfo(ZERO_UUID, 0, 0, fabric.STATE_NOT_STARTED)) == 1.0
    gpu = _nvml_gpu_rows(healthy, failed).to_pylist()
    assert gpu[0]["nvlink_domain"] is not None and gpu[1]["nvlink_domain"] is None


def test_the_fabric_windows_hold_a_flag_30_minutes_and_count_sxids_with_minutes_since():
    t = 80
    x = np.full((1, t, len(ft.ALL_NAMES)), np.nan)
    deg = ft.IDX["fabric_degraded_bw"]
    fat, non = ft.IDX["sxid_fatal"], ft.IDX["sxid_nonfatal"]
    x[0, 5:, deg] = 0.0
    x[0, 10, deg] = 1.0
    x[0, 20:, fat] = 0.0
    x[0, [20, 25, 25 + 40], fat] = [1.0, 2.0, 1.0]
    x[0, 30, non] = 3.0
    feats, _ = ft.compute(x, np.arange(t), ft.FeatureState.empty(1))
    col = {n: ft.FEATURE_NAMES.index(n) for n in ft.FEATURE_NAMES[ft.FABRIC_COLS]}
    f = feats[0]
    now, mx = f[:, col["fabric_degraded_bw_now"]], f[:, col["fabric_degraded_bw_max30m"]]
    assert np.isnan(now[:5]).all() and np.isnan(mx[:5]).all()             # nothing known: NaN, never 0
    assert now[10] == 1 and now[11] == 0 and (mx[10:40] == 1).all() and mx[40] == 0
    assert np.isnan(f[:, col["fabric_registration_failed_max30m"]]).all()
    s30 = f[:, col["sxid_fatal_30m"]]
    assert np.isnan(s30[:20]).all() and s30[25] == 3 and s30[49] == 3 and s30[50] == 2 and s30[55] == 0 and s30[65] == 1
    since = f[:, col["minutes_since_sxid_fatal"]]
    assert (since[:20] == ft.SINCE_CAP_MINUTES).all() and since[24] == 4 and since[30] == 5
    assert f[35, col["sxid_nonfatal_30m"]] == 3 and f[29, col["minutes_since_sxid_nonfatal"]] == ft.SINCE_CAP_MINUTES
    # any split of the steps into blocks gives the same values (the one-step path included)
    for block in (1, 7, 33):
        state, parts = ft.FeatureState.empty(1), []
        for a in range(0, t, block):
            got, state = ft.compute(x[:, a:a + block], np.arange(a, min(a + block, t)), state)
            parts.append(got)
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), feats)


def test_the_fabric_context_warming_and_onset_columns_come_last_so_older_models_read_a_prefix():
    assert ft.FABRIC_COLS.start == ft.STEP_TIME_COLS.stop and ft.FABRIC_COLS.stop == ft.CONTEXT_COLS.start
    assert ft.CONTEXT_COLS.stop == ft.WARMING_COLS.start and ft.WARMING_COLS.stop == ft.ONSET_COLS.start
    assert ft.ONSET_COLS.stop == ft.N_FEATURES and ft.FEATURE_NAMES[ft.ONSET_COLS] == ("ecc_onset_bins_now",)
    assert ft.FEATURE_NAMES[:ft.FABRIC_COLS.start] == tuple(f.name for f in ft.CORE_FEATURES + ft.ANOMALY
                                                           + ft.STEADINESS + ft.STEP_TIMES)
    assert ft.FEATURE_NAMES[ft.CONTEXT_COLS] == tuple(f"{s.name}_3d" for s in ft.CONTEXT_SIGNALS)
    assert ft.FEATURE_NAMES[ft.WARMING_COLS] == ("hbm_gap_excess_vs_usual", "temp_spread_vs_usual",
                                                 "hbm_gap_excess_remapping")
    assert ft.FEATURE_VERSION == "14" and {"7", "8", "9", "10", "11", "12", "13"} <= set(ft.READABLE_VERSIONS)
    # the health-mask flags are foreshock/fabric.py's fields, declared there once
    assert sg.FABRIC_FLAGS[:len(fabric.HEALTH_FIELDS)] == tuple(f.column for f in fabric.HEALTH_FIELDS)


@pytest.mark.parametrize("value, said", [(1.0, True), (0.0, False), (np.nan, False)])
def test_explanations_name_a_fabric_flag_only_while_set(value, said):
    row = np.full(ft.N_FEATURES, np.nan, dtype=np.float32)
    row[ft.FEATURE_NAMES.index("fabric_degraded_bw_now")] = value
    row[ft.FEATURE_NAMES.index("fabric_degraded_bw_max30m")] = value
    k = ex.GROUP_NAMES.index("fabric_degraded_bw")
    for reference in (np.zeros(ft.N_FEATURES), np.full(ft.N_FEATURES, np.nan)):
        assert ex.unusual(row[None], reference)[0, k] == said
    if said:
        assert ex.describe("fabric_degraded_bw", row) == "A GPU's NVLink bandwidth degraded (fabric health mask): now"


def test_explanations_name_sxids_with_their_count_and_when():
    row = np.full(ft.N_FEATURES, np.nan, dtype=np.float32)
    k = ex.GROUP_NAMES.index("sxid_fatal")
    row[ft.FEATURE_NAMES.index("sxid_fatal_30m")] = 0.0
    row[ft.FEATURE_NAMES.index("minutes_since_sxid_fatal")] = ft.SINCE_CAP_MINUTES
    assert not ex.unusual(row[None], np.zeros(ft.N_FEATURES))[0, k]
    row[ft.FEATURE_NAMES.index("sxid_fatal_30m")] = 2.0
    row[ft.FEATURE_NAMES.index("minutes_since_sxid_fatal")] = 3.0
    assert ex.unusual(row[None], np.zeros(ft.N_FEATURES))[0, k]
    assert ex.describe("sxid_fatal", row) == "Fatal NVSwitch SXids: 2 in the last 30 min, the last 3 min ago"


def test_a_checkpoint_carries_when_each_flag_was_last_set_and_each_sxid_last_seen():
    x = np.full((1, 12, len(ft.ALL_NAMES)), np.nan)
    x[0, :, ft.IDX["fabric_degraded_bw"]] = 0.0
    x[0, 3, ft.IDX["fabric_degraded_bw"]] = 1.0
    x[0, 5, ft.IDX["sxid_fatal"]] = 1.0
    _, state = ft.compute(x[:, :10], np.arange(10), ft.FeatureState.empty(1))
    restored = ft.FeatureState.from_carried(state.carried())
    got, _ = ft.compute(x[:, 10:], np.arange(10, 12), restored)
    row = dict(zip(ft.FEATURE_NAMES, got[0, -1].tolist()))
    assert row["fabric_degraded_bw_max30m"] == 1.0 and row["minutes_since_sxid_fatal"] == 6
