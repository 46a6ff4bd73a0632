"""Source `netdev`: network interfaces from `<sysfs>/class/net/<iface>/`, into the `netdev` table.

Reads operstate, carrier, carrier_changes, carrier_up_count, carrier_down_count, speed, mtu and every
file of `statistics/` that schema v1 names (formats: Documentation/ABI/testing/sysfs-class-net and
sysfs-class-net-statistics in the Linux kernel; prometheus/procfs's sysfs.NetClass reads the same).
`carrier` and `speed` fail with EINVAL while an interface is down: null. `speed` -1 (unknown) is null.
Files are held open and re-read with pread; the directory is re-scanned periodically and after a read
says an interface went away.
"""

from __future__ import annotations

import os
import time

import pyarrow as pa

from foreshock import schema as sch

from .base import (GONE_ERRNOS, READ_SIZE, UNSUPPORTED_ERRNOS, AttrFiles, ParseError, Source, link_events, listdir,
                   parse_int)

NETDEV_SCHEMA = sch.schema("netdev")
# Integer columns (after iface, operstate, carrier) in schema order, with their sysfs paths and kinds.
_INT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("carrier_changes", "carrier_changes"),
    ("carrier_up_count", "carrier_up_count"),
    ("carrier_down_count", "carrier_down_count"),
    ("speed_mbps", "speed"),
    ("mtu", "mtu"),
    *((name, f"statistics/{name}") for name in sch.NETDEV_STATISTICS),
)
_TYPES = {name: NETDEV_SCHEMA.field(name).type for name, _ in _INT_COLUMNS}
_U64_COLS = tuple(c for c, (name, _) in enumerate(_INT_COLUMNS) if _TYPES[name] == pa.uint64())
_U64_SET = frozenset(_U64_COLS)
_RANGES = {name: ((-(1 << 63), 1 << 63) if _TYPES[name] == pa.int64() else
                  (0, 1 << 31) if _TYPES[name] == pa.int32() else (0, 1 << 64)) for name in _TYPES}
OPERSTATES = frozenset({"unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up"})


def parse_operstate(text: str | bytes) -> str | None:
    """`operstate`: one of RFC 2863's states ("up", "down", "lowerlayerdown", ...)."""
    s = (text.decode("utf-8", "replace") if isinstance(text, bytes) else text).strip()
    if not s:
        return None
    if s not in OPERSTATES:
        raise ParseError(f"unknown operstate {s[:40]!r}")
    return s


def parse_carrier(text: str | bytes) -> bool | None:
    """`carrier`: "1" or "0"."""
    v = parse_int(text)
    if v is None:
        return None
    if v not in (0, 1):
        raise ParseError(f"carrier must be 0 or 1, got {text[:20]!r}")
    return bool(v)


def parse_speed(text: str | bytes) -> int | None:
    """`speed` in Mb/s; -1 (and any negative, which some drivers print as 4294967295) is unknown."""
    v = parse_int(text)
    if v is None or v < 0 or v == 0xFFFFFFFF:
        return None
    return v


def parse_mtu(text: str | bytes) -> int | None:
    """`mtu` in bytes (0 .. 2^31-1)."""
    v = parse_int(text)
    if v is not None and not 0 <= v < 1 << 31:
        raise ParseError(f"mtu {v} out of range")
    return v


class NetdevSource(Source):
    name = "netdev"
    tables = ("netdev", "events")

    def __init__(self, node: str, *, sysfs: str = "/sys", rescan_seconds: float = 60.0,
                 clock=time.monotonic, include=None):
        super().__init__(node)
        self.root = os.path.join(sysfs, "class", "net")
        self.rescan_seconds = rescan_seconds
        self.include = include  # optional predicate on interface names
        self._clock = clock
        self._ifaces: list[str] = []
        self._files: AttrFiles | None = None
        self._scanned_at = -1e18
        self._need_rescan = True
        self._static: dict[str, pa.Array] = {}
        self._last_state: dict[str, tuple] = {}

    def _scan(self) -> None:
        if self._files is not None:
            self._files.close()
        ifaces = [i for i in listdir(self.root)
                  if os.path.isdir(os.path.join(self.root, i)) and (self.include is None or self.include(i))]
        paths = []
        for iface in ifaces:
            base = os.path.join(self.root, iface)
            paths.append(os.path.join(base, "operstate"))
            paths.append(os.path.join(base, "carrier"))
            paths.extend(os.path.join(base, rel) for _, rel in _INT_COLUMNS)
        self._files = AttrFiles(paths)
        # A missing statistics file is "unsupported" (null), not an error: open_errors hold ENOENT.
        self._ifaces = ifaces
        self._scanned_at = self._clock()
        self._need_rescan = False
        self._static = {"node": pa.array([self.node] * len(ifaces), pa.string()),
                        "iface": pa.array(ifaces, pa.string())}
        if ifaces:
            self.absent = False

    def sweep(self, ts_ns: int) -> dict[str, pa.Table]:
        if self._need_rescan or self._clock() - self._scanned_at >= self.rescan_seconds:
            self._scan()
        n = len(self._ifaces)
        if not n:
            return self.hardware_absent("no network interfaces under %s", self.root)
        files = self._files
        fds, paths = files.fds, files.paths
        per = 2 + len(_INT_COLUMNS)
        ncol = len(_INT_COLUMNS)
        operstate: list[str | None] = [None] * n
        carrier: list[bool | None] = [None] * n
        values: list[int | None] = [None] * (ncol * n)  # column-major: values[c * n + p]
        pread = os.pread
        for p in range(n):
            base = p * per
            for j in (0, 1):
                fd = fds[base + j]
                if fd is None and base + j not in files.transient:
                    continue
                try:
                    data = pread(fd, READ_SIZE, 0) if fd is not None else files.read(base + j)
                    if data is None:
                        continue
                    if j == 0:
                        operstate[p] = parse_operstate(data)
                    else:
                        carrier[p] = parse_carrier(data)
                except ParseError as exc:
                    self.error(paths[base + j], exc)
                except OSError as exc:
                    self._read_failed(base + j, exc)
            # The hot loop: one pread and one int() per integer file.
            for c in range(ncol):
                i = base + 2 + c
                fd = fds[i]
                if fd is None and i not in files.transient:
                    continue  # the kernel has no such file here: unsupported, null
                try:
                    data = pread(fd, READ_SIZE, 0) if fd is not None else files.read(i)
                    if data is None:
                        continue
                    values[c * n + p] = int(data)
                except ValueError:
                    try:
                        values[c * n + p] = parse_int(data)
                    except ParseError as exc:
                        self.error(paths[i], exc)
                except OSError as exc:
                    self._read_failed(i, exc)
        arrays = [
            pa.array([ts_ns] * n, sch.TS),
            self._static["node"], self._static["iface"],
            pa.array(operstate, pa.string()), pa.array(carrier, pa.bool_()),
        ]
        # The unsigned counters go through one conversion and zero-copy slices; speed and mtu apart.
        u64_slots = [v for c in _U64_COLS for v in values[c * n:(c + 1) * n]]
        try:
            flat = pa.array(u64_slots, pa.uint64())
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            flat = None
        k = 0
        for c, (name, _) in enumerate(_INT_COLUMNS):
            if c in _U64_SET and flat is not None:
                arrays.append(flat.slice(k * n, n))
                k += 1
                continue
            k += c in _U64_SET
            col = values[c * n:(c + 1) * n]
            if name == "speed_mbps":
                col = [None if v is None or v < 0 or v == 0xFFFFFFFF else v for v in col]  # -1: unknown
            arrays.append(self._column(name, col, p_base=c))
        batch = pa.RecordBatch.from_arrays(arrays, schema=NETDEV_SCHEMA)
        out = {"netdev": pa.Table.from_batches([batch])}
        current = {iface: (operstate[k], carrier[k]) for k, iface in enumerate(self._ifaces)}
        if current != self._last_state:
            events = link_events(self.node, ts_ns, self._last_state, current,
                                 lambda key, old, new: (key, None, f"operstate {old[0]} -> {new[0]}, "
                                                                   f"carrier {old[1]} -> {new[1]}"))
            self._last_state = current
            if events:
                out["events"] = sch.to_table("events", events)
        return out

    def _column(self, name: str, col: list, p_base: int) -> pa.Array:
        typ = _TYPES[name]
        try:
            return pa.array(col, typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            lo, hi = _RANGES[name]
            out = []
            for p, v in enumerate(col):  # out of range for the column: null it, name the file
                if v is not None and not lo <= v < hi:
                    self.error(self._files.paths[p * (2 + len(_INT_COLUMNS)) + 2 + p_base],
                               f"{name} value {v} out of range")
                    v = None
                out.append(v)
            return pa.array(out, typ)

    def _read_failed(self, i: int, exc: OSError) -> None:
        if exc.errno in UNSUPPORTED_ERRNOS:  # carrier/speed of a down link: EINVAL, null
            return
        self.error(self._files.paths[i], exc)
        if exc.errno in GONE_ERRNOS:
            self._need_rescan = True

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None
        self._need_rescan = True
