"""Source `rdma`: InfiniBand / RoCE ports from sysfs, into the `rdma_port` table.

Reads `<sysfs>/class/infiniband/<device>/ports/<n>/{state,phys_state,rate,link_layer}` and every file of
`counters/` and `hw_counters/` (formats: drivers/infiniband/core/sysfs.c and hw/mlx5/counters.c in the
Linux kernel; the same files prometheus/procfs's sysfs.InfiniBandClass and node_exporter read). Units are
normalised here: `port_xmit_data`/`port_rcv_data` count 4-byte words and become `port_xmit_bytes`/
`port_rcv_bytes`; `rate` "400 Gb/sec (4X NDR)" becomes 400.0. A file that reads "N/A (no PMA)" or fails
with EINVAL is null (unsupported); files the schema does not name go to `extra_counters` under their
sysfs names. An entry that cannot be read (permission denied, a symlink loop, a directory where a file
should be, an empty file) is an error for that entry alone, named by its path (collectors/base.py).
Files are held open and re-read with pread; the tree is re-scanned every `rescan_seconds` and after a
read says the device went away.
"""

from __future__ import annotations

import os
import re
import time

import pyarrow as pa

from foreshock import schema as sch

from .base import (GONE_ERRNOS, READ_SIZE, UNSUPPORTED_ERRNOS, AttrFiles, ParseError, Source, link_events, listdir,
                   parse_uint, read_text, regular_file)

EMPTY = "empty file: no value where the kernel always writes one"

RDMA_SCHEMA = sch.schema("rdma_port")
_EXTRA_TYPE = RDMA_SCHEMA.field("extra_counters").type
# The integer counter columns of rdma_port, in schema order.
COUNTER_COLUMNS: tuple[str, ...] = tuple(sch.IB_PORT_COUNTERS) + tuple(sch.MLX5_HW_COUNTERS)
_COUNTER_INDEX = {name: i for i, name in enumerate(COUNTER_COLUMNS)}
# sysfs file name -> (column index, multiplier)
_FILE_COLUMN: dict[str, tuple[int, int]] = {name: (i, 1) for name, i in _COUNTER_INDEX.items()}
for _file, _col in sch.IB_WORD_COUNTERS.items():
    _FILE_COLUMN[_file] = (_COUNTER_INDEX[_col], 4)
# The *_bytes column names are not sysfs files: a file of that name would be an unknown counter.
for _col in sch.IB_WORD_COUNTERS.values():
    _FILE_COLUMN.pop(_col, None)

_STATE_RE = re.compile(r"^\s*(\d{1,6})\s*(?::\s*(\S.*?))?\s*$")
_RATE_RE = re.compile(r"^\s*(\d{1,9}(?:\.\d{1,9})?)\s*Gb/sec\b", re.IGNORECASE)

KIND_COUNTER, KIND_EXTRA, KIND_STATE, KIND_PHYS, KIND_RATE = range(5)


def parse_state(text: str | bytes) -> int | None:
    """`state` / `phys_state`: "4: ACTIVE" -> 4, "5: LinkUp" -> 5. Empty is null."""
    s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    if not s.strip():
        return None
    m = _STATE_RE.match(s)
    if not m:
        raise ParseError(f"expected '<number>: <NAME>', got {s[:60]!r}")
    value = int(m.group(1))
    if value > 127:
        raise ParseError(f"port state {value} out of range in {s[:60]!r}")
    return value


def parse_rate(text: str | bytes) -> float | None:
    """`rate`: "400 Gb/sec (4X NDR)" -> 400.0, "2.5 Gb/sec (1X SDR)" -> 2.5. Empty is null."""
    s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    if not s.strip():
        return None
    m = _RATE_RE.match(s)
    if not m:
        raise ParseError(f"expected '<number> Gb/sec ...', got {s[:60]!r}")
    return float(m.group(1))


def parse_counter(name: str, text: str | bytes) -> tuple[str, int | None]:
    """One `counters/` or `hw_counters/` file -> (column, value in the column's unit)."""
    value = parse_uint(text)
    col, mult = _FILE_COLUMN.get(name, (None, 1))
    column = COUNTER_COLUMNS[col] if col is not None else name
    if value is not None and mult != 1:
        value *= mult
    return column, value


def _describe_port(key, old, new):
    (state0, phys0, rate0), (state1, phys1, rate1) = old, new
    return key[0], key[1], (f"port state {state0} -> {state1}, phys_state {phys0} -> {phys1}, "
                            f"rate {rate0} -> {rate1} Gb/s")


class _Port:
    __slots__ = ("device", "port", "link_layer")

    def __init__(self, device: str, port: int, link_layer: str | None):
        self.device, self.port, self.link_layer = device, port, link_layer


class RdmaSource(Source):
    name = "rdma"
    tables = ("rdma_port", "events")

    def __init__(self, node: str, *, sysfs: str = "/sys", rescan_seconds: float = 60.0,
                 clock=time.monotonic):
        super().__init__(node)
        self.root = os.path.join(sysfs, "class", "infiniband")
        self.rescan_seconds = rescan_seconds
        self._clock = clock
        self._files: AttrFiles | None = None
        self._entries: list[tuple[int, int, int | str, int]] = []
        self._ports: list[_Port] = []
        self._scanned_at = -1e18
        self._need_rescan = True
        self._static: dict[str, pa.Array] = {}
        self._last_state: dict[tuple[str, int], tuple] = {}

    # -- discovery ---------------------------------------------------------------------------------
    def _scan(self) -> None:
        if self._files is not None:
            self._files.close()
        ports: list[_Port] = []
        paths: list[str] = []
        entries: list[tuple[int, int, int | str, int]] = []  # (port index, kind, column/name, mult)
        error = self.error
        for device in listdir(self.root, error):
            pdir = os.path.join(self.root, device, "ports")
            for pname in listdir(pdir, error):
                if not pname.isdigit():
                    continue
                base = os.path.join(pdir, pname)
                ll_path = os.path.join(base, "link_layer")
                try:
                    ll = read_text(ll_path)
                except FileNotFoundError:  # older kernels have no link_layer: unsupported
                    ll = None
                except OSError as exc:
                    error(ll_path, exc)
                    ll = None
                if ll is not None and not ll.strip():
                    error(ll_path, EMPTY)
                pi = len(ports)
                ports.append(_Port(device, int(pname), ll.strip() if ll else None))
                for fname, kind in (("state", KIND_STATE), ("phys_state", KIND_PHYS), ("rate", KIND_RATE)):
                    if regular_file(os.path.join(base, fname), error):
                        paths.append(os.path.join(base, fname))
                        entries.append((pi, kind, 0, 1))
                for sub in ("counters", "hw_counters"):
                    for fname in listdir(os.path.join(base, sub), error):
                        path = os.path.join(base, sub, fname)
                        if not regular_file(path, error):
                            continue
                        paths.append(path)
                        col = _FILE_COLUMN.get(fname)
                        if col is None:
                            entries.append((pi, KIND_EXTRA, fname, 1))
                        else:
                            entries.append((pi, KIND_COUNTER, col[0], col[1]))
        self._files = AttrFiles(paths)
        for path, exc in self._files.open_errors:
            self.error(path, exc)
        self._entries = entries
        self._ports = ports
        self._scanned_at = self._clock()
        self._need_rescan = False
        n = len(ports)
        self._static = {
            "node": pa.array([self.node] * n, pa.string()),
            "device": pa.array([p.device for p in ports], pa.string()),
            "port": pa.array([p.port for p in ports], pa.int16()),
            "link_layer": pa.array([p.link_layer for p in ports], pa.string()),
        }
        if ports:
            self.absent = False
            self.say_once(f"found:{n}", "%d ports under %s", n, self.root)

    # -- the sweep ---------------------------------------------------------------------------------
    def _index_entries(self) -> None:
        """Split the open files into the hot counter list and the few parsed attributes."""
        n = len(self._ports)
        fds = self._files.fds
        self._counters = []  # (fd, slot in the column-major value list, path index)
        self._attrs = []  # (fd, path index, port index, kind, column or file name)
        self._word_slots = []
        self._slot_path = {}
        self._transient = []  # counters read by open/pread/close (no descriptors left to hold them)
        for i, (pi, kind, col, mult) in enumerate(self._entries):
            if fds[i] is None:
                if i in self._files.transient:
                    if kind == KIND_COUNTER:
                        self._transient.append((col * n + pi, i))
                        self._slot_path[col * n + pi] = i
                        if mult != 1:
                            self._word_slots.append(col * n + pi)
                    else:
                        self._attrs.append((None, i, pi, kind, col))
                continue  # could not be opened: unsupported, stays null
            if kind == KIND_COUNTER:
                slot = col * n + pi
                self._counters.append((fds[i], slot, i))
                self._slot_path[slot] = i
                if mult != 1:
                    self._word_slots.append(slot)
            else:
                self._attrs.append((fds[i], i, pi, kind, col))

    def _read_failed(self, i: int, exc: OSError) -> None:
        if exc.errno in UNSUPPORTED_ERRNOS:
            return
        self.error(self._files.paths[i], exc)
        if exc.errno in GONE_ERRNOS:
            self._need_rescan = True

    def _parse_counter(self, slot: int, i: int, data: bytes, values: list) -> None:
        """A counter that int() refused: "N/A (no PMA)" is null; empty text and garbage are errors."""
        if not data.strip():
            self.error(self._files.paths[i], EMPTY)
            return
        try:
            values[slot] = parse_uint(data)
        except ParseError as exc:
            self.error(self._files.paths[i], exc)

    def sweep(self, ts_ns: int) -> dict[str, pa.Table]:
        if self._need_rescan or self._clock() - self._scanned_at >= self.rescan_seconds:
            self._scan()
            self._index_entries()
        if not self._ports:
            return self.hardware_absent("no InfiniBand/RoCE ports under %s", self.root)
        n = len(self._ports)
        ncol = len(COUNTER_COLUMNS)
        paths = self._files.paths
        values: list[int | None] = [None] * (ncol * n)  # column-major: values[c * n + p]
        pread = os.pread
        # The hot loop: one pread and one int() per counter file, nothing else.
        for fd, slot, i in self._counters:
            try:
                data = pread(fd, READ_SIZE, 0)
                values[slot] = int(data)
            except ValueError:
                self._parse_counter(slot, i, data, values)
            except OSError as exc:
                self._read_failed(i, exc)
        for slot, i in self._transient:
            try:
                data = self._files.read(i)
                if data is not None:
                    self._parse_counter(slot, i, data, values)
            except OSError as exc:
                self._read_failed(i, exc)
        for slot in self._word_slots:  # 4-byte words -> bytes
            v = values[slot]
            if v is not None:
                values[slot] = v * 4
        u64 = pa.uint64()
        try:
            flat = pa.array(values, u64)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            for slot, v in enumerate(values):  # a negative or >64-bit value: null it, name the file
                if v is not None and not 0 <= v < 1 << 64:
                    self.error(paths[self._slot_path[slot]], f"counter value {v} out of range")
                    values[slot] = None
            flat = pa.array(values, u64)
        state: list[int | None] = [None] * n
        phys: list[int | None] = [None] * n
        rate: list[float | None] = [None] * n
        extra: list[list | None] = [None] * n
        for fd, i, pi, kind, col in self._attrs:
            try:
                data = pread(fd, READ_SIZE, 0) if fd is not None else self._files.read(i)
            except OSError as exc:
                self._read_failed(i, exc)
                continue
            if data is None:
                continue
            if not data.strip():
                self.error(paths[i], EMPTY)
                continue
            try:
                if kind == KIND_EXTRA:
                    v = parse_uint(data)
                    if v is not None:
                        if extra[pi] is None:
                            extra[pi] = []
                        extra[pi].append((col, v))
                elif kind == KIND_STATE:
                    state[pi] = parse_state(data)
                elif kind == KIND_PHYS:
                    phys[pi] = parse_state(data)
                else:
                    rate[pi] = parse_rate(data)
            except ParseError as exc:
                self.error(paths[i], exc)
        static = self._static
        arrays = [
            pa.array([ts_ns] * n, sch.TS),
            static["node"], static["device"], static["port"],
            pa.array(state, pa.int8()), pa.array(phys, pa.int8()), pa.array(rate, pa.float64()),
            static["link_layer"],
        ]
        # One conversion for every counter of every port, then zero-copy column slices: per-column
        # pa.array calls were most of the sweep's cost.
        arrays.extend(flat.slice(c * n, n) for c in range(ncol))
        arrays.append(pa.array(extra, _EXTRA_TYPE))
        batch = pa.RecordBatch.from_arrays(arrays, schema=RDMA_SCHEMA)  # cheaper than Table.from_arrays
        out = {"rdma_port": pa.Table.from_batches([batch])}
        current = {(p.device, p.port): (state[k], phys[k], rate[k]) for k, p in enumerate(self._ports)}
        if current != self._last_state:
            events = link_events(self.node, ts_ns, self._last_state, current, _describe_port)
            self._last_state = current
            if events:
                out["events"] = sch.to_table("events", events)
        return out

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None
        self._need_rescan = True
