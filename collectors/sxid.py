"""NVSwitch SXid lines of the kernel log (the `nvidia-nvswitch` driver) -> `events` rows of kind `sxid`.

Format: the driver's NVSWITCH_PRINT_SXID (NVIDIA open-gpu-kernel-modules,
src/common/nvswitch/kernel/inc/common_nvswitch.h) prints

    nvidia-<device>: SXid (PCI:<dddd:bb:dd.f>): <sxid, %05d>, <text>

and the reporting macros (intr_nvswitch.h, error_nvswitch.h) start <text> with the error's class:
`Fatal, Link NN <error>[ (First)]`, `Non-fatal, Link NN ...`, `Correctable, Link NN ...`, or, for errors
that are not a link's, `Fatal, <error>, instance=N, chiplet=N` and `Fatal, unhandled interrupt in ...`.
A fatal SXid is followed by lines of the same SXid without a class: `Severity N Engine instance NN
Sub-engine instance NN` and `Data {0x..., ...}`, the details of the error before them. The SXid numbers
and what to do about each are NVIDIA's Fabric Manager user guide ("NVSwitch SXid errors"). Real lines:
examples/kmsg/sxid-lines.txt.

The class comes from the line, not from the number: the driver states it, and Foreshock keeps no SXid
table. Fatal -> severity `fatal` (the NVSwitch's links or the switch itself are down until a reset: the
GPUs behind it lose their fabric); Non-fatal -> `precursor` (an uncorrected error the fabric survived);
Correctable -> `info` (the hardware corrected it; a rate of them is the predictor's to judge); a detail
line without a class -> `info`, kept so that nothing the driver said is lost.

A line that names an SXid but does not parse (truncated, garbled) is a ParseError that quotes it.
"""

from __future__ import annotations

import re

from .base import ParseError

# NVLINK_PCI_DEV_FMT is "%04x:%02x:%02x.%x": already the form the events table uses, less the case.
_SXID_RE = re.compile(
    r"\bnvidia-(?P<device>nvswitch\d{1,3}): SXid \(PCI:(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\): "
    r"(?P<sxid>\d{1,10})(?:, ?(?P<rest>.*))?$")
_CLASS_RE = re.compile(r"^(?P<cls>Fatal|Non-fatal|Correctable),\s*(?:Link (?P<link>\d{1,3})\b)?")

SEVERITY = {"Fatal": "fatal", "Non-fatal": "precursor", "Correctable": "info"}


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
    return {"kind": "sxid", "severity": SEVERITY[c.group("cls")] if c else "info", "sxid": code,
            "device": m.group("device"), "pci_bus_id": m.group("pci").lower(),
            "link": int(c.group("link")) if c and c.group("link") else None, "message": rest}
