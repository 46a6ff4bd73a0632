"""The nvml source over FakeNvml (no GPU here), and the real side checked against nvidia-ml-py's API."""

from __future__ import annotations

import ast
import ctypes
import inspect
import time

import pynvml
import pytest

from foreshock import fabric
from foreshock.collectors import nvml
from foreshock.collectors.nvml import FakeNvml, NvmlSource, PynvmlBackend
from foreshock.fabric import FabricInfo

TS = 1_780_000_000_000_000_000


def _sweep(src):
    return {k: v.to_pylist() for k, v in src.sweep(TS).items()}


def test_gpu_rows_normalise_units_and_keep_unsupported_null():
    fake = FakeNvml.hopper(2)
    del fake.gpus[1].values["pcie_replay_counter"]  # NOT_SUPPORTED on this part
    src = NvmlSource("n", backend=fake, xid_events=False)
    out = _sweep(src)
    g0, g1 = out["gpu"]
    assert g0["power_w"] == pytest.approx(350.0) and g0["energy_j"] == pytest.approx(10_000.0)
    assert g0["hbm_temperature_c"] == 45.0 and g0["ecc_corrected_aggregate"] == 3
    assert g0["pcie_replay_counter"] == 0 and g1["pcie_replay_counter"] is None
    assert g0["pci_bus_id"] == "0000:18:00.0" and g0["gpu_lost"] is False
    assert src.errors == 0


def test_nvlink_sums_links_and_optional_per_link_table():
    fake = FakeNvml.hopper(1, links=18)
    g = fake.gpus[0]
    g.link_counters[(3, 0)] = 5  # replay errors on link 3
    g.link_counters[(7, 0)] = 2
    g.link_counters[(7, 2)] = 11  # crc_flit on link 7
    g.links[17] = False
    out = _sweep(NvmlSource("n", backend=fake, xid_events=False))
    (row,) = out["nvlink"]
    assert (row["replay_errors"], row["crc_flit_errors"], row["recovery_errors"]) == (7, 11, 0)
    assert row["ecc_data_errors"] is None  # NVLink4: the counter is not supported on any link
    assert (row["links_up"], row["links_total"], row["tx_kib"], row["rx_kib"]) == (17, 18, 1000, 2000)
    assert "nvlink_link" not in out
    links = _sweep(NvmlSource("n", backend=fake, nvlink_links=True, xid_events=False))["nvlink_link"]
    assert len(links) == 18 and links[7]["crc_flit_errors"] == 11 and links[17]["up"] is False


def test_gpu_lost_is_a_signal_with_one_event():
    fake = FakeNvml.hopper(2)
    src = NvmlSource("n", backend=fake, xid_events=False)
    _sweep(src)
    fake.gpus[1].lost = True
    first, second = _sweep(src), _sweep(src)
    assert [r["gpu_lost"] for r in first["gpu"]] == [False, True]
    assert first["gpu"][1]["temperature_c"] is None
    assert [(e["kind"], e["gpu"], e["severity"]) for e in first["events"]] == [("gpu_lost", 1, "fatal")]
    assert "events" not in second  # said once per loss
    assert len(first["nvlink"]) == 1


def test_other_nvml_errors_are_counted_and_null():
    fake = FakeNvml.hopper(1)
    fake.gpus[0].errors["temperature"] = 999  # NVML_ERROR_UNKNOWN
    src = NvmlSource("n", backend=fake, xid_events=False)
    (row,) = _sweep(src)["gpu"]
    assert row["temperature_c"] is None and row["power_w"] is not None and src.errors == 1


def test_field_values_are_checked_entry_by_entry():
    fake = FakeNvml.hopper(1)
    del fake.gpus[0].fields[(nvml.NVML_FI_DEV_MEMORY_TEMP, 0)]
    out = _sweep(NvmlSource("n", backend=fake, xid_events=False))
    assert out["gpu"][0]["hbm_temperature_c"] is None and out["nvlink"][0]["tx_kib"] == 1000


def test_xid_events_arrive_from_the_event_thread():
    fake = FakeNvml.hopper(2)
    src = NvmlSource("n", backend=fake)
    try:
        src.sweep(TS)
        fake.push_xid(1, 79)
        fake.push_xid(0, 999)
        deadline = time.time() + 5
        events = []
        while time.time() < deadline and len(events) < 2:
            time.sleep(0.05)
            events += _sweep(src).get("events", [])
    finally:
        src.close()
    assert [(e["xid"], e["gpu"], e["source"], e["severity"]) for e in events] == [
        (79, 1, "nvml", "fatal"), (999, 0, "nvml", "info")]
    assert events[0]["pci_bus_id"] == "0000:28:00.0"


def test_without_libnvidia_ml_the_source_is_absent(caplog):
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    except pynvml.NVMLError:
        pass
    src = NvmlSource("n")
    with caplog.at_level("INFO", "foreshock.collectors"):
        assert src.sweep(TS) == {} and src.sweep(TS) == {}
    assert src.absent and src.errors == 0 and caplog.text.count("hardware absent") == 1


def test_the_real_backend_calls_only_functions_nvidia_ml_py_has():
    """Every pynvml name PynvmlBackend uses exists, with the argument count it is called with."""
    tree = ast.parse(inspect.getsource(PynvmlBackend))
    used = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_call":
            fn = node.args[0]
            if isinstance(fn, ast.Attribute) and fn.attr.startswith("nvml"):
                used[fn.attr] = len(node.args) - 1
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "_n" and (node.attr.startswith("NVML_") or node.attr.startswith("nvml")):
            assert hasattr(pynvml, node.attr), f"pynvml has no {node.attr}"
    assert {"nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetFieldValues", "nvmlDeviceGetRemappedRows",
            "nvmlEventSetWait", "nvmlDeviceRegisterEvents", "nvmlDeviceGetTotalEccErrors"} <= set(used)
    for name, nargs in used.items():
        fn = getattr(pynvml, name, None)
        assert fn is not None, f"pynvml has no {name}"
        params = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty]
        assert len(params) == nargs, f"{name} takes {len(params)} required arguments, called with {nargs}"
    # The constants the fake and the source share agree with NVML's:
    assert (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_TIMEOUT,
            nvml.NVML_ERROR_FUNCTION_NOT_FOUND) == (
        pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_TIMEOUT,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    assert (nvml.NVML_FI_DEV_MEMORY_TEMP, nvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
            nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX) == (
        pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
    assert [c for c, _ in nvml.NVLINK_ERROR_COUNTERS] == [
        pynvml.NVML_NVLINK_ERROR_DL_REPLAY, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
        pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
        pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA]
    assert (nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM, nvml.NVML_AGGREGATE_ECC) == (
        pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM, pynvml.NVML_AGGREGATE_ECC)


def test_the_real_backend_translates_nvml_errors(monkeypatch):
    """PynvmlBackend over a stand-in pynvml whose calls raise real pynvml.NVMLError codes."""
    backend = PynvmlBackend.__new__(PynvmlBackend)  # skip nvmlInit: there is no libnvidia-ml here
    backend._n = pynvml
    backend._handles = {}

    def raising(code):
        def fn(*args):
            raise pynvml.NVMLError(code)
        return fn

    with pytest.raises(nvml.NvmlNotSupported):
        backend._call(raising(pynvml.NVML_ERROR_NOT_SUPPORTED))
    with pytest.raises(nvml.NvmlNotSupported):
        backend._call(raising(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND))
    with pytest.raises(nvml.NvmlGpuLost):
        backend._call(raising(pynvml.NVML_ERROR_GPU_IS_LOST))
    with pytest.raises(nvml.NvmlCallError) as exc:
        backend._call(raising(pynvml.NVML_ERROR_UNKNOWN))
    assert exc.value.code == pynvml.NVML_ERROR_UNKNOWN
    monkeypatch.setattr(pynvml, "nvmlEventSetWait", raising(pynvml.NVML_ERROR_TIMEOUT))
    assert backend.event_set_wait(object(), 10) is None  # a wait that times out is "no event"


def test_the_real_backend_decodes_field_values_by_type(monkeypatch):
    """nvmlDeviceGetFieldValues entries are read per nvmlReturn and valueType from pynvml's own struct."""
    backend = PynvmlBackend.__new__(PynvmlBackend)
    backend._n = pynvml
    backend._handles = {}

    def fake_get_field_values(handle, field_ids):
        values = (pynvml.c_nvmlFieldValue_t * 4)()
        values[0].nvmlReturn, values[0].valueType = 0, pynvml.NVML_VALUE_TYPE_DOUBLE
        values[0].value.dVal = 71.5
        values[1].nvmlReturn, values[1].valueType = 0, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        values[1].value.uiVal = 18
        values[2].nvmlReturn, values[2].valueType = 0, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        values[2].value.ullVal = 2**40 + 3
        values[3].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    monkeypatch.setattr(pynvml, "nvmlDeviceGetFieldValues", fake_get_field_values)
    got = backend.field_values(None, [(82, 0), (91, 0), (138, 0xFFFFFFFF), (139, 0xFFFFFFFF)])
    assert got == [(0, 71.5), (0, 18), (0, 2**40 + 3), (pynvml.NVML_ERROR_NOT_SUPPORTED, None)]


# -- GPU fabric information (NVL72 / multi-node NVLink) ----------------------------------------------
CLUSTER = bytes.fromhex("9a1d5c3e27b04f6a8c11d2e3f4a5b6c7")
HEALTHY_MASK = fabric.HEALTHY_MASK


def test_fabric_info_fills_the_gpu_columns_and_the_nvlink_domain():
    fake = FakeNvml.hopper(3)
    fake.gpus[0].values["gpu_fabric_info"] = FabricInfo(CLUSTER, 0, 32766, 3, HEALTHY_MASK, 1)
    # degraded bandwidth, access-timeout recovery, insufficient NVLinks, fabric manager gone; limited capacity
    bad = (HEALTHY_MASK & ~0x3 & ~(0x3 << 6) & ~(0xF << 8) & ~(0x3 << 14)) | 1 | 1 << 6 | 5 << 8 | 2 << 14
    fake.gpus[1].values["gpu_fabric_info"] = FabricInfo(CLUSTER, 0, 32766, 3, bad, 3)
    # registering: the UUID is not there yet, the status not valid, no domain
    fake.gpus[2].values["gpu_fabric_info"] = FabricInfo(bytes(16), 0, 0, 2, 0, 0)
    src = NvmlSource("n", backend=fake, xid_events=False)
    g0, g1, g2 = _sweep(src)["gpu"]
    assert g0["fabric_cluster_uuid"] == "9a1d5c3e-27b0-4f6a-8c11-d2e3f4a5b6c7"
    assert g0["nvlink_domain"] == "9a1d5c3e-27b0-4f6a-8c11-d2e3f4a5b6c7/32766"
    assert (g0["fabric_state"], g0["fabric_status"], g0["fabric_clique_id"]) == (3, 0, 32766)
    assert (g0["fabric_degraded_bw"], g0["fabric_route_recovery"], g0["fabric_route_unhealthy"],
            g0["fabric_access_timeout_recovery"], g0["fabric_incorrect_configuration"],
            g0["fabric_gfm_disconnected"], g0["fabric_health_summary"]) == (False, False, False, False, 1, False, 1)
    assert g0["fabric_health_mask"] == HEALTHY_MASK
    assert (g1["fabric_degraded_bw"], g1["fabric_access_timeout_recovery"], g1["fabric_incorrect_configuration"],
            g1["fabric_gfm_disconnected"], g1["fabric_health_summary"]) == (True, True, 5, True, 3)
    assert g1["fabric_route_recovery"] is False
    assert g2["fabric_state"] == 2 and g2["fabric_cluster_uuid"] is None and g2["nvlink_domain"] is None
    # a mask of NOT_SUPPORTED fields decodes to nulls, not to "healthy"
    assert g2["fabric_degraded_bw"] is None and g2["fabric_incorrect_configuration"] is None
    assert g2["fabric_health_summary"] is None and src.errors == 0


def test_fabric_info_unsupported_is_null_not_an_error():
    fake = FakeNvml.hopper(2)  # H100-like: no fabric information at all (NOT_SUPPORTED)
    fake.gpus[1].values["gpu_fabric_info"] = FabricInfo(bytes(16), 0, 0, 0, 0, 0)  # state NOT_SUPPORTED
    src = NvmlSource("n", backend=fake, xid_events=False)
    for row in _sweep(src)["gpu"]:
        assert all(row[c] is None for c in fabric.GPU_COLUMNS), row
        assert row["power_w"] is not None
    assert src.errors == 0


def test_a_registered_gpu_that_failed_has_no_domain():
    fake = FakeNvml.hopper(1)
    fake.gpus[0].values["gpu_fabric_info"] = FabricInfo(CLUSTER, pynvml.NVML_ERROR_UNKNOWN, 7, 3, HEALTHY_MASK, 2)
    (row,) = _sweep(NvmlSource("n", backend=fake, xid_events=False))["gpu"]
    assert row["fabric_status"] == pynvml.NVML_ERROR_UNKNOWN and row["nvlink_domain"] is None
    assert row["fabric_cluster_uuid"] is not None and row["fabric_health_summary"] == 2


def _fill(version_wanted=None, **values):
    """A stand-in for pynvml's fabric-info call that fills the struct it is handed, as libnvidia-ml does."""
    def fn(handle, ref):
        info = ref._obj
        if version_wanted is not None and getattr(info, "version", None) != version_wanted:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        info.clusterUuid[:] = list(CLUSTER)
        for k, v in values.items():
            setattr(info, k, v)
        return 0
    return fn


def _raising(code):
    def fn(*args):
        raise pynvml.NVMLError(code)
    return fn


def test_the_fabric_structs_are_the_headers():
    # nvml.h: a 16-byte cluster UUID, an unsigned-char state, and NVML_STRUCT_VERSION's version words,
    # which the binding also exports (where it does)
    assert ctypes.sizeof(nvml._FabricInfoV1) == 28
    assert nvml._versioned(nvml._FabricInfoV2, 2).version == 0x02000024
    assert nvml._versioned(nvml._FabricInfoV3, 3).version == 0x03000028
    for name, struct, version in (("nvmlGpuFabricInfo_v2", nvml._FabricInfoV2, 2),
                                  ("nvmlGpuFabricInfo_v3", nvml._FabricInfoV3, 3)):
        if hasattr(pynvml, name):
            assert nvml._versioned(struct, version).version == getattr(pynvml, name)
    assert nvml._FabricInfoV1.state.offset == 24 and nvml._FabricInfoV3.healthSummary.offset == 36


def _bare_backend():
    backend = PynvmlBackend.__new__(PynvmlBackend)  # skip nvmlInit: there is no libnvidia-ml here
    backend._n = pynvml
    backend._handles = {}
    return backend


def test_the_real_backend_reads_fabric_info_v3_then_v2_then_the_old_call(monkeypatch):
    backend = _bare_backend()
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", _fill(
        status=0, cliqueId=4, state=3, healthMask=HEALTHY_MASK, healthSummary=1))
    assert backend.gpu_fabric_info(None) == FabricInfo(CLUSTER, 0, 4, 3, HEALTHY_MASK, 1)
    # a driver that knows only struct v2 refuses v3 by version: v2 is read, without a summary
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", _fill(
        pynvml.nvmlGpuFabricInfo_v2, status=0, cliqueId=4, state=3, healthMask=HEALTHY_MASK))
    assert backend.gpu_fabric_info(None) == FabricInfo(CLUSTER, 0, 4, 3, HEALTHY_MASK, None)
    # a driver without the V entry point: the deprecated call, without a mask
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", _raising(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuFabricInfo", _fill(status=0, cliqueId=4, state=2))
    assert backend.gpu_fabric_info(None) == FabricInfo(CLUSTER, 0, 4, 2, None, None)
    # neither: unsupported, which the source stores as null
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuFabricInfo", _raising(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND))
    with pytest.raises(nvml.NvmlNotSupported):
        backend.gpu_fabric_info(None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", _raising(pynvml.NVML_ERROR_NOT_SUPPORTED))
    with pytest.raises(nvml.NvmlNotSupported):
        backend.gpu_fabric_info(None)
    # a binding that predates fabric information altogether
    monkeypatch.delattr(pynvml, "nvmlDeviceGetGpuFabricInfoV")
    monkeypatch.delattr(pynvml, "nvmlDeviceGetGpuFabricInfo")
    with pytest.raises(nvml.NvmlNotSupported):
        backend.gpu_fabric_info(None)


def test_the_fabric_constants_are_nvmls():
    assert (fabric.STATE_NOT_SUPPORTED, fabric.STATE_NOT_STARTED, fabric.STATE_IN_PROGRESS,
            fabric.STATE_COMPLETED) == (
        pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED,
        pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)
    assert fabric.UUID_LEN == pynvml.NVML_GPU_FABRIC_UUID_LEN
    assert nvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    names = {"fabric_degraded_bw": "DEGRADED_BW", "fabric_route_recovery": "ROUTE_RECOVERY",
             "fabric_route_unhealthy": "ROUTE_UNHEALTHY", "fabric_access_timeout_recovery": "ACCESS_TIMEOUT_RECOVERY",
             "fabric_incorrect_configuration": "INCORRECT_CONFIGURATION", "fabric_gfm_disconnected": "GFM_STATE"}
    assert {f.column for f in fabric.HEALTH_FIELDS} == set(names)
    # bindings before the one that added GFM_STATE (seen on the lent H200's image) give every two-bit
    # field a width of 0x11, which would read bit 4 of the next field; the header's width is 0x3
    corrected_widths = hasattr(pynvml, "NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE")
    for f in fabric.HEALTH_FIELDS:
        nv = names[f.column]
        if not hasattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{nv}"):
            continue   # a binding older than the field (13.5xx has no GFM_STATE): nothing to compare with
        assert f.shift == getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_{nv}"), f.column
        if corrected_widths:
            assert f.width == getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_{nv}"), f.column
        if f.column == "fabric_gfm_disconnected":
            assert (f.true, f.false) == (pynvml.NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE_DISCONNECTED,
                                         pynvml.NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE_CONNECTED)
        elif f.codes is None:
            assert (f.true, f.false) == (getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_{nv}_TRUE"),
                                         getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_{nv}_FALSE"))
    codes = {getattr(pynvml, f"NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_{k}", None) for k in (
        "NONE", "INCORRECT_SYSGUID", "INCORRECT_CHASSIS_SN", "NO_PARTITION", "INSUFFICIENT_NVLINKS",
        "INCOMPATIBLE_GPU_FW", "INVALID_LOCATION", "GPU_STATE_INVALID")} - {None}
    assert codes <= set(fabric.INCORRECT_CONFIGURATIONS)   # an older binding declares fewer
    if corrected_widths:
        assert codes == set(fabric.INCORRECT_CONFIGURATIONS)
    if not hasattr(pynvml, "NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY"):
        return                 # 12.5xx bindings predate struct v3's health summary
    assert set(fabric.HEALTH_SUMMARIES) == {pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY,
                                            pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY,
                                            pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY}
