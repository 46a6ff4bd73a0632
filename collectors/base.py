"""What every node source shares: the three outcomes, error accounting, and cheap re-reads of sysfs files.

A source reads one interface (sysfs, procfs, /dev/kmsg, NVML) and returns schema-v1 Arrow tables for one
sweep. It keeps three outcomes apart, the way node_exporter's collectors do:

* hardware absent: the interface is not there at all (no /sys/class/infiniband, no libnvidia-ml). The
  source says so once in the log and yields nothing; this is not an error.
* a value unsupported: one file or field the part does not have, or that reads "N/A (no PMA)" or
  EINVAL. The column is null, never 0.
* a real error: something that should have worked did not (garbage, an empty counter file, a
  directory or a symlink loop where a file should be, permission denied on a readable attribute). It
  is counted in `errors` and logged with the path, at most once a minute per path (with the count of
  repeats), and the sweep goes on: one unreadable entry never costs the others.

sysfs regenerates an attribute's text on every read at offset 0, so a source opens each file once and
re-reads it with os.pread(fd, 4096, 0): one system call per value, no open/close, no Python file object.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterable

import pyarrow as pa

from foreshock import xid as xidcat
from foreshock.ratelimit import LogLimiter

log = logging.getLogger("foreshock.collectors")

# Errors that mean "the kernel has no value for this attribute right now" rather than a failure:
# EINVAL (carrier/speed of a down link, an unsupported PMA counter), EOPNOTSUPP, ENODATA.
UNSUPPORTED_ERRNOS = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENODATA, errno.ENOTSUP})
# Errors that mean the device went away under us: re-scan the tree.
GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENODEV, errno.ENXIO, errno.ESTALE, errno.EBADF})

READ_SIZE = 4096


class ParseError(ValueError):
    """Text that is not in the format its parser reads; the message quotes the input."""


class HardwareAbsent(RuntimeError):
    """The interface a source reads does not exist on this machine."""


def _quote(text: str | bytes, limit: int = 60) -> str:
    s = text if isinstance(text, str) else text.decode("utf-8", "replace")
    return repr(s if len(s) <= limit else s[:limit] + "...")


def parse_uint(text: str | bytes) -> int | None:
    """A sysfs counter: decimal digits and a newline. "N/A (no PMA)" and empty text are null.

    A negative number or one past 2^64-1 is a ParseError (no counter is negative or wider than u64).
    """
    s = text.strip()
    if not s:
        return None
    if s.isdigit() and s.isascii():
        if len(s) > 20:
            raise ParseError(f"counter {_quote(text)} does not fit in 64 bits")
        value = int(s)
        if value >= 1 << 64:
            raise ParseError(f"counter {_quote(text)} does not fit in 64 bits")
        return value
    if (s.startswith("N/A") if isinstance(s, str) else s.startswith(b"N/A")):
        return None
    raise ParseError(f"expected an unsigned integer, got {_quote(text)}")


def parse_int(text: str | bytes) -> int | None:
    """A signed sysfs value (mtu, speed); empty is null."""
    s = text.strip()
    if not s:
        return None
    try:
        if len(s) > 21:
            raise ValueError
        value = int(s)
    except ValueError:
        raise ParseError(f"expected an integer, got {_quote(text)}") from None
    if not -(1 << 63) <= value < (1 << 63):
        raise ParseError(f"integer {_quote(text)} does not fit in 64 bits")
    return value


class Source:
    """Base of every source: a name, the tables it feeds, and the three-outcome bookkeeping."""

    name = "source"
    tables: tuple[str, ...] = ()
    folder = None   # an XidFolder (collectors/repeats.py) where the source reads Xids

    def __init__(self, node: str):
        self.node = node
        self.errors = 0
        self.absent = False
        self.unknown_xids = 0  # Xid events outside the Xid catalogue (foreshock/xid.py, UNKNOWN)
        self._said: set[str] = set()
        # A persistent fault read on every 1 s sweep must not flood the journal: a path a minute.
        self._error_log = LogLimiter(log)

    # -- outcomes ----------------------------------------------------------------------------------
    def say_once(self, key: str, message: str, *args) -> None:
        if key not in self._said:
            self._said.add(key)
            log.info("%s: " + message, self.name, *args)

    def hardware_absent(self, message: str, *args) -> dict[str, pa.Table]:
        self.absent = True
        self.say_once("absent", "hardware absent: " + message, *args)
        return {}

    def saw_xid(self, code: int) -> None:
        """Count an Xid event this source read if the Xid catalogue does not know its code."""
        if xidcat.lookup(code) is not xidcat.UNKNOWN:
            return
        self.unknown_xids += 1
        self.say_once("unknown-xid", "Xid %d is not in the Xid catalogue (foreshock/xid.py): recorded with "
                      "severity info, no alarm; further ones are counted", code)

    def error(self, path: object, exc: BaseException | str) -> None:
        self.errors += 1
        self._error_log.warning(str(path), "%s: error reading %s: %s", self.name, path, exc)

    # -- the sweep ---------------------------------------------------------------------------------
    def sweep(self, ts_ns: int) -> dict[str, pa.Table]:
        raise NotImplementedError

    def flush(self, ts_ns: int) -> dict[str, pa.Table]:
        """Rows the source still holds (folded Xid counts, collectors/repeats.py), written before it closes."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AttrFiles:
    """A set of sysfs attribute files held open and re-read with pread at offset 0.

    `read(i)` returns the bytes, or None when the kernel answers "unsupported" (EINVAL and friends);
    it raises OSError for any other failure, after closing the descriptor. Unopenable files (EACCES on
    a write-only attribute, a broken symlink) are remembered as None at open time.
    """

    def __init__(self, paths: Iterable[str]):
        self.paths: list[str] = list(paths)
        self.fds: list[int | None] = []
        self.open_errors: list[tuple[str, OSError]] = []
        # Files we could not keep open for want of descriptors (EMFILE/ENFILE: a node with hundreds
        # of veth interfaces): they are opened, read and closed on every read instead.
        self.transient: set[int] = set()
        exhausted = False
        for i, p in enumerate(self.paths):
            if exhausted:
                self.fds.append(None)
                self.transient.add(i)
                continue
            try:
                self.fds.append(os.open(p, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                self.fds.append(None)
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    # Out of descriptors: give back a reserve (so transient reads, sockets and the
                    # writer can still open files) and read the rest by open/pread/close.
                    exhausted = True
                    self.transient.add(i)
                    self._release_reserve(i)
                elif exc.errno not in UNSUPPORTED_ERRNOS and exc.errno != errno.ENOENT and not write_only(p, exc):
                    self.open_errors.append((p, exc))

    RESERVE = 16

    def _release_reserve(self, upto: int) -> None:
        released = 0
        for j in range(upto - 1, -1, -1):
            if released >= self.RESERVE:
                break
            fd = self.fds[j]
            if fd is not None:
                os.close(fd)
                self.fds[j] = None
                self.transient.add(j)
                released += 1

    def read(self, i: int) -> bytes | None:
        fd = self.fds[i]
        try:
            if fd is None:
                if i not in self.transient:
                    return None
                fd = os.open(self.paths[i], os.O_RDONLY | os.O_CLOEXEC)
                try:
                    return os.pread(fd, READ_SIZE, 0)
                finally:
                    os.close(fd)
            return os.pread(fd, READ_SIZE, 0)
        except OSError as exc:
            if exc.errno in UNSUPPORTED_ERRNOS:
                return None
            raise

    def close(self) -> None:
        for fd in self.fds:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fds = [None] * len(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


def raise_fd_limit(want: int = 65536) -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard limit (sources keep their files open)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            pass
    return soft


def link_events(node: str, ts_ns: int, previous: dict, current: dict, describe) -> list[dict]:
    """`link_state` events (source sysfs) for entities whose state changed since the last sweep.

    `previous`/`current` map an entity key to a state tuple; the first sight of an entity is not a
    change. `describe(key, old, new)` returns the event's device, port and message.
    """
    rows = []
    for key, new in current.items():
        old = previous.get(key)
        if old is not None and old != new:
            device, port, message = describe(key, old, new)
            rows.append({"ts": ts_ns, "node": node, "kind": "link_state", "source": "sysfs", "severity": "info",
                         "device": device, "port": port, "message": message})
    return rows


def write_only(path: str, exc: OSError) -> bool:
    """EACCES on an attribute that is write-only by its mode (sysfs's 0200 attributes): no value to
    read, not an error. EACCES on any other file (a readable attribute, a chmod 000) is one."""
    if exc.errno != errno.EACCES:
        return False
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not mode & 0o444 and bool(mode & 0o222)


def read_text(path: str) -> str | None:
    """One-shot read of a small file (used at scan time, not in the hot path); None if unsupported."""
    try:
        with open(path, "rb") as fh:
            return fh.read(READ_SIZE).decode("utf-8", "replace")
    except OSError as exc:
        if exc.errno in UNSUPPORTED_ERRNOS or write_only(path, exc):
            return None
        raise


def listdir(path: str, on_error=None) -> list[str]:
    """Sorted entries of a directory; [] when it does not exist. Any other failure (permission denied,
    a symlink loop, a file where the directory should be) is `on_error(path, exc)` and [] when
    on_error is given, else raised."""
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except NotADirectoryError as exc:
        if on_error is None:
            return []
        on_error(path, exc)
        return []
    except OSError as exc:
        if on_error is None:
            raise
        on_error(path, exc)
        return []


def regular_file(path: str, on_error) -> bool:
    """Whether `path` is a file to read: a missing one is not (unsupported); a directory, a symlink
    loop or a stat that fails is `on_error(path, exc)` and not."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        on_error(path, exc)
        return False
    if stat.S_ISDIR(mode):
        on_error(path, "a directory where a file should be")
        return False
    return True
