"""The nvml source over FakeNvml (no GPU here), and the real side checked against nvidia-ml-py's API."""

from __future__ import annotations

import ast
import inspect
import time

import pynvml
import pytest

from foreshock.collectors import nvml
from foreshock.collectors.nvml import FakeNvml, NvmlSource, PynvmlBackend

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
