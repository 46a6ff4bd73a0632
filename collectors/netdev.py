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

import numpy as np
import pyarrow as pa

from foreshock import schema as sch

from .base import GONE_ERRNOS, AttrFiles, ParseError, Source, listdir, parse_int, parse_uint

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
_SIGNED = {"speed_mbps", "mtu"}
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
    tables = ("netdev",)

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
        per = 2 + len(_INT_COLUMNS)
        ncol = len(_INT_COLUMNS)
        operstate: list[str | None] = [None] * n
        carrier: list[bool | None] = [None] * n
        values: list[int | None] = [None] * (ncol * n)
        for p in range(n):
            base = p * per
            for j in range(per):
                i = base + j
                try:
                    data = files.read(i)
                except OSError as exc:
                    self.error(files.paths[i], exc)
                    if exc.errno in GONE_ERRNOS:
                        self._need_rescan = True
                    continue
                if data is None:
                    continue
                try:
                    if j >= 2:
                        c = j - 2
                        name = _INT_COLUMNS[c][0]
                        if name == "speed_mbps":
                            v = parse_speed(data)
                        elif name == "mtu":
                            v = parse_mtu(data)
                        else:
                            try:
                                v = int(data)
                                if v < 0 or v >= 1 << 64:
                                    raise ParseError(f"counter {data[:40]!r} out of range")
                            except ValueError:
                                v = parse_uint(data)
                        values[c * n + p] = v
                    elif j == 0:
                        operstate[p] = parse_operstate(data)
                    else:
                        carrier[p] = parse_carrier(data)
                except ParseError as exc:
                    self.error(files.paths[i], exc)
        arrays = [
            pa.array(np.full(n, ts_ns, dtype="datetime64[ns]")).cast(sch.TS),
            self._static["node"], self._static["iface"],
            pa.array(operstate, pa.string()), pa.array(carrier, pa.bool_()),
        ]
        for c, (name, _) in enumerate(_INT_COLUMNS):
            arrays.append(pa.array(values[c * n:(c + 1) * n], NETDEV_SCHEMA.field(name).type))
        return {"netdev": pa.Table.from_arrays(arrays, schema=NETDEV_SCHEMA)}

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None
        self._need_rescan = True
