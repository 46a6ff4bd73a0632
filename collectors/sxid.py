"""NVSwitch SXid lines of the kernel log (the `nvidia-nvswitch` driver) -> `events` rows of kind `sxid`.

Format: the driver's NVSWITCH_PRINT_SXID (NVIDIA open-gpu-kernel-modules,
src/common/nvswitch/kernel/inc/common_nvswitch.h) prints

    nvidia-<device>: SXid (PCI:<dddd:bb:dd.f>): <sxid, %05d>, <text>

and the reporting macros (intr_nvswitch.h: NVSWITCH_REPORT_FATAL, _NONFATAL, _CORRECTABLE,
_PRI_ERROR_FATAL, _PRI_ERROR_NONFATAL; error_nvswitch.h: NVSWITCH_REPORT_CORRECTABLE_DEVICE_DATA,
_CORRECTABLE_LINK_DATA, _NONFATAL_LINK) start <text> with the error's class, one of CLASSES:
`Fatal, Link NN <error>[ (First)]`, `Non-fatal, Link NN ...`, `Correctable, Link NN ...`, or, for errors
that are not a link's, `Fatal, <error>, instance=N, chiplet=N`, `Non-fatal, <error>, instance=N,
chiplet=N`, `Correctable, <error>` and `Fatal, unhandled interrupt in ...`. Each macro then records the
error in the driver's error log (nvswitch_record_error, error_nvswitch.c), which prints its details as
lines of the same SXid without a class (_nvswitch_dump_error_entry): `Severity N Engine instance NN
Sub-engine instance NN` (N: the log's severity, 1 fatal, 0 non-fatal) and one or two `Data {0x..., ...}`.
That is so after an SXid of any class, not only a fatal one (NVIDIA's Fabric Manager user guide,
"Runtime NVSwitch and GPU Errors", shows a Non-fatal SXid with `Severity 0` and `Data` lines after it).
A few reports have no class at all (`IO failure`, `Thermal Slowdown Engaged | ...`, `ALI Training
failure. Info ...`). The SXid numbers and what to do about each are the Fabric Manager user guide's
("NVSwitch SXid Errors"). Real lines: examples/kmsg/sxid-lines.txt.

The class comes from the line, not from the number: the driver states it, and Foreshock keeps no SXid
table. SEVERITY reads it: Fatal -> `fatal` (the NVSwitch's links or the switch itself are down until a
reset: the GPUs behind it lose their fabric); Non-fatal and Correctable -> `precursor`: an error the
fabric survived, uncorrected or corrected by the hardware. The driver keeps the two together, as this
reading does: both are recorded in its non-fatal error log (NVSWITCH_LOG_NONFATAL_DATA, a Correctable one
marked resolved) and both raise its non-fatal event (NVSWITCH_DEVICE_EVENT_NONFATAL), and the Fabric
Manager guide names two classes of SXid, fatal and non-fatal. The row's `message` keeps the class word,
so the two can still be told apart. A line without a class (the details of the SXid before it, or a
report the driver gives no class) -> `info` (NO_CLASS), kept so that nothing the driver said is lost and
never read as an SXid of a class.

A line that names an SXid but does not parse (truncated, garbled) is a ParseError that quotes it.
"""

from __future__ import annotations

import re

from .base import ParseError

# NVLINK_PCI_DEV_FMT is "%04x:%02x:%02x.%x": already the form the events table uses, less the case.
_SXID_RE = re.compile(
    r"\bnvidia-(?P<device>nvswitch\d{1,3}): SXid \(PCI:(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\): "
    r"(?P<sxid>\d{1,10})(?:, ?(?P<rest>.*))?$")

# The classes the driver prints, as it spells them, and the severity each is written with.
CLASSES = ("Fatal", "Non-fatal", "Correctable")
SEVERITY = {"Fatal": "fatal", "Non-fatal": "precursor", "Correctable": "precursor"}
NO_CLASS = "info"
# Every severity an sxid row gets from this parser.
SEVERITIES = frozenset(SEVERITY.values()) | {NO_CLASS}

_CLASS_RE = re.compile(r"^(?P<cls>" + "|".join(CLASSES) + r"),\s*(?:Link (?P<link>\d{1,3})\b)?")


def parse_sxid(message: str) -> dict | None:
    """A kernel log message -> an `events` row of kind sxid (without ts/node/seq/source), or None if the
    message is not an SXid line."""
    if "SXid" not in message or "nvswitch" not in message:
        return None
    m = _SXID_RE.search(message)
    if m is None:
        raise ParseError(f"SXid line that does not parse: {message[:100]!r}")
    code = int(m.group("sxid"))
    if code >= 1 << 31:
        raise ParseError(f"SXid {m.group('sxid')} out of range in {message[:100]!r}")
    rest = (m.group("rest") or "").rstrip()
    c = _CLASS_RE.match(rest)
    return {"kind": "sxid", "severity": SEVERITY[c.group("cls")] if c else NO_CLASS, "sxid": code,
            "device": m.group("device"), "pci_bus_id": m.group("pci").lower(),
            "link": int(c.group("link")) if c and c.group("link") else None, "message": rest}
