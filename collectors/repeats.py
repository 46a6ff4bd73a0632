"""Repeats of one Xid folded into a count with first and last times (`events.occurrences`, `first_ts`,
`last_ts`; schema: foreshock/schema.py, docs/collectors.md "Repeated Xids").

A GPU can log the same Xid thousands of times (one node logged about 800,000 Xid 95 lines, 29 of them
distinct); one `events` row per line floods the dataset, the uplink and the service. A source passes each
event row through an `XidFolder`:

* the first occurrence of an Xid on a device is returned at once, unchanged, so a fatal Xid reaches the
  control plane in the sweep that read it;
* its repeats within `window_seconds` of that are counted, and written as one row when the window has
  closed (at a later sweep, or at `flush()` when the source closes): `occurrences` is how many lines
  the row stands for, `first_ts`/`last_ts` the kernel times of the first and last of them, the message,
  pid and seq those of the last one, and `ts` the time the row is written (never before `last_ts`), so
  the control plane's step watermarks cover it (a row stamped with an old kernel time would reach the
  predictor after its step closed and be dropped as late);
* a flood that goes on is one such row per window; a key quiet for a whole window is forgotten, and
  its next line is a first occurrence again.

An Xid that cancels another (162 cancels 163) first writes out the cancelled Xid's pending count on
that device, so the cancel is never followed by an older occurrence of what it cancels, and forgets it:
the next 163 is a new state and is written at once.

Summing `occurrences` (null counts 1) over the rows gives the number of lines read, exactly. Rows that
are not Xids pass through untouched.

The same Xid: same kind, device (PCI bus id, else the NVML index), code and message once VOLATILE parts
are masked (channel ids and fault addresses change with every process and say nothing about the GPU;
pid and process name are columns of their own and not part of the key). At most MAX_KEYS keys are
followed; a new key beyond that first writes out the least recently seen one's count, so the memory is
bounded and no occurrence is lost.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass

from foreshock import xid as xidcat

DEFAULT_WINDOW_SECONDS = 60.0   # one predictor step: a folded count lands at most one step late
MAX_WINDOW_SECONDS = 3600.0
MAX_KEYS = 4096

# Parts of an Xid message that differ from one occurrence to the next of the same fault.
VOLATILE: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"\b(Ch|ChId|ChID|[Cc]hannel(?: ID)?)[ =:]+(?:0x)?[0-9a-fA-F]+\b"), r"\1 *"),
    (re.compile(r"@ 0x[0-9a-fA-F_]+"), "@ *"),
    (re.compile(r"\bpid[=:] ?'?\d+'?"), "pid=*"),
)


def mask(message: str | None) -> str:
    """The message with its VOLATILE parts masked: what two occurrences of one fault share."""
    s = message or ""
    for pattern, repl in VOLATILE:
        s = pattern.sub(repl, s)
    return s


@dataclass
class _Run:
    start_ns: int           # the window: from its first line ...
    last_seen_ns: int       # ... the latest line of the key, emitted or counted
    count: int = 0          # lines counted in this window, not yet written
    first_ns: int = 0
    last_ns: int = 0
    last_row: dict | None = None


class XidFolder:
    """Folds repeated Xid rows of one source (see the module docstring). Not thread-safe: a source's
    sweep feeds it."""

    def __init__(self, window_seconds: float = DEFAULT_WINDOW_SECONDS, *, max_keys: int = MAX_KEYS):
        if not 0 <= window_seconds <= MAX_WINDOW_SECONDS:
            raise ValueError(f"xid_fold_seconds {window_seconds} must be in [0, {MAX_WINDOW_SECONDS:g}] seconds")
        if max_keys < 1:
            raise ValueError(f"max_keys {max_keys} must be >= 1")
        self.window_ns = int(window_seconds * 1e9)
        self.max_keys = max_keys
        self._runs: collections.OrderedDict[tuple, _Run] = collections.OrderedDict()
        self.folded = 0          # lines counted into folded rows
        self.evicted = 0         # keys written out early for room

    @staticmethod
    def key(row: dict) -> tuple:
        device = row.get("pci_bus_id") or row.get("gpu")
        return (row.get("kind"), device, row.get("xid"), mask(row.get("message")))

    def _summary(self, run: _Run, now_ns: int) -> dict:
        row = dict(run.last_row)
        row.update(ts=max(now_ns, run.last_ns), occurrences=run.count, first_ts=run.first_ns, last_ts=run.last_ns)
        run.count, run.last_row = 0, None
        return row

    def feed(self, row: dict, now_ns: int) -> list[dict]:
        """The rows to write now for this event row: itself (a first occurrence, or not an Xid), a
        finished window's count, or nothing (a repeat, counted)."""
        if self.window_ns == 0 or row.get("kind") != "xid":
            return [row]
        k = self.key(row)
        t = int(row["ts"])
        run = self._runs.get(k)
        out: list[dict] = []
        cancels = xidcat.lookup(row.get("xid")).cancels
        if cancels:
            # 162 after repeats of 163: the 163 count is written first, so the rows keep their order, and
            # the 163 is forgotten: the next one is a new state, written at once.
            for other_key in [o for o in self._runs if o[:2] == k[:2] and o[2] in cancels]:
                other = self._runs.pop(other_key)
                if other.count:
                    out.append(self._summary(other, now_ns))
        if run is not None:
            self._runs.move_to_end(k)
            if t >= run.start_ns + self.window_ns:
                if run.count:
                    out.append(self._summary(run, now_ns))
                if t - run.last_seen_ns >= self.window_ns:   # quiet for a window: a new first occurrence
                    run.start_ns = run.last_seen_ns = t
                    out.append(row)
                    return out
                run.start_ns = t   # the flood goes on: a new window, this line its first count
            run.count += 1
            run.first_ns = t if run.count == 1 else min(run.first_ns, t)
            run.last_ns = t if run.count == 1 else max(run.last_ns, t)
            run.last_seen_ns = max(run.last_seen_ns, t)
            run.last_row = row
            self.folded += 1
            return out
        if len(self._runs) >= self.max_keys:
            _, old = self._runs.popitem(last=False)
            self.evicted += 1
            if old.count:
                out.append(self._summary(old, now_ns))
        self._runs[k] = _Run(t, t)
        out.append(row)
        return out

    def due(self, now_ns: int) -> list[dict]:
        """Counts of windows closed by `now_ns` (a sweep's time); keys quiet for a window are forgotten."""
        out = []
        for k in list(self._runs):
            run = self._runs[k]
            if run.count and now_ns >= run.start_ns + self.window_ns:
                out.append(self._summary(run, now_ns))
            if not run.count and now_ns >= run.last_seen_ns + self.window_ns:
                del self._runs[k]
        return out

    def flush(self, now_ns: int) -> list[dict]:
        """Every count not yet written (the source is closing)."""
        out = [self._summary(run, now_ns) for run in self._runs.values() if run.count]
        self._runs.clear()
        return out

    def __len__(self) -> int:
        return len(self._runs)
