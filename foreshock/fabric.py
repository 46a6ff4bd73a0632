"""The NVLink fabric as data: what NVML's GPU fabric information means, and the fabric's services.

Format: NVML's `nvmlGpuFabricInfo_v2_t` / `_v3_t` (nvml.h; declared again in collectors/nvml.py,
since nvidia-ml-py 12.5xx-13.5xx declare the old struct with the wrong UUID length), filled by
`nvmlDeviceGetGpuFabricInfoV`, and the older `nvmlGpuFabricInfo_t` of `nvmlDeviceGetGpuFabricInfo`: a cluster UUID (16 bytes), a clique id, a registration state
(NVML_GPU_FABRIC_STATE_*), a status (an nvmlReturn_t, valid once the state is COMPLETED), from v2 a
health mask of 2- and 4-bit fields (NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_* / _WIDTH_*, each field 0 when
the GPU does not support it), and from v3 a health summary (NVML_GPU_FABRIC_HEALTH_SUMMARY_*). The
values below are nvml.h's; tests/test_collectors_nvml.py checks them against the installed pynvml.

A GPU joins a multi-node NVLink domain (a GB200/GB300 NVL72 rack: 18 compute trays of 4 GPUs behind
the rack's NVLink switch trays) when the fabric manager has registered it: state COMPLETED, status
success, a non-zero cluster UUID. The cluster UUID names the fabric, the clique id the set of GPUs in
it that reach each other over NVLink; together they are the node's `nvlink_domain` (`nvlink_domain()`,
the one rule for the inventory's column). An HGX node whose NVSwitches sit on its own baseboard
registers with a zero cluster UUID: its NVLink stays inside the node, and its nvlink_domain is null.

The services the fabric depends on (FABRIC_SERVICES): `nvidia-fabricmanager` programs the NVSwitches
(on HGX/DGX nodes it runs on the node itself; on NVL72 it runs on the switch trays, and the compute
trays see it only through the GPUs' fabric state and the health mask's GFM bits), and `nvidia-imex`
shares GPU memory across the nodes of a compute domain. Who judges them and when (service/fabricunits.py):
the Fabric Manager wherever its unit is installed and not masked, since a node has it installed
because its NVSwitches need it; IMEX (COMPUTE_DOMAIN_SERVICES) only while a compute domain uses the
node, because an idle node's IMEX daemon may rightly be stopped or waiting for peers, and an alarm on
it then is false. A unit serves in the ActiveStates of SERVING_STATES and does not in those of
NOT_SERVING_STATES (systemd's ActiveState values, org.freedesktop.systemd1(5)); any other value is
one this code does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# NVML_GPU_FABRIC_STATE_* (nvml.h). NOT_SUPPORTED is stored as null, never 0.
STATE_NOT_SUPPORTED, STATE_NOT_STARTED, STATE_IN_PROGRESS, STATE_COMPLETED = 0, 1, 2, 3
STATES = {STATE_NOT_STARTED: "not started", STATE_IN_PROGRESS: "in progress", STATE_COMPLETED: "completed"}

# NVML_GPU_FABRIC_HEALTH_SUMMARY_* (nvml.h, fabric info v3). NOT_SUPPORTED (0) is stored as null.
HEALTH_SUMMARIES = {1: "healthy", 2: "unhealthy", 3: "limited capacity"}

# NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_* (nvml.h). 1 is "none": the configuration is right.
INCORRECT_CONFIGURATIONS = {
    1: "none", 2: "incorrect system GUID", 3: "incorrect chassis serial number", 4: "no partition",
    5: "insufficient NVLinks", 6: "incompatible GPU firmware", 7: "invalid location", 8: "GPU state invalid",
}

UUID_LEN = 16  # NVML_GPU_FABRIC_UUID_LEN

# The health mask of a registered GPU with nothing wrong: bandwidth full, no route recovery, routes
# healthy, no access-timeout recovery, configuration right, partition assigned (bits 12-13, 1), global
# fabric manager connected.
HEALTHY_MASK = 2 | 2 << 2 | 2 << 4 | 2 << 6 | 1 << 8 | 1 << 12 | 1 << 14


@dataclass(frozen=True)
class HealthField:
    """One field of the fabric health mask: its column, NVML's shift and width, and how its value reads.

    A two-state field (`true`, `false` given) becomes a bool column, True for the unhealthy value; a
    coded field (`codes` given) keeps NVML's number, and its `false` is the code that means nothing is
    wrong. The value 0 is NOT_SUPPORTED everywhere: null.
    """

    column: str
    shift: int  # NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_*
    width: int  # NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_* (a mask, not a bit count)
    help: str
    true: int | None = None
    false: int | None = None
    codes: dict[int, str] | None = None


HEALTH_FIELDS: tuple[HealthField, ...] = (
    HealthField("fabric_degraded_bw", 0, 0x3, "The GPU's NVLink bandwidth is degraded "
                "(NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW).", true=1, false=2),
    HealthField("fabric_route_recovery", 2, 0x3, "Route recovery is in progress "
                "(NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_RECOVERY).", true=1, false=2),
    HealthField("fabric_route_unhealthy", 4, 0x3, "A fabric route is unhealthy "
                "(NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY).", true=1, false=2),
    HealthField("fabric_access_timeout_recovery", 6, 0x3, "The GPU recovered from an NVLink access "
                "timeout (NVML_GPU_FABRIC_HEALTH_MASK_ACCESS_TIMEOUT_RECOVERY).", true=1, false=2),
    HealthField("fabric_incorrect_configuration", 8, 0xF, "NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION: "
                + ", ".join(f"{k} {v}" for k, v in INCORRECT_CONFIGURATIONS.items()) + ".",
                codes=INCORRECT_CONFIGURATIONS, false=1),
    HealthField("fabric_gfm_disconnected", 14, 0x3, "The global fabric manager is disconnected from the GPU "
                "(NVML_GPU_FABRIC_HEALTH_MASK_GFM_STATE: 1 connected, 2 disconnected).", true=2, false=1),
)


def decode_health_mask(mask: int | None) -> dict[str, bool | int | None]:
    """The health mask's fields by column; every column null when there is no mask (fabric info v1)."""
    out: dict[str, bool | int | None] = {}
    for f in HEALTH_FIELDS:
        v = None if mask is None else (mask >> f.shift) & f.width
        if v is None or v == 0:
            out[f.column] = None
        elif f.codes is not None:
            out[f.column] = v
        else:
            # A value NVML does not define for a two-state field reads as unknown, not as healthy.
            out[f.column] = True if v == f.true else False if v == f.false else None
    return out


_FIELDS = {f.column: f for f in HEALTH_FIELDS}


def unhealthy_flags(masks: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per health field, whether each mask reports it unhealthy, over an array of masks (float, NaN:
    no mask): (1.0 unhealthy, 0.0 healthy, NaN unknown; whether the field holds a value NVML does not
    define). NaN where the mask is missing or the field is 0 (NOT_SUPPORTED) or undefined, as
    decode_health_mask reads them; a coded field is unhealthy at any defined code but its `false`."""
    known = ~np.isnan(masks)
    m = np.where(known, masks, 0).astype(np.int64)
    out = {}
    for f in HEALTH_FIELDS:
        v = (m >> f.shift) & f.width
        bad = np.isin(v, [c for c in f.codes if c != f.false]) if f.codes is not None else v == f.true
        good = v == f.false
        flag = np.where(known & bad, 1.0, np.where(known & good, 0.0, np.nan))
        out[f.column] = (flag, known & (v != 0) & ~bad & ~good)
    return out


def registration_failed(state: np.ndarray, status: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU (float arrays, NaN: null), whether a GPU that should be registered with an NVLink fabric
    is not: (1.0 not completed or failed, 0.0 completed with success, NaN no fabric; whether the state is
    one nvml.h does not define, or a completed state comes without its status).

    A GPU should be registered when NVML gives it a registration state (STATES): nvml.h's
    nvmlDeviceGetGpuFabricInfo is for Hopper and later GPUs on NVSwitch systems, which the fabric manager
    registers, and answers NOT_SUPPORTED (stored as null, or read here as 0) for a GPU without a fabric
    (docs/collectors.md). That is an NVL72 tray's GPU, and an HGX GPU behind its baseboard's NVSwitches,
    registered with a zero cluster UUID, too: not registered, either reaches no NVLink peer through the
    switches. The state tells it, not the cluster UUID, which a registration that failed leaves zero; the
    status is read only once the state is COMPLETED, as nvml.h says."""
    known = ~np.isnan(state)
    defined = np.isin(state, list(STATES))
    done = state == STATE_COMPLETED
    no_status = done & np.isnan(status)
    failed = defined & (~done | (~no_status & (status != 0)))
    flag = np.where(failed, 1.0, np.where(done & (status == 0), 0.0, np.nan))
    return flag, (known & ~defined & (state != STATE_NOT_SUPPORTED)) | no_status


def with_unhealthy(mask, column: str):
    """The health mask (an int or an integer array) with the two-state field `column` at its unhealthy
    value, the other fields as they were: what NVML reports once that condition holds."""
    f = _FIELDS[column]
    if f.true is None:
        raise ValueError(f"{column} is a coded field, not a two-state one")
    return (mask & ~(f.width << f.shift)) | (f.true << f.shift)


def cluster_uuid(raw: bytes | bytearray | list[int] | None) -> str | None:
    """The 16-byte cluster UUID as 8-4-4-4-12 hex; None when it is all zeros (no multi-node domain)."""
    if raw is None:
        return None
    b = bytes(raw)
    if len(b) != UUID_LEN:
        raise ValueError(f"fabric cluster UUID of {len(b)} bytes, expected {UUID_LEN}: {b.hex()!r}")
    if not any(b):
        return None
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def nvlink_domain(cluster: str | None, clique_id: int | None) -> str | None:
    """The NVLink domain a GPU (and so its node) is in: "<cluster uuid>/<clique id>", or None."""
    if not cluster or clique_id is None:
        return None
    return f"{cluster}/{clique_id}"


@dataclass(frozen=True)
class FabricInfo:
    """One GPU's fabric information as NVML gives it (any struct version); None where the version lacks it."""

    cluster_uuid: bytes
    status: int
    clique_id: int
    state: int
    health_mask: int | None = None  # v2 and later
    health_summary: int | None = None  # v3 and later


def gpu_columns(info: FabricInfo | None) -> dict[str, object]:
    """The `gpu` table's fabric columns for one GPU: all null without fabric information or support."""
    if info is None or info.state not in STATES:
        return dict.fromkeys(GPU_COLUMNS)
    cluster = cluster_uuid(info.cluster_uuid)
    out: dict[str, object] = {
        "fabric_state": info.state,
        "fabric_status": info.status,
        "fabric_cluster_uuid": cluster,
        "fabric_clique_id": info.clique_id,
        "nvlink_domain": (nvlink_domain(cluster, info.clique_id)
                          if info.state == STATE_COMPLETED and info.status == 0 else None),
        "fabric_health_mask": info.health_mask,
        "fabric_health_summary": info.health_summary if info.health_summary in HEALTH_SUMMARIES else None,
    }
    out.update(decode_health_mask(info.health_mask))
    return out


GPU_COLUMNS: tuple[str, ...] = (
    "fabric_state", "fabric_status", "fabric_cluster_uuid", "fabric_clique_id", "nvlink_domain",
    "fabric_health_mask", "fabric_health_summary", *(f.column for f in HEALTH_FIELDS),
)

# systemd units the NVLink fabric depends on, with what each does (see the module docstring for who
# judges them, and when).
FABRIC_MANAGER = "nvidia-fabricmanager.service"
IMEX = "nvidia-imex.service"
FABRIC_SERVICES: dict[str, str] = {
    FABRIC_MANAGER: "programs the NVSwitches and registers the GPUs with the fabric",
    IMEX: "exports and imports GPU memory across the nodes of a compute domain",
}
# Judged only while a compute domain uses the node.
COMPUTE_DOMAIN_SERVICES = frozenset({IMEX})

# systemd's ActiveState values: `reloading` and `refreshing` keep serving; `activating` (a start, or an
# automatic restart's wait) and `deactivating` do not serve yet or any more; `maintenance` is a
# `systemctl clean` of a stopped unit.
SERVING_STATES = frozenset({"active", "reloading", "refreshing"})
NOT_SERVING_STATES = frozenset({"inactive", "failed", "activating", "deactivating", "maintenance"})
# LoadState of a unit an administrator has switched off for good (`systemctl mask`): not judged.
MASKED = "masked"
