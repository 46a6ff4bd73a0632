"""The Xid catalogue: what each NVIDIA driver Xid means to Foreshock, declared once as data.

Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog" (the table for Ampere and newer GPUs),
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html: for each code its mnemonic, the
GPUs it applies to (columns A100, H100, B100, GB200), its "Resolution Bucket (Immediate Action)" and, in
its trigger conditions, which Xids are consequences of others (43, 45, 94) and which need a GPU reset or a
reboot. The log line format is in ../shared/reference/signals.md ("Xid catalogue"); real lines are in
../shared/fixtures/kmsg/xid-lines.txt.

Every reader classifies an Xid through this module: the kmsg and NVML collectors and the simulator
write `events.severity` with `severity()`; the service's fatal/precursor decision and the predictor's
Xid signals read `classify()`, so a row's class never depends on who wrote it.

Severity classes (the `events.severity` vocabulary of foreshock/schema.py):

* fatal: the job on that GPU is lost and the GPU needs a reset or the node a reboot; the service
  raises a directive at once, the predictor counts it in `xid_fatal`.
* precursor: an early warning of hardware wear (a row remapped, a high corrected-ECC rate, a
  Nonfatal NVLink5 error); the service counts it, the predictor counts it in `xid_precursor`.
* application: the application faulted or was torn down; the GPU is healthy. No directive; the
  predictor counts it in `xid_application`.
* info: recorded, and nothing else.

NVLink5 Xids 144-150 carry `Fatal` or `Nonfatal` in their message (the catalogue decodes them from
intrInfo/errorStatus, WORKFLOW_NVLINK5_ERR); their class is read from that token, and without one they
are info.

Context (`collateral`): some Xids are logged on healthy GPUs as well when what they share fails, a
job torn down or crashed (45, 43, 13, ...), a GPU of its NVLink domain lost or a link of the domain
taken down (74, 144-150, 155), the domain's power (79). On one node alone such an Xid keeps its class;
on many nodes of one job or NVLink domain within seconds the control plane records one job event
instead of a fault on each node (service/xidcontext.py). Memory and firmware Xids (48, 63, 64, 92, 95,
119, 120, 140) are never collateral: an application cannot cause a DBE on another node.

Cancel pairs (`cancels`): an Xid that another one cancels names a condition that holds until then
(163, power smoothing disengaged, until 162 re-engages it); `outstanding_until()` names them.

An unknown Xid (one outside CATALOGUE, NVML's 999 "unknown Xid", a null code) is UNKNOWN: severity
info everywhere. It is written to `events` as it came (code and message), the kmsg and NVML collectors
count it (`unknown_xids`) and log the first one, the service raises nothing for it, and the predictor
counts it in no Xid signal. A new driver's new Xid is visible in the events table before anyone
classifies it, and it never raises an alarm by default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEVERITIES = ("fatal", "precursor", "application", "info")

# NVIDIA's immediate-action buckets, in words (the catalogue's own names are the keys).
RESOLUTIONS: dict[str, str] = {
    "IGNORE": "no action",
    "RESTART_APP": "restart the application",
    "RESET_GPU": "reset the GPU (nvidia-smi -r, or a reboot)",
    "RESTART_BM": "reboot the node",
    "CONTACT_SUPPORT": "contact NVIDIA support",
    "WORKFLOW_XID_45": "alone: restart Fabric Manager; with other Xids: follow them",
    "WORKFLOW_XID_48": "reset the GPU; with Xid 63/64 follow those; check the SRAM DBE threshold",
    "WORKFLOW_NVLINK_ERR": "decode the NVLink error registers; reset the GPU or reboot to clear the link",
    "WORKFLOW_NVLINK5_ERR": "decode intrInfo/errorStatus (the catalogue's 'XID 144-150 Decode')",
    "XID_154": "take the recovery action its message names (about another Xid)",
    "NONE": "the catalogue lists no action",
    "UNKNOWN": "not in the catalogue: look the code up in NVIDIA's",
}

A100, H100, B100, GB200 = "A100", "H100", "B100", "GB200"
ALL_GPUS = (A100, H100, B100, GB200)
BLACKWELL = (B100, GB200)


@dataclass(frozen=True)
class XidInfo:
    code: int
    name: str              # NVIDIA's mnemonic
    severity: str          # one of SEVERITIES (for token-classed Xids: the class without a token)
    resolution: str        # NVIDIA's immediate-action bucket, a key of RESOLUTIONS
    solo: bool             # on its own, on one node, it names that node's GPU as faulty
    generations: tuple[str, ...]   # the catalogue's "Applies to" columns that say YES
    cancels: tuple[int, ...] = ()  # an earlier Xid of these codes on the same GPU no longer holds
    collateral: bool = False  # logged on healthy GPUs too when a job or NVLink domain fails as a whole
    nvlink: bool = False   # counted in the predictor's xid_nvlink signal
    token: bool = False    # class read from the message's Fatal/Nonfatal token
    example: str = ""      # a message as the driver prints it, after the pid and name


def _x(code, name, severity, resolution, solo, generations=ALL_GPUS, **kw) -> XidInfo:
    return XidInfo(code, name, severity, resolution, solo, generations, **kw)


def _nvlink5(code: int, unit: str) -> XidInfo:
    return _x(code, f"NVLINK_{unit}_ERROR", "info", "WORKFLOW_NVLINK5_ERR", True, BLACKWELL,
              nvlink=True, token=True, collateral=True)


_ENTRIES = (
    _x(13, "ROBUST_CHANNEL_GR_EXCEPTION", "application", "RESTART_APP", False, collateral=True,
       example="Graphics SM Warp Exception on (GPC 4, TPC 1, SM 0): Illegal Instruction Parameter"),
    _x(31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "application", "RESTART_APP", False, collateral=True,
       example="channel 0x0000000c, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC2 GPCCLIENT_PROP_0 faulted "
               "@ 0x7f3a_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"),
    _x(43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "application", "IGNORE", False, collateral=True,
       example="Ch 00000010, engmask 00000101"),
    # Logged whenever the driver tears an application down (Ctrl-C, sigkill, a GPU reset, a peer's crash):
    # on many nodes of one job at its end it is the job's teardown, not a fault of each node.
    _x(45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "application", "WORKFLOW_XID_45", False, collateral=True,
       example="Ch 00000001 caused by previous Xid 149"),
    _x(48, "ROBUST_CHANNEL_GPU_ECC_DBE", "fatal", "WORKFLOW_XID_48", True,
       example="An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at physAddr "
               "0x7fffa8860 partition 7, subpartition 1."),
    _x(62, "PMU_HALT_ERROR", "fatal", "RESET_GPU", True),
    # A remap is the memory repairing itself; only its failure (64) or a DBE (48) is the fault.
    _x(63, "INFOROM_DRAM_RETIREMENT_EVENT", "precursor", "IGNORE", False,
       example="Row Remapper: New row marked for remapping, reset gpu to activate."),
    _x(64, "INFOROM_DRAM_RETIREMENT_FAILURE", "fatal", "RESET_GPU", True,
       example="Row Remapper: Row remapping failed. Row remapping is not available, remapped rows are exhausted."),
    _x(68, "ROBUST_CHANNEL_NVDEC0_ERROR", "application", "RESTART_APP", False, collateral=True),
    _x(69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "application", "RESTART_APP", False, collateral=True),
    _x(74, "NVLINK_ERROR", "fatal", "WORKFLOW_NVLINK_ERR", True, (A100, H100), nvlink=True, collateral=True,
       example="NVLink: fatal error detected on link 7(0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0)"),
    # Alone: that GPU's fault. On many nodes of one job or NVLink domain within seconds: what they share
    # failed (the job's teardown, the domain's power or switch tray), not each node's GPU.
    _x(79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "fatal", "RESTART_BM", True, collateral=True,
       example="GPU has fallen off the bus."),
    _x(92, "EXCESSIVE_SBE_INTERRUPTS", "precursor", "IGNORE", False,
       example="High single-bit ECC error rate detected."),
    # Contained to one application: that application restarts, the others run on.
    _x(94, "ROBUST_CHANNEL_CONTAINED_ERROR", "application", "RESTART_APP", False, collateral=True,
       example="Contained: SM (0x1). RST: No, D-RST: No"),
    _x(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "fatal", "RESET_GPU", True,
       example="Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No"),
    # A context switch that timed out: a hung or torn-down application can cause it on every GPU it ran on.
    _x(109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "fatal", "RESET_GPU", True, collateral=True),
    _x(119, "GSP_RPC_TIMEOUT", "fatal", "RESET_GPU", True,
       example="Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) "
               "(0x90cc0301 0xc)."),
    _x(120, "GSP_ERROR", "fatal", "RESET_GPU", True, example="GSP task exception: GSP Error: Task 1 raised error code 0x5"),
    _x(136, "ALI_TRAINING_FAIL", "fatal", "RESET_GPU", True, (H100,)),
    # An illegal peer-to-peer access over NVLink reported by the remote MMU (usually an application bug);
    # seen followed by 94.
    _x(137, "NVLINK_PRIV_ERR", "precursor", "IGNORE", False, nvlink=True),
    _x(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "fatal", "RESET_GPU", True),
    _nvlink5(144, "SAW"),
    _nvlink5(145, "RLW"),
    _nvlink5(146, "TLW"),
    _nvlink5(147, "TREX"),
    _nvlink5(148, "NVLPW_CTRL"),
    _nvlink5(149, "NETIR"),
    _nvlink5(150, "MSE"),
    _x(154, "GPU_RECOVERY_ACTION_CHANGED", "info", "XID_154", False),
    # Link-down events flagged intentional: fatal to the job on that link, no verdict on the hardware.
    _x(155, "NVLINK_SW_DEFINED_ERROR", "fatal", "RESET_GPU", False, BLACKWELL, collateral=True),
    _x(162, "PSHC_REENGAGED", "info", "NONE", False, BLACKWELL, cancels=(163,)),
    _x(163, "PSHC_DISENGAGED", "info", "NONE", False, BLACKWELL),
)

CATALOGUE: dict[int, XidInfo] = {e.code: e for e in _ENTRIES}

UNKNOWN = XidInfo(-1, "UNKNOWN", "info", "UNKNOWN", False, ())

# The kernel's "GPU ... has fallen off the bus" line without an Xid is the same report as this Xid.
FALLEN_OFF_THE_BUS = 79

# code -> the codes that cancel it: a condition that holds from that Xid until one of those
_CANCELLED_BY: dict[int, tuple[int, ...]] = {}
for _e in _ENTRIES:
    for _c in _e.cancels:
        _CANCELLED_BY[_c] = _CANCELLED_BY.get(_c, ()) + (_e.code,)

_TOKEN_RE = re.compile(r"\b(Nonfatal|Non-fatal|Fatal)\b", re.IGNORECASE)


def lookup(code: int | float | None) -> XidInfo:
    """The catalogue entry of `code`, or UNKNOWN (null, NaN, out of range or not catalogued)."""
    if code is None or code != code:  # None or NaN
        return UNKNOWN
    return CATALOGUE.get(int(code), UNKNOWN)


def outstanding_until(code: int | float | None) -> tuple[int, ...]:
    """The Xids that cancel `code` (163 -> (162,)); () when nothing cancels it."""
    info = lookup(code)
    return _CANCELLED_BY.get(info.code, ()) if info is not UNKNOWN else ()


def severity(code: int | None, message: str = "") -> str:
    """The class a collector writes for an Xid line: the catalogue's, or for 144-150 the message's token."""
    info = lookup(code)
    if info.token:
        m = _TOKEN_RE.search(message or "")
        if m:
            return "fatal" if m.group(1).lower() == "fatal" else "precursor"
    return info.severity


def classify(code: int | float | None, row_severity: str | None = None) -> str:
    """The class a reader of an `events` row gives an Xid: the catalogue's for its code; for 144-150 the
    severity the collector read from the message's token (the row keeps no token of its own)."""
    info = lookup(code)
    if info.token and row_severity in ("fatal", "precursor"):
        return row_severity
    return info.severity

