"""Source `nvml`: GPU health and NVLink error counters through NVML, into `gpu`, `nvlink` (and `events`).

The calls are those of ../shared/reference/signals.md (nvidia-ml-py's `pynvml`, NVML header): ECC
(nvmlDeviceGetTotalEccErrors), remapped rows, NVLink per-link state and error counters
(nvmlDeviceGetNvLinkErrorCounter), field values 82 (HBM temperature), 91 (link count), 138/139 (NVLink
TX/RX KiB) through nvmlDeviceGetFieldValues with a check of every entry's nvmlReturn, temperature
(nvmlDeviceGetTemperatureV), power (mW -> W), energy (mJ -> J), clocks, clock-event reasons, PCIe
replays/gen/width, utilisation, and the GPU's NVLink fabric information (nvmlDeviceGetGpuFabricInfoV,
struct v3 then v2, or nvmlDeviceGetGpuFabricInfo on drivers without it; what it means:
foreshock/fabric.py). Xid events come from an NVML event set on their own thread.

NVML is reached only through `NvmlBackend`, a narrow interface with exactly these calls. `PynvmlBackend`
is the real side; `FakeNvml` stands in where there is no GPU. Outcomes: no libnvidia-ml / no driver ->
hardware absent (said once); NVML_ERROR_NOT_SUPPORTED -> null; NVML_ERROR_GPU_IS_LOST -> the row's
`gpu_lost` is true (plus one `gpu_lost` event), a signal rather than missing data; any other NVML error
-> counted and logged with the GPU and call, null for that value.

What each row column comes from is the declarative table GPU_FIELDS (dcgm-exporter style).
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa

from foreshock import fabric
from foreshock import schema as sch
from foreshock import xid as xidcat

from .base import HardwareAbsent, Source, log
from .repeats import DEFAULT_WINDOW_SECONDS, XidFolder

# NVML constants (nvml.h; the same values pynvml exports), kept here so the fake needs no pynvml.
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_FUNCTION_NOT_FOUND = 13  # an older driver without this entry point: unsupported there
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25  # a driver older than the struct version asked for
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
NVML_FI_DEV_MEMORY_TEMP = 82
NVML_FI_DEV_NVLINK_LINK_COUNT = 91
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
# scopeId for "all links" in a field-value request (unconfirmed: per-link scope is the link index).
NVML_SCOPE_ALL_LINKS = 0xFFFFFFFF
NVLINK_MAX_LINKS = 18
# nvmlNvLinkErrorCounter_t -> nvlink column
NVLINK_ERROR_COUNTERS: tuple[tuple[int, str], ...] = (
    (0, "replay_errors"), (1, "recovery_errors"), (2, "crc_flit_errors"), (3, "crc_data_errors"),
    (4, "ecc_data_errors"),
)


class NvmlNotSupported(Exception):
    """NVML_ERROR_NOT_SUPPORTED: this part has no such value (store null)."""


class NvmlFunctionNotFound(NvmlNotSupported):
    """NVML_ERROR_FUNCTION_NOT_FOUND: the driver predates this entry point (unsupported, unless an older
    entry point answers instead)."""


class NvmlGpuLost(Exception):
    """NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus (a signal, not missing data)."""


class NvmlCallError(Exception):
    """Any other NVML failure, with its return code."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(f"NVML error {code}: {message}" if message else f"NVML error {code}")
        self.code = code


class NvmlBackend(Protocol):
    """The narrow interface to NVML: exactly the calls the source makes, one method per NVML call."""

    def device_count(self) -> int: ...
    def device_handle(self, index: int) -> Any: ...
    def uuid(self, h) -> str: ...
    def pci_bus_id(self, h) -> str: ...
    def temperature(self, h) -> float: ...
    def field_values(self, h, fields: list[tuple[int, int]]) -> list[tuple[int, float | int | None]]: ...
    def power_usage_mw(self, h) -> int: ...
    def total_energy_mj(self, h) -> int: ...
    def clock_mhz(self, h, clock: int) -> int: ...
    def clock_event_reasons(self, h) -> int: ...
    def total_ecc_errors(self, h, error_type: int, counter_type: int) -> int: ...
    def remapped_rows(self, h) -> tuple[int, int, int, int]: ...
    def pcie_replay_counter(self, h) -> int: ...
    def pcie_link_gen(self, h) -> int: ...
    def pcie_link_gen_max(self, h) -> int: ...
    def pcie_link_width(self, h) -> int: ...
    def pcie_link_width_max(self, h) -> int: ...
    def utilization_gpu(self, h) -> int: ...
    def nvlink_state(self, h, link: int) -> bool: ...
    def nvlink_error_counter(self, h, link: int, counter: int) -> int: ...
    def gpu_fabric_info(self, h) -> fabric.FabricInfo: ...
    def event_set_create(self) -> Any: ...
    def register_xid_events(self, h, event_set) -> None: ...
    def event_set_wait(self, event_set, timeout_ms: int) -> tuple[str | None, int] | None: ...  # (uuid, xid)
    def event_set_free(self, event_set) -> None: ...
    def shutdown(self) -> None: ...


# -- the real side ----------------------------------------------------------------------------------
# The fabric-information structs as nvml.h declares them (nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t,
# nvmlGpuFabricInfo_v3_t). They are declared here rather than taken from the binding because bindings
# have declared them wrongly: nvidia-ml-py 12.5xx-13.5xx give the deprecated struct an 80-byte
# clusterUuid (the header's is 16), so every field after it reads the zeroed tail of the buffer and a
# registered GPU looks "not supported". nvmlGpuFabricState_t is an unsigned char in the header.
class _FabricInfoV1(ctypes.Structure):
    _fields_ = [("clusterUuid", ctypes.c_ubyte * fabric.UUID_LEN), ("status", ctypes.c_uint),
                ("cliqueId", ctypes.c_uint), ("state", ctypes.c_ubyte)]


class _FabricInfoV2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_ubyte * fabric.UUID_LEN),
                ("status", ctypes.c_uint), ("cliqueId", ctypes.c_uint), ("state", ctypes.c_ubyte),
                ("healthMask", ctypes.c_uint)]


class _FabricInfoV3(ctypes.Structure):
    _fields_ = [*_FabricInfoV2._fields_, ("healthSummary", ctypes.c_ubyte)]


def _versioned(struct: type[ctypes.Structure], version: int) -> ctypes.Structure:
    """An empty struct with its version word set as NVML_STRUCT_VERSION does: sizeof | version << 24."""
    info = struct()
    info.version = ctypes.sizeof(struct) | (version << 24)
    return info


class PynvmlBackend:
    """NvmlBackend over nvidia-ml-py (`import pynvml`). Raises HardwareAbsent when NVML cannot load."""

    def __init__(self):
        try:
            import pynvml
        except ImportError as exc:  # the dependency is declared; this is a broken install
            raise HardwareAbsent(f"pynvml is not importable: {exc}") from exc
        self._n = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise HardwareAbsent(f"NVML did not initialise ({exc}): no libnvidia-ml or no driver") from exc
        self._handles: dict[Any, int] = {}

    def _call(self, fn, *args):
        n = self._n
        try:
            return fn(*args)
        except n.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == NVML_ERROR_FUNCTION_NOT_FOUND:
                raise NvmlFunctionNotFound(str(exc)) from None
            if code == NVML_ERROR_NOT_SUPPORTED:
                raise NvmlNotSupported(str(exc)) from None
            if code == NVML_ERROR_GPU_IS_LOST:
                raise NvmlGpuLost(str(exc)) from None
            raise NvmlCallError(code if code is not None else -1, str(exc)) from None

    def device_count(self):
        return self._call(self._n.nvmlDeviceGetCount)

    def device_handle(self, index):
        h = self._call(self._n.nvmlDeviceGetHandleByIndex, index)
        self._handles[id(h)] = index
        return h

    def uuid(self, h):
        v = self._call(self._n.nvmlDeviceGetUUID, h)
        return v.decode() if isinstance(v, bytes) else v

    def pci_bus_id(self, h):
        info = self._call(self._n.nvmlDeviceGetPciInfo, h)
        v = info.busId
        return v.decode() if isinstance(v, bytes) else v

    def temperature(self, h):
        return self._call(self._n.nvmlDeviceGetTemperatureV, h, NVML_TEMPERATURE_GPU)

    def field_values(self, h, fields):
        n = self._n
        values = self._call(n.nvmlDeviceGetFieldValues, h, list(fields))
        out = []
        for v in values:
            ret = int(v.nvmlReturn)
            if ret != NVML_SUCCESS:
                out.append((ret, None))
                continue
            vt = int(v.valueType)
            if vt == n.NVML_VALUE_TYPE_DOUBLE:
                out.append((ret, float(v.value.dVal)))
            elif vt == n.NVML_VALUE_TYPE_UNSIGNED_INT:
                out.append((ret, int(v.value.uiVal)))
            elif vt == n.NVML_VALUE_TYPE_UNSIGNED_LONG:
                out.append((ret, int(v.value.ulVal)))
            elif vt == n.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
                out.append((ret, int(v.value.sllVal)))
            elif vt == n.NVML_VALUE_TYPE_SIGNED_INT:
                out.append((ret, int(v.value.siVal)))
            elif vt == getattr(n, "NVML_VALUE_TYPE_UNSIGNED_SHORT", -1):
                out.append((ret, int(v.value.usVal)))
            else:
                out.append((ret, int(v.value.ullVal)))
        return out

    def power_usage_mw(self, h):
        return self._call(self._n.nvmlDeviceGetPowerUsage, h)

    def total_energy_mj(self, h):
        return self._call(self._n.nvmlDeviceGetTotalEnergyConsumption, h)

    def clock_mhz(self, h, clock):
        return self._call(self._n.nvmlDeviceGetClockInfo, h, clock)

    def clock_event_reasons(self, h):
        return self._call(self._n.nvmlDeviceGetCurrentClocksEventReasons, h)

    def total_ecc_errors(self, h, error_type, counter_type):
        return self._call(self._n.nvmlDeviceGetTotalEccErrors, h, error_type, counter_type)

    def remapped_rows(self, h):
        return tuple(self._call(self._n.nvmlDeviceGetRemappedRows, h))

    def pcie_replay_counter(self, h):
        return self._call(self._n.nvmlDeviceGetPcieReplayCounter, h)

    def pcie_link_gen(self, h):
        return self._call(self._n.nvmlDeviceGetCurrPcieLinkGeneration, h)

    def pcie_link_gen_max(self, h):
        return self._call(self._n.nvmlDeviceGetMaxPcieLinkGeneration, h)

    def pcie_link_width(self, h):
        return self._call(self._n.nvmlDeviceGetCurrPcieLinkWidth, h)

    def pcie_link_width_max(self, h):
        return self._call(self._n.nvmlDeviceGetMaxPcieLinkWidth, h)

    def utilization_gpu(self, h):
        return self._call(self._n.nvmlDeviceGetUtilizationRates, h).gpu

    def nvlink_state(self, h, link):
        return bool(self._call(self._n.nvmlDeviceGetNvLinkState, h, link))

    def nvlink_error_counter(self, h, link, counter):
        return self._call(self._n.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)

    def gpu_fabric_info(self, h):
        # Newest first: the V entry point with struct v3 (health summary), then v2 (health mask; a driver
        # that predates v3 answers ARGUMENT_VERSION_MISMATCH), then the deprecated entry point of drivers
        # without V (no mask). A binding without a call skips it.
        n = self._n
        if hasattr(n, "nvmlDeviceGetGpuFabricInfoV"):
            for struct, version in ((_FabricInfoV3, 3), (_FabricInfoV2, 2)):
                info = _versioned(struct, version)
                try:
                    self._call(self._n.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info))
                except NvmlFunctionNotFound:
                    break
                except NvmlCallError as exc:
                    if exc.code == NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
                        continue
                    raise
                return fabric.FabricInfo(bytes(info.clusterUuid), int(info.status), int(info.cliqueId),
                                         int(info.state), int(info.healthMask),
                                         int(info.healthSummary) if version == 3 else None)
        if not hasattr(n, "nvmlDeviceGetGpuFabricInfo"):
            raise NvmlNotSupported("this nvidia-ml-py has no GPU fabric information")
        info = _FabricInfoV1()
        self._call(self._n.nvmlDeviceGetGpuFabricInfo, h, ctypes.byref(info))
        return fabric.FabricInfo(bytes(info.clusterUuid), int(info.status), int(info.cliqueId), int(info.state))

    def event_set_create(self):
        return self._call(self._n.nvmlEventSetCreate)

    def register_xid_events(self, h, event_set):
        self._call(self._n.nvmlDeviceRegisterEvents, h, self._n.nvmlEventTypeXidCriticalError, event_set)

    def event_set_wait(self, event_set, timeout_ms):
        try:
            data = self._call(self._n.nvmlEventSetWait, event_set, timeout_ms)
        except NvmlCallError as exc:
            if exc.code == NVML_ERROR_TIMEOUT:
                return None
            raise
        # eventData is the Xid; the device handle is a pointer, matched back to its index by UUID.
        try:
            uuid = self.uuid(data.device)
        except Exception:  # noqa: BLE001 - a lost GPU cannot answer; the index stays unknown
            uuid = None
        return uuid, int(data.eventData)

    def event_set_free(self, event_set):
        self._call(self._n.nvmlEventSetFree, event_set)

    def shutdown(self):
        try:
            self._n.nvmlShutdown()
        except self._n.NVMLError:
            pass


# -- the fake ---------------------------------------------------------------------------------------
@dataclass
class FakeGpu:
    """One GPU of FakeNvml: values by NvmlBackend method name; a missing key is NOT_SUPPORTED."""

    uuid: str
    pci_bus_id: str
    values: dict[str, Any] = field(default_factory=dict)
    fields: dict[tuple[int, int], Any] = field(default_factory=dict)
    links: list[bool] = field(default_factory=list)
    link_counters: dict[tuple[int, int], int] = field(default_factory=dict)
    lost: bool = False
    errors: dict[str, int] = field(default_factory=dict)  # method -> NVML error code to raise


class FakeNvml:
    """NvmlBackend without a GPU: what tests and machines without NVIDIA hardware use."""

    def __init__(self, gpus: list[FakeGpu]):
        self.gpus = gpus
        self.events: collections.deque[tuple[str | None, int]] = collections.deque()
        self.calls = collections.Counter()
        self._event_cv = threading.Condition()

    @classmethod
    def hopper(cls, n: int = 8, links: int = 18) -> FakeNvml:
        """n H100-like GPUs with plausible values."""
        gpus = []
        for i in range(n):
            g = FakeGpu(uuid=f"GPU-fake-{i:04d}", pci_bus_id=f"00000000:{0x18 + i * 0x10:02X}:00.0")
            g.values.update(temperature=40 + i, power_usage_mw=350_000 + i, total_energy_mj=10_000_000 + i,
                            clock_mhz={NVML_CLOCK_SM: 1980, NVML_CLOCK_MEM: 2619}, clock_event_reasons=0,
                            total_ecc_errors={(0, 0): 0, (1, 0): 0, (0, 1): 3, (1, 1): 0},
                            remapped_rows=(0, 0, 0, 0), pcie_replay_counter=0, pcie_link_gen=5,
                            pcie_link_gen_max=5, pcie_link_width=16, pcie_link_width_max=16,
                            utilization_gpu=97)
            g.fields = {(NVML_FI_DEV_MEMORY_TEMP, 0): 45.0, (NVML_FI_DEV_NVLINK_LINK_COUNT, 0): links,
                        (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_SCOPE_ALL_LINKS): 1000 * (i + 1),
                        (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_SCOPE_ALL_LINKS): 2000 * (i + 1)}
            g.links = [True] * links
            g.link_counters = {(lk, c): 0 for lk in range(links) for c in range(4)}  # no ECC_DATA: NVLink4
            gpus.append(g)
        return cls(gpus)

    def _gpu(self, h) -> FakeGpu:
        return self.gpus[h]

    def _get(self, h, method, *key):
        self.calls[method] += 1
        g = self._gpu(h)
        if g.lost:
            raise NvmlGpuLost("GPU is lost")
        if method in g.errors:
            raise NvmlCallError(g.errors[method], method)
        if method not in g.values:
            raise NvmlNotSupported(method)
        v = g.values[method]
        if key:
            if key[0] not in v:
                raise NvmlNotSupported(f"{method}{key}")
            v = v[key[0]]
        return v

    def device_count(self):
        return len(self.gpus)

    def device_handle(self, index):
        return index

    def uuid(self, h):
        return self._gpu(h).uuid

    def pci_bus_id(self, h):
        return self._gpu(h).pci_bus_id

    def temperature(self, h):
        return self._get(h, "temperature")

    def field_values(self, h, fields):
        self.calls["field_values"] += 1
        g = self._gpu(h)
        if g.lost:
            raise NvmlGpuLost("GPU is lost")
        return [(NVML_SUCCESS, g.fields[f]) if f in g.fields else (NVML_ERROR_NOT_SUPPORTED, None)
                for f in fields]

    def power_usage_mw(self, h):
        return self._get(h, "power_usage_mw")

    def total_energy_mj(self, h):
        return self._get(h, "total_energy_mj")

    def clock_mhz(self, h, clock):
        return self._get(h, "clock_mhz", clock)

    def clock_event_reasons(self, h):
        return self._get(h, "clock_event_reasons")

    def total_ecc_errors(self, h, error_type, counter_type):
        return self._get(h, "total_ecc_errors", (error_type, counter_type))

    def remapped_rows(self, h):
        return self._get(h, "remapped_rows")

    def pcie_replay_counter(self, h):
        return self._get(h, "pcie_replay_counter")

    def pcie_link_gen(self, h):
        return self._get(h, "pcie_link_gen")

    def pcie_link_gen_max(self, h):
        return self._get(h, "pcie_link_gen_max")

    def pcie_link_width(self, h):
        return self._get(h, "pcie_link_width")

    def pcie_link_width_max(self, h):
        return self._get(h, "pcie_link_width_max")

    def utilization_gpu(self, h):
        return self._get(h, "utilization_gpu")

    def nvlink_state(self, h, link):
        g = self._gpu(h)
        if g.lost:
            raise NvmlGpuLost("GPU is lost")
        if link >= len(g.links):
            raise NvmlNotSupported("nvlink_state")
        return g.links[link]

    def nvlink_error_counter(self, h, link, counter):
        self.calls["nvlink_error_counter"] += 1
        g = self._gpu(h)
        if g.lost:
            raise NvmlGpuLost("GPU is lost")
        if (link, counter) not in g.link_counters:
            raise NvmlNotSupported("nvlink_error_counter")
        return g.link_counters[(link, counter)]

    def gpu_fabric_info(self, h):
        return self._get(h, "gpu_fabric_info")

    def event_set_create(self):
        return "fake-event-set"

    def register_xid_events(self, h, event_set):
        pass

    def push_xid(self, gpu: int, xid: int) -> None:
        with self._event_cv:
            self.events.append((self.gpus[gpu].uuid, xid))
            self._event_cv.notify_all()

    def event_set_wait(self, event_set, timeout_ms):
        with self._event_cv:
            if not self.events:
                self._event_cv.wait(timeout_ms / 1000)
            if not self.events:
                return None
            return self.events.popleft()

    def event_set_free(self, event_set):
        pass

    def shutdown(self):
        pass


# -- the field table --------------------------------------------------------------------------------
# (column, backend method, extra args, scale). scale normalises units: mW -> W, mJ -> J.
GPU_FIELDS: tuple[tuple[str, str, tuple, float | None], ...] = (
    ("temperature_c", "temperature", (), None),
    ("power_w", "power_usage_mw", (), 1e-3),
    ("energy_j", "total_energy_mj", (), 1e-3),
    ("sm_clock_mhz", "clock_mhz", (NVML_CLOCK_SM,), None),
    ("mem_clock_mhz", "clock_mhz", (NVML_CLOCK_MEM,), None),
    ("utilization_pct", "utilization_gpu", (), None),
    ("clock_event_reasons", "clock_event_reasons", (), None),
    ("ecc_corrected_volatile", "total_ecc_errors", (NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC), None),
    ("ecc_uncorrected_volatile", "total_ecc_errors", (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC), None),
    ("ecc_corrected_aggregate", "total_ecc_errors", (NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_AGGREGATE_ECC), None),
    ("ecc_uncorrected_aggregate", "total_ecc_errors", (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC), None),
    ("pcie_replay_counter", "pcie_replay_counter", (), None),
    ("pcie_link_gen", "pcie_link_gen", (), None),
    ("pcie_link_gen_max", "pcie_link_gen_max", (), None),
    ("pcie_link_width", "pcie_link_width", (), None),
    ("pcie_link_width_max", "pcie_link_width_max", (), None),
)
# Field-value API entries: (field id, scope) -> (table, column)
FIELD_VALUE_FIELDS: tuple[tuple[tuple[int, int], str, str], ...] = (
    ((NVML_FI_DEV_MEMORY_TEMP, 0), "gpu", "hbm_temperature_c"),
    ((NVML_FI_DEV_NVLINK_LINK_COUNT, 0), "nvlink", "links_total"),
    ((NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_SCOPE_ALL_LINKS), "nvlink", "tx_kib"),
    ((NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_SCOPE_ALL_LINKS), "nvlink", "rx_kib"),
)


def normalize_bus_id(bus_id: str) -> str:
    """NVML's "00000000:18:00.0" -> "0000:18:00.0" (the form kmsg events use)."""
    s = bus_id.strip().lower()
    dom, _, rest = s.partition(":")
    return f"{dom[-4:].rjust(4, '0')}:{rest}" if rest else s


class _XidWatcher(threading.Thread):
    """Waits on an NVML event set for Xid critical errors; rows go to a bounded buffer for the sweep."""

    def __init__(self, source: NvmlSource, wait_ms: int = 500, max_pending: int = 10_000):
        super().__init__(name="foreshock-nvml-xid", daemon=True)
        self.source = source
        self.wait_ms = wait_ms
        self.pending: collections.deque[dict] = collections.deque(maxlen=max_pending)
        self._stopping = threading.Event()
        self.event_set = None

    def run(self) -> None:
        src, nv = self.source, self.source.backend
        try:
            self.event_set = nv.event_set_create()
            for i, h in enumerate(src._handles):
                try:
                    nv.register_xid_events(h, self.event_set)
                except (NvmlNotSupported, NvmlGpuLost):
                    continue
                except NvmlCallError as exc:
                    src.error(f"gpu{i} nvmlDeviceRegisterEvents", exc)
        except NvmlCallError as exc:
            src.error("nvmlEventSetCreate", exc)
            return
        while not self._stopping.is_set():
            try:
                ev = nv.event_set_wait(self.event_set, self.wait_ms)
            except NvmlCallError as exc:
                src.error("nvmlEventSetWait", exc)
                self._stopping.wait(1.0)
                continue
            except NvmlGpuLost:
                continue
            if ev is None:
                continue
            uuid, xid = ev
            gpu = src._by_uuid.get(uuid)
            src.saw_xid(xid)
            self.pending.append({
                "ts": time.time_ns(), "node": src.node, "kind": "xid", "source": "nvml",
                "severity": xidcat.severity(xid), "xid": xid if xid < 1 << 31 else None, "gpu": gpu,
                "pci_bus_id": src._pci[gpu] if gpu is not None else None,
                "message": "nvmlEventTypeXidCriticalError" + (" (999: unknown Xid)" if xid == 999 else ""),
            })
        try:
            nv.event_set_free(self.event_set)
        except Exception as exc:  # noqa: BLE001 - shutting down; nothing to recover
            log.debug("nvmlEventSetFree: %s", exc)

    def drain(self) -> list[dict]:
        out = []
        while self.pending:
            out.append(self.pending.popleft())
        return out

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        self.join(timeout)


class NvmlSource(Source):
    name = "nvml"
    tables = ("gpu", "nvlink", "nvlink_link", "events")

    def __init__(self, node: str, *, backend: NvmlBackend | None = None, nvlink_links: bool = False,
                 xid_events: bool = True, xid_fold_seconds: float = DEFAULT_WINDOW_SECONDS):
        super().__init__(node)
        self.folder = XidFolder(xid_fold_seconds)
        self.nvlink_links = nvlink_links
        self.backend = backend
        self._handles: list = []
        self._uuid: list[str | None] = []
        self._pci: list[str | None] = []
        self._by_uuid: dict[str, int] = {}
        self._lost: set[int] = set()
        self._watcher: _XidWatcher | None = None
        self._xid_events = xid_events
        self._started = False

    def _start(self) -> bool:
        if self._started:
            return self.backend is not None
        self._started = True
        if self.backend is None:
            try:
                self.backend = PynvmlBackend()
            except HardwareAbsent as exc:
                self.hardware_absent("%s", exc)
                return False
        nv = self.backend
        try:
            count = nv.device_count()
        except (NvmlCallError, NvmlNotSupported, NvmlGpuLost) as exc:
            self.error("nvmlDeviceGetCount", exc)
            return False
        for i in range(count):
            try:
                h = nv.device_handle(i)
            except (NvmlCallError, NvmlGpuLost, NvmlNotSupported) as exc:
                self.error(f"nvmlDeviceGetHandleByIndex({i})", exc)
                h = None
            self._handles.append(h)
            uuid = pci = None
            if h is not None:
                try:
                    uuid = nv.uuid(h)
                    pci = normalize_bus_id(nv.pci_bus_id(h))
                except (NvmlCallError, NvmlGpuLost, NvmlNotSupported) as exc:
                    self.error(f"gpu{i} identity", exc)
            self._uuid.append(uuid)
            self._pci.append(pci)
            if uuid:
                self._by_uuid[uuid] = i
        if not count:
            self.hardware_absent("NVML reports no GPUs")
        elif self._xid_events:
            self._watcher = _XidWatcher(self)
            self._watcher.start()
        return True

    def _value(self, i: int, h, method: str, args: tuple):
        """One NVML call: the value, None for unsupported; raises NvmlGpuLost."""
        try:
            return getattr(self.backend, method)(h, *args)
        except NvmlNotSupported:
            return None
        except NvmlCallError as exc:
            self.error(f"gpu{i} {method}{args or ''}", exc)
            return None

    def sweep(self, ts_ns: int) -> dict[str, pa.Table]:
        if not self._start():
            return {}
        gpu_rows, nvl_rows, link_rows, events = [], [], [], []
        for i, h in enumerate(self._handles):
            if h is None:
                continue
            row = {"ts": ts_ns, "node": self.node, "gpu": i, "uuid": self._uuid[i],
                   "pci_bus_id": self._pci[i], "gpu_lost": False}
            nvl = {"ts": ts_ns, "node": self.node, "gpu": i}
            try:
                for column, method, args, scale in GPU_FIELDS:
                    v = self._value(i, h, method, args)
                    row[column] = v * scale if (v is not None and scale) else v
                row.update(fabric.gpu_columns(self._value(i, h, "gpu_fabric_info", ())))
                rr = self._value(i, h, "remapped_rows", ())
                if rr is not None:
                    row.update(remapped_rows_correctable=rr[0], remapped_rows_uncorrectable=rr[1],
                               remapped_rows_pending=bool(rr[2]), remapped_rows_failure=bool(rr[3]))
                fv = self._field_values(i, h)
                row["hbm_temperature_c"] = fv.get("hbm_temperature_c")
                links_total = fv.get("links_total")
                if links_total:
                    nvl.update(tx_kib=fv.get("tx_kib"), rx_kib=fv.get("rx_kib"),
                               links_total=links_total)
                    self._nvlink(i, h, int(links_total), nvl, link_rows, ts_ns)
                    nvl_rows.append(nvl)
                if i in self._lost:
                    self._lost.discard(i)
            except NvmlGpuLost:
                row = {k: row[k] for k in ("ts", "node", "gpu", "uuid", "pci_bus_id")}
                row["gpu_lost"] = True
                if i not in self._lost:
                    self._lost.add(i)
                    events.append({"ts": ts_ns, "node": self.node, "kind": "gpu_lost", "source": "nvml",
                                   "severity": "fatal", "gpu": i, "pci_bus_id": self._pci[i],
                                   "message": "NVML_ERROR_GPU_IS_LOST"})
            gpu_rows.append(row)
        if self._watcher is not None:
            for row in self._watcher.drain():
                events.extend(self.folder.feed(row, ts_ns))
        events.extend(self.folder.due(ts_ns))
        out = {}
        if gpu_rows:
            out["gpu"] = sch.to_table("gpu", gpu_rows)
        if nvl_rows:
            out["nvlink"] = sch.to_table("nvlink", nvl_rows)
        if link_rows:
            out["nvlink_link"] = sch.to_table("nvlink_link", link_rows)
        if events:
            out["events"] = sch.to_table("events", events)
        return out

    def _field_values(self, i: int, h) -> dict[str, Any]:
        req = [f for f, _, _ in FIELD_VALUE_FIELDS]
        try:
            res = self.backend.field_values(h, req)
        except NvmlNotSupported:
            return {}
        except NvmlCallError as exc:
            self.error(f"gpu{i} nvmlDeviceGetFieldValues", exc)
            return {}
        out = {}
        for (fid, _table, column), (ret, value) in zip(FIELD_VALUE_FIELDS, res):
            if ret == NVML_SUCCESS:
                out[column] = value
            elif ret == NVML_ERROR_GPU_IS_LOST:
                raise NvmlGpuLost(f"field {fid[0]}")
            elif ret != NVML_ERROR_NOT_SUPPORTED:
                self.error(f"gpu{i} field {fid[0]}", f"nvmlReturn {ret}")
        return out

    def _nvlink(self, i, h, links_total, nvl, link_rows, ts_ns) -> None:
        nv = self.backend
        sums: dict[str, int | None] = {col: None for _, col in NVLINK_ERROR_COUNTERS}
        up = 0
        for link in range(min(links_total, NVLINK_MAX_LINKS * 2)):
            try:
                state = nv.nvlink_state(h, link)
            except NvmlNotSupported:
                continue
            except NvmlCallError as exc:
                self.error(f"gpu{i} nvmlDeviceGetNvLinkState({link})", exc)
                continue
            up += bool(state)
            lrow = {"ts": ts_ns, "node": self.node, "gpu": i, "link": link, "up": bool(state)}
            for counter, col in NVLINK_ERROR_COUNTERS:
                v = self._value(i, h, "nvlink_error_counter", (link, counter))
                lrow[col] = v
                if v is not None:
                    sums[col] = (sums[col] or 0) + v
            if self.nvlink_links:
                link_rows.append(lrow)
        nvl.update(sums)
        nvl["links_up"] = up

    def flush(self, ts_ns: int) -> dict[str, pa.Table]:
        rows = []
        if self._watcher is not None:
            for row in self._watcher.drain():
                rows.extend(self.folder.feed(row, ts_ns))
        rows.extend(self.folder.flush(ts_ns))
        return {"events": sch.to_table("events", rows)} if rows else {}

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self.backend is not None and self._started:
            self.backend.shutdown()
