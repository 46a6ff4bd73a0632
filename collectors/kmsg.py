"""Source `kmsg`: kernel log events (NVIDIA Xid, GPU lost, mlx5/NIC errors, link changes) into `events`.

Follows /dev/kmsg, whose records are `prio,seq,usec,flags[,...];message` (Documentation/ABI/testing/
dev-kmsg in the Linux kernel): one record per read(2), non-blocking; EAGAIN means caught up, EPIPE
means records were overwritten before we read them (we skip ahead and count it). `usec` is time since
boot; it becomes wall time through the boot time (CLOCK_REALTIME - CLOCK_BOOTTIME). `seq` is kept for
dedupe across restarts. The same parsers accept `dmesg`-style text ("[  12.345678] message" or bare
messages) from a regular file, which is followed by offset like `tail -f`.

Xid lines: `NVRM: Xid (PCI:DDDD:BB:DD): <xid>, pid=<pid>, name=<comm>, <message>`; older drivers omit
`PCI:` and pid/name; NVLink5 Xids 144-150 carry `Nonfatal`/`Fatal` and `Link NN`. A lost GPU may be
reported without an Xid: "NVRM: The NVIDIA GPU <bus id> ... has fallen off the bus". Real examples:
../shared/fixtures/kmsg/xid-lines.txt. Severity classes: the Xid catalogue, foreshock/xid.py.
NVSwitch SXid lines (`nvidia-nvswitchN: SXid (PCI:...): ...`) are parsed by collectors/sxid.py.

An Xid line that does not parse (a truncated or garbled `NVRM: Xid` line) is a ParseError, counted in
the source's errors; an Xid outside the catalogue becomes an event of severity info, counted in
`unknown_xids` (foreshock/xid.py, UNKNOWN). Repeats of one Xid are folded into counts
(collectors/repeats.py): the first line at once, the count of its repeats once their window closes.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from dataclasses import dataclass

import pyarrow as pa

from foreshock import schema as sch
from foreshock import xid as xidcat

from .base import ParseError, Source
from .repeats import DEFAULT_WINDOW_SECONDS, XidFolder
from .sxid import parse_sxid

_PCI = r"(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
_XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>" + _PCI + r")\): (?P<xid>\d{1,10})\b(?:,\s*(?P<rest>.*))?$")
_PID_RE = re.compile(r"^pid=(?P<pid>'?<unknown>'?|\d{1,18}), name=(?P<name>[^,]*), ?(?P<msg>.*)$")
_LINK_RE = re.compile(r"\bLink (\d+)\b")
_FELL_OFF_RE = re.compile(r"NVRM: The NVIDIA GPU (?P<pci>" + _PCI + r")\b.*fallen off the bus")
# mlx5/NIC driver lines: "<driver> <pci bus id>[ <iface>]: <message>".
_NIC_DRIVERS = r"mlx5_core|mlx4_core|mlx5_ib|mlx4_ib|bnxt_en|ice|i40e|ixgbe|igb|e1000e|ena|idpf"
_NIC_RE = re.compile(r"^(?P<driver>" + _NIC_DRIVERS + r") (?P<pci>" + _PCI + r")(?: (?P<iface>[\w.@-]+))?: (?P<msg>.*)$")
_WATCHDOG_RE = re.compile(r"^NETDEV WATCHDOG: (?:CPU: \d+: )?(?P<iface>\S+?):? \((?P<driver>[^)]+)\): (?P<msg>.*)$")
_LINK_STATE_RE = re.compile(r"\b(?:NIC )?Link(?: is)? (?P<state>up|down)\b", re.IGNORECASE)
_NIC_ERROR_RE = re.compile(
    r"err|fail|timeout|timed out|health|fatal|assert|syndrome|insufficient|unplugged|"
    r"overheat|high temperature|recover|reset|abort|not responding", re.IGNORECASE)
_NIC_FATAL_RE = re.compile(r"health compromised|fatal|unrecoverable|firmware.*(dead|stuck)|internal error",
                           re.IGNORECASE)
_DMESG_TS_RE = re.compile(r"^\[\s*(?P<sec>\d{1,12})\.(?P<frac>\d{1,9})\]\s?(?P<msg>.*)$")


@dataclass(frozen=True)
class KmsgRecord:
    prio: int  # syslog facility*8 + level
    seq: int | None
    usec: int | None  # since boot
    message: str


def parse_kmsg_record(data: str | bytes) -> KmsgRecord:
    """One /dev/kmsg record (continuation lines after the first, " KEY=value", are dropped)."""
    s = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    head, sep, rest = s.partition(";")
    if not sep:
        raise ParseError(f"kmsg record without ';': {s[:60]!r}")
    fields = head.split(",")
    if len(fields) < 3:
        raise ParseError(f"kmsg record prefix needs prio,seq,usec: {head[:60]!r}")
    try:
        prio, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        raise ParseError(f"kmsg record prefix is not numeric: {head[:60]!r}") from None
    if prio < 0 or seq < 0 or usec < 0:
        raise ParseError(f"kmsg record prefix has negative numbers: {head[:60]!r}")
    message = rest.split("\n", 1)[0]
    return KmsgRecord(prio, seq, usec, _unescape(message))


def _unescape(message: str) -> str:
    # /dev/kmsg escapes non-printable bytes as \xNN.
    if "\\x" not in message:
        return message
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), message)


def parse_dmesg_line(line: str) -> KmsgRecord:
    """`dmesg` text: "[   12.345678] message", a /dev/kmsg record, or a bare message."""
    line = line.rstrip("\n")
    m = _DMESG_TS_RE.match(line)
    if m:
        frac = (m.group("frac") + "000000")[:6]
        return KmsgRecord(6, None, int(m.group("sec")) * 1_000_000 + int(frac), m.group("msg"))
    head = line.partition(";")[0]
    if ";" in line and head.count(",") >= 2 and head.replace(",", "").replace("-", "").replace("c", "").isdigit():
        return parse_kmsg_record(line)
    return KmsgRecord(6, None, None, line)


def normalize_pci(bus_id: str) -> str:
    """"0000:07:00" / "PCI:0000:07:00" / "00000000:07:00.0" -> "0000:07:00.0" (lower case, NVML-joinable)."""
    s = bus_id.strip().lower()
    if s.startswith("pci:"):
        s = s[4:]
    parts = s.split(":")
    if len(parts) == 2:
        parts = ["0000", *parts]
    if len(parts) != 3:
        raise ParseError(f"not a PCI bus id: {bus_id[:40]!r}")
    domain = parts[0][-4:].rjust(4, "0")
    dev = parts[2] if "." in parts[2] else parts[2] + ".0"
    return f"{domain}:{parts[1]}:{dev}"


def parse_event(message: str) -> dict | None:
    """A kernel log message -> an `events` row (without ts/node/seq), or None if it is not an event."""
    if "NVRM" in message:
        m = _XID_RE.search(message)
        if m is None and "NVRM: Xid" in message:
            raise ParseError(f"Xid line that does not parse: {message[:80]!r}")
        if m:
            rest = m.group("rest") or ""
            pid = name = None
            pm = _PID_RE.match(rest)
            if pm:
                pid = int(pm.group("pid")) if pm.group("pid").isdigit() else None
                name = pm.group("name").strip() or None
                if name == "<unknown>":
                    name = None
                rest = pm.group("msg")
            xid = int(m.group("xid"))
            if xid >= 1 << 31:
                raise ParseError(f"Xid {m.group('xid')[:20]} out of range")
            return {"kind": "xid", "severity": xidcat.severity(xid, rest), "xid": xid,
                    "pci_bus_id": normalize_pci(m.group("pci")), "pid": pid, "process_name": name,
                    "message": rest}
        m = _FELL_OFF_RE.search(message)
        if m:
            return {"kind": "gpu_lost", "severity": "fatal", "pci_bus_id": normalize_pci(m.group("pci")),
                    "message": message[m.start():]}
        return None
    if "SXid" in message:
        return parse_sxid(message)
    m = _NIC_RE.match(message)
    if m:
        return _nic_event(m.group("driver"), m.group("pci"), m.group("iface"), m.group("msg"))
    m = _WATCHDOG_RE.match(message)
    if m:
        return {"kind": "nic_error", "severity": "precursor", "device": m.group("iface"),
                "message": f"{m.group('driver')}: {m.group('msg')}"}
    return None


def _nic_event(driver: str, pci: str, iface: str | None, msg: str) -> dict | None:
    ls = _LINK_STATE_RE.search(msg)
    base = {"pci_bus_id": normalize_pci(pci), "device": iface, "message": f"{driver}: {msg}"}
    if ls and not _NIC_ERROR_RE.search(msg):
        return {**base, "kind": "link_state", "severity": "info"}
    if _NIC_ERROR_RE.search(msg):
        return {**base, "kind": "nic_error", "severity": "fatal" if _NIC_FATAL_RE.search(msg) else "precursor"}
    return None


def boot_time_ns() -> int:
    """Wall-clock time of boot: what /dev/kmsg's usec counts from."""
    return time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)


class KmsgSource(Source):
    name = "kmsg"
    tables = ("events",)

    def __init__(self, node: str, *, path: str = "/dev/kmsg", boot_ns: int | None = None,
                 max_records_per_sweep: int = 20_000, max_seen: int = 100_000,
                 xid_fold_seconds: float = DEFAULT_WINDOW_SECONDS):
        super().__init__(node)
        self.folder = XidFolder(xid_fold_seconds)
        self.path = path
        self.boot_ns = boot_time_ns() if boot_ns is None else boot_ns
        self.max_records = max_records_per_sweep
        self.records_read = 0
        self.records_lost = 0  # overwritten before we read them (EPIPE)
        self._fd: int | None = None
        self._is_file = False
        self._offset = 0
        self._partial = b""
        self._last_seq = -1
        self._unavailable = False

    def _open(self) -> bool:
        if self._fd is not None:
            return True
        if self._unavailable:
            return False
        try:
            st = os.stat(self.path)
            self._is_file = stat.S_ISREG(st.st_mode)
            flags = os.O_RDONLY | os.O_CLOEXEC | (0 if self._is_file else os.O_NONBLOCK)
            self._fd = os.open(self.path, flags)
            return True
        except FileNotFoundError:
            self._unavailable = True
            self.hardware_absent("%s does not exist", self.path)
        except PermissionError as exc:
            self._unavailable = True
            self.hardware_absent("%s is not readable (%s); kernel Xid events will come from NVML only",
                                 self.path, exc.strerror)
        return False

    def _records(self):
        """Yield raw records: one per read on /dev/kmsg, one per line on a file."""
        count = 0
        if self._is_file:
            data = os.pread(self._fd, 1 << 20, self._offset)
            self._offset += len(data)
            data = self._partial + data
            lines = data.split(b"\n")
            self._partial = lines.pop()  # an unterminated last line waits for its end
            for line in lines:
                if line.strip():
                    yield line, True
            return
        while count < self.max_records:
            try:
                data = os.read(self._fd, 8192)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten records: the next read continues past them
                    self.records_lost += 1
                    continue
                if exc.errno == errno.EINVAL:  # a record larger than our buffer
                    self.error(self.path, exc)
                    continue
                raise
            if not data:
                return
            count += 1
            yield data, False

    def sweep(self, ts_ns: int) -> dict[str, pa.Table]:
        if not self._open():
            return {}
        rows = []
        try:
            for data, text in self._records():
                self.records_read += 1
                try:
                    rec = parse_dmesg_line(data.decode("utf-8", "replace")) if text else parse_kmsg_record(data)
                except ParseError as exc:
                    self.error(self.path, exc)
                    continue
                if rec.seq is not None:
                    if rec.seq <= self._last_seq:
                        continue
                    self._last_seq = rec.seq
                try:
                    ev = parse_event(rec.message)
                except ParseError as exc:
                    self.error(self.path, exc)
                    continue
                if ev is None:
                    continue
                if ev["kind"] == "xid":
                    self.saw_xid(ev["xid"])
                ev_ts = self.boot_ns + rec.usec * 1000 if rec.usec is not None else ts_ns
                rows.extend(self.folder.feed({"ts": ev_ts, "node": self.node, "source": "kmsg", "seq": rec.seq,
                                              **ev}, ts_ns))
        except OSError as exc:
            self.error(self.path, exc)
            self.close()
        rows.extend(self.folder.due(ts_ns))
        if not rows:
            return {}
        return {"events": sch.to_table("events", rows)}

    def flush(self, ts_ns: int) -> dict[str, pa.Table]:
        rows = self.folder.flush(ts_ns)
        return {"events": sch.to_table("events", rows)} if rows else {}

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
