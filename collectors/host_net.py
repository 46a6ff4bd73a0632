"""Source `host_net`: TCP path-trouble counters from procfs, and optional active probes to peers.

Reads `<procfs>/net/snmp` ("Tcp:" header/value line pairs, net/ipv4/proc.c in the Linux kernel) and
`<procfs>/net/netstat` ("TcpExt:" pairs, same file) into the `host_net` table (columns Tcp_<Field> and
TcpExt_<Field>, the fields schema v1 lists). Both files are held open and re-read with pread.

Active probes (`peers`: "host:port" or "site=host:port") measure TCP connect round-trip time, since
between sites there is no counter for path health. They run on their own thread, every connect with a
timeout, so the sweep never waits on the network; each sweep reports, per peer, the probes completed
since the previous sweep into the `path_probe` table.
"""

from __future__ import annotations

import errno
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterable

import pyarrow as pa

from foreshock import schema as sch

from .base import ParseError, Source, log

HOST_NET_SCHEMA = sch.schema("host_net")
PATH_PROBE_SCHEMA = sch.schema("path_probe")
PROC_READ_SIZE = 65536


def parse_proc_net_pairs(text: str | bytes) -> dict[str, dict[str, int]]:
    """/proc/net/snmp or /proc/net/netstat -> {"Tcp": {"RetransSegs": 12, ...}, "TcpExt": {...}}.

    The format is pairs of lines "<Proto>: <names...>" then "<Proto>: <values...>". A header without its
    value line, or counts that do not match, is a ParseError naming the protocol.
    """
    s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    out: dict[str, dict[str, int]] = {}
    lines = [ln for ln in s.splitlines() if ln.strip()]
    if len(lines) % 2:
        raise ParseError(f"odd number of lines ({len(lines)}): header/value lines must come in pairs")
    for head, vals in zip(lines[0::2], lines[1::2]):
        hp, _, hrest = head.partition(":")
        vp, _, vrest = vals.partition(":")
        if not _ or hp != vp or not hp:
            raise ParseError(f"header {head[:40]!r} is not followed by its value line ({vals[:40]!r})")
        names, values = hrest.split(), vrest.split()
        if len(names) != len(values):
            raise ParseError(f"{hp}: {len(names)} names but {len(values)} values")
        row = {}
        for k, v in zip(names, values):
            try:
                row[k] = int(v)
            except ValueError:
                raise ParseError(f"{hp} {k}: not an integer: {v[:30]!r}") from None
        out[hp] = row
    return out


def parse_peer(spec: str) -> tuple[str | None, str, int]:
    """"site=host:port" or "host:port" ("[v6]:port" too) -> (site, host, port)."""
    site, _, target = spec.rpartition("=") if "=" in spec else (None, "", spec)
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer {spec!r}: expected [site=]host:port")
    return (site or None), host.strip("[]"), int(port)


def tcp_connect_rtt(host: str, port: int, timeout: float) -> float | None:
    """Milliseconds to complete a TCP handshake, or None when it failed or timed out.

    A refused connection still answered (RST) and so still measures the round trip.
    """
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        pass
    except OSError:
        return None
    return (time.perf_counter() - t0) * 1000.0


class _Prober(threading.Thread):
    """Probes every peer every `interval` seconds; results wait in a bounded buffer for the sweep."""

    def __init__(self, peers, interval: float, timeout: float, max_results: int = 10_000):
        super().__init__(name="foreshock-probe", daemon=True)
        self.peers = peers
        self.interval, self.timeout = interval, timeout
        self.max_results = max_results
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._results: dict[str, list[float | None]] = {spec: [] for spec, *_ in peers}

    def run(self) -> None:
        while not self._stopping.is_set():
            for spec, _site, host, port in self.peers:
                if self._stopping.is_set():
                    return
                rtt = tcp_connect_rtt(host, port, self.timeout)
                with self._lock:
                    bucket = self._results[spec]
                    if len(bucket) < self.max_results:
                        bucket.append(rtt)
            self._stopping.wait(self.interval)

    def drain(self) -> dict[str, list[float | None]]:
        with self._lock:
            out = self._results
            self._results = {spec: [] for spec, *_ in self.peers}
        return out

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        self.join(timeout)


class HostNetSource(Source):
    name = "host_net"
    tables = ("host_net", "path_probe")

    def __init__(self, node: str, *, procfs: str = "/proc", peers: Iterable[str] = (),
                 probe_interval: float = 5.0, probe_timeout: float = 2.0):
        super().__init__(node)
        self.paths = (os.path.join(procfs, "net", "snmp"), os.path.join(procfs, "net", "netstat"))
        self._fds: list[int | None] = [None, None]
        self.peers = [(spec, *parse_peer(spec)) for spec in peers]
        self._prober: _Prober | None = None
        if self.peers:
            self._prober = _Prober(self.peers, probe_interval, probe_timeout)
            self._prober.start()

    def _read(self, i: int) -> bytes | None:
        path = self.paths[i]
        if self._fds[i] is None:
            try:
                self._fds[i] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
        chunks, offset = [], 0
        while True:
            data = os.pread(self._fds[i], PROC_READ_SIZE, offset)
            chunks.append(data)
            if len(data) < PROC_READ_SIZE:
                break
            offset += len(data)
        return b"".join(chunks)

    def sweep(self, ts_ns: int) -> dict[str, pa.Table]:
        out: dict[str, pa.Table] = {}
        row: dict[str, int | None] = {}
        found = False
        for i, (proto, fields) in enumerate((("Tcp", sch.TCP_SNMP_FIELDS), ("TcpExt", sch.TCPEXT_FIELDS))):
            try:
                data = self._read(i)
            except OSError as exc:
                self.error(self.paths[i], exc)
                self._close_fd(i)
                continue
            if data is None:
                continue
            found = True
            try:
                table = parse_proc_net_pairs(data).get(proto, {})
            except ParseError as exc:
                self.error(self.paths[i], exc)
                continue
            for f in fields:
                v = table.get(f)
                if v is not None and not -(1 << 63) <= v < (1 << 63):
                    self.error(self.paths[i], f"{proto} {f}={v} does not fit in int64")
                    v = None
                row[f"{proto}_{f}"] = v
        if found:
            arrays = [pa.array([ts_ns], sch.TS),
                      pa.array([self.node], pa.string())]
            arrays += [pa.array([row.get(f.name)], f.type) for f in list(HOST_NET_SCHEMA)[2:]]
            out["host_net"] = pa.Table.from_arrays(arrays, schema=HOST_NET_SCHEMA)
        else:
            self.hardware_absent("neither %s nor %s exists", *self.paths)
        if self._prober is not None:
            out["path_probe"] = self._probe_table(ts_ns)
        return out

    def _probe_table(self, ts_ns: int) -> pa.Table:
        results = self._prober.drain()
        rows = []
        for spec, site, _host, _port in self.peers:
            rtts = results.get(spec, [])
            if not rtts:
                continue
            answered = [r for r in rtts if r is not None]
            rows.append({"ts": ts_ns, "node": self.node, "peer": spec, "peer_site": site,
                         "sent": len(rtts), "received": len(answered),
                         "loss_ratio": 1.0 - len(answered) / len(rtts),
                         "rtt_ms": statistics.median(answered) if answered else None})
        return sch.to_table("path_probe", rows)

    def _close_fd(self, i: int) -> None:
        fd, self._fds[i] = self._fds[i], None
        if fd is not None:
            try:
                os.close(fd)
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    log.debug("close %s: %s", self.paths[i], exc)

    def close(self) -> None:
        for i in range(2):
            self._close_fd(i)
        if self._prober is not None:
            self._prober.stop()
            self._prober = None
