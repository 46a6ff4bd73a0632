"""Decode many small Arrow IPC record batches of one table at once, vectorised across batches.

A scoring round decodes one record batch per node and table (1,000-2,000 a table, each of 8 rows or
one): Arrow decodes them one by one, building its array objects per batch and column, and then
concatenates them column by column. That is about 1.6 us per column and batch, 260 us a node for the
five tables an 8-GPU node sends (docs/scaling.md), which was most of the scoring worker's time.

Record batches of a table from a homogeneous cluster mostly have byte-identical flatbuffer metadata
(the same row count, null counts and buffer sizes; only the values differ). Batches whose metadata is
the same lay their buffers out at the same offsets, so a group of them is a 2-D byte array (one row
per batch) and every column of the group is a slice of it: one numpy copy per buffer for the whole
group instead of one Arrow array per batch. The layout of a group comes from decoding one of its
batches with Arrow itself (the offsets of its buffers in the message), so nothing here parses
flatbuffers, and every batch of a group is checked to be exactly one record batch message of that
layout. Offsets (strings, lists, maps) are checked to start at 0 and end where the sample's do in
every batch and are rebased; the assembled arrays are validated in full (offsets, UTF-8) before they
are used. Small groups, batches that are not exactly one record batch message, and anything else
unusual go the general way (Arrow's own reader), so the result is the same table either way.

`BatchDecoder(schema, fast=False)` decodes every batch the general way: the written reference the
vectorised path is tested against (tests/test_service_fastipc.py).
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa

MARKER = b"\xff\xff\xff\xff"
EOS = MARKER + b"\x00\x00\x00\x00"
MIN_GROUP = 8            # smaller groups are decoded by Arrow's reader (its per-batch cost is lower then)
MAX_LAYOUTS = 512        # layouts cached per decoder
_LITTLE = sys.byteorder == "little"


class _Node:
    """One array of the sample batch (a column or a child of one): its type, its length in the batch,
    and where its own buffers lie in the message (byte offset from the message start, size; None for
    an absent buffer), its children."""
    __slots__ = ("type", "kind", "length", "buffers", "children", "width")

    def __init__(self, typ, kind, length, buffers, children, width=0):
        self.type, self.kind, self.length = typ, kind, length
        self.buffers, self.children, self.width = buffers, children, width


class _Layout:
    __slots__ = ("size", "rows", "columns")

    def __init__(self, size: int, rows: int, columns: list[_Node]):
        self.size, self.rows, self.columns = size, rows, columns


def _kind(t: pa.DataType) -> tuple[str, int, int] | None:
    """(kind, own buffer count, byte width) of a type this decoder assembles, or None."""
    if pa.types.is_boolean(t):
        return "bool", 2, 0
    if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_timestamp(t)
            or pa.types.is_date(t) or pa.types.is_time(t) or pa.types.is_duration(t)):
        return "fixed", 2, t.bit_width // 8
    if pa.types.is_string(t) or pa.types.is_binary(t):
        return "binary", 3, 0
    if pa.types.is_map(t) or pa.types.is_list(t):
        return "list", 2, 0
    if pa.types.is_struct(t):
        return "struct", 1, 0
    return None


def _node(arr: pa.Array, base: int, end: int) -> _Node | None:
    k = _kind(arr.type)
    if k is None or arr.offset != 0:
        return None
    kind, n_own, width = k
    own = arr.buffers()[:n_own]
    spans: list[tuple[int, int] | None] = []
    for b in own:
        if b is None:
            spans.append(None)
            continue
        if b.size == 0:
            spans.append((0, 0))   # an empty buffer points anywhere
            continue
        off = b.address - base
        if off < 0 or off + b.size > end:   # not a slice of the message (a copy): not this decoder's case
            return None
        spans.append((off, b.size))
    n = len(arr)
    if kind == "fixed" and (spans[1] is None or spans[1][1] < n * width):
        return None
    if kind == "bool" and (spans[1] is None or spans[1][1] * 8 < n):
        return None
    if kind in ("binary", "list") and (spans[1] is None or spans[1][1] < 4 * (n + 1)):
        return None
    if spans[0] is not None and spans[0][1] * 8 < n:
        return None
    children: list[_Node] = []
    if kind == "list":
        child = _node(arr.values, base, end)
        if child is None:
            return None
        children.append(child)
    elif kind == "struct":
        for i in range(arr.type.num_fields):
            child = _node(arr.field(i), base, end)
            if child is None:
                return None
            children.append(child)
    return _Node(arr.type, kind, n, spans, children, width)


def _layout(schema: pa.Schema, raw) -> _Layout | None:
    """The layout of one batch's bytes (exactly one record batch message), from Arrow's own decode."""
    buf = pa.py_buffer(raw)
    reader = pa.BufferReader(buf)
    try:
        msg = pa.ipc.read_message(reader)
        if msg.type != "record batch" or reader.tell() != len(raw):
            return None
        batch = pa.ipc.read_record_batch(msg, schema)
    except Exception:
        return None
    if len(batch.schema) != len(schema):
        return None
    base, end = buf.address, len(raw)
    columns = []
    for col in batch.columns:
        node = _node(col, base, end)
        if node is None:
            return None
        columns.append(node)
    return _Layout(len(raw), batch.num_rows, columns)


def _bits(M: np.ndarray, span: tuple[int, int], n: int) -> pa.Buffer:
    """A bitmap of n bits per batch, every batch's joined."""
    off = span[0]
    if n % 8 == 0:
        return pa.py_buffer(np.ascontiguousarray(M[:, off:off + n // 8]))
    nb = (n + 7) // 8
    bits = np.unpackbits(M[:, off:off + nb], axis=1, bitorder="little")[:, :n]
    return pa.py_buffer(np.packbits(bits.reshape(-1), bitorder="little"))


def _offsets(M: np.ndarray, span: tuple[int, int], n: int) -> tuple[pa.Buffer, int] | None:
    """Every batch's n + 1 int32 offsets, rebased onto one joined child; (buffer, child length per
    batch), or None when a batch's offsets do not start at 0 and end at the same place as the others'."""
    off = span[0]
    o = np.ascontiguousarray(M[:, off:off + 4 * (n + 1)]).view("<i4")
    first, last = o[:, 0], o[:, n]
    width = int(last[0])
    if (first != 0).any() or (last != width).any() or width < 0:
        return None
    m = o.shape[0]
    if m * width > 2**31 - 1:
        return None
    out = np.empty(m * n + 1, dtype=np.int32)
    out[:-1] = (o[:, :n] + (np.arange(m, dtype=np.int32) * width)[:, None]).reshape(-1)
    out[-1] = m * width
    return pa.py_buffer(out), width


def _assemble(M: np.ndarray, node: _Node, m: int) -> pa.Array | None:
    n = node.length
    spans = node.buffers
    validity = _bits(M, spans[0], n) if spans[0] is not None and n else None
    if node.kind == "fixed":
        off = spans[1][0]
        data = pa.py_buffer(np.ascontiguousarray(M[:, off:off + n * node.width]))
        return pa.Array.from_buffers(node.type, m * n, [validity, data])
    if node.kind == "bool":
        return pa.Array.from_buffers(node.type, m * n, [validity, _bits(M, spans[1], n)])
    if node.kind == "binary":
        got = _offsets(M, spans[1], n)
        if got is None:
            return None
        offsets, width = got
        if width:
            if spans[2] is None or spans[2][1] < width:
                return None
            data = pa.py_buffer(np.ascontiguousarray(M[:, spans[2][0]:spans[2][0] + width]))
        else:
            data = pa.py_buffer(b"")
        return pa.Array.from_buffers(node.type, m * n, [validity, offsets, data])
    if node.kind == "list":
        got = _offsets(M, spans[1], n)
        if got is None:
            return None
        offsets, width = got
        child = node.children[0]
        if child.length != width:
            return None
        values = _assemble(M, child, m)
        if values is None:
            return None
        return pa.Array.from_buffers(node.type, m * n, [validity, offsets], children=[values])
    if node.kind == "struct":
        children = []
        for c in node.children:
            if c.length != n:
                return None
            a = _assemble(M, c, m)
            if a is None:
                return None
            children.append(a)
        return pa.Array.from_buffers(node.type, m * n, [validity], children=children)
    return None


class BatchDecoder:
    """Decodes a table's record batch messages, many at a time (`decode`). One per table schema.
    fast: groups of batches with the same layout assembled at once (the module docstring); False:
    every batch through Arrow's own reader (the same tables, slower)."""

    def __init__(self, schema: pa.Schema, *, fast: bool = True):
        self.schema = schema
        self.fast = bool(fast)
        self._layouts: dict[tuple[bytes, int], _Layout | None] = {}
        self.fast_batches = 0
        self.slow_batches = 0

    def _layout_of(self, key, raw) -> _Layout | None:
        layout = self._layouts.get(key, False)
        if layout is False:
            layout = _layout(self.schema, raw)
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[key] = layout
        return layout

    def _group(self, layout: _Layout, raws: list) -> pa.RecordBatch | None:
        m = len(raws)
        joined = b"".join(raws)
        if len(joined) != m * layout.size:
            return None
        M = np.frombuffer(joined, dtype=np.uint8).reshape(m, layout.size)
        arrays = []
        for node in layout.columns:
            a = _assemble(M, node, m)
            if a is None:
                return None
            arrays.append(a)
        try:
            batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema)
            batch.validate(full=True)
        except (pa.ArrowInvalid, ValueError):
            return None
        return batch

    def _slow(self, head: bytes, raws: list) -> list[pa.RecordBatch] | None:
        """Arrow's own reader over the schema and these batches; None unless one batch each."""
        try:
            batches = list(pa.ipc.open_stream(b"".join([head, *raws, EOS])))
        except Exception:
            return None
        if len(batches) != len(raws):
            return None
        self.slow_batches += len(raws)
        return [b if b.schema.equals(self.schema) else b.cast(self.schema) for b in batches]

    def decode(self, head: bytes, raws: list, keys: list | None = None
               ) -> tuple[pa.Table, list[int], list[int]] | None:
        """Every batch of `raws` (the record batch message(s) of one IPC stream each, without the
        schema and the end-of-stream marker) decoded against the schema message `head`: (one table of
        their rows, one chunk per column; `order`: which batch, by index into `raws`, each run of rows
        came from; `lengths`: that run's row count). Batches of a group stay together, so `order` is
        not the given one in general. None when some batch is not exactly one record batch: the
        caller then decodes them one by one.

        `keys` (each batch's node, say): when two batches with the same key would come out in another
        order than given, every row is put back in the given order (a node's rows keep theirs)."""
        raws = list(raws)
        if not (self.fast and _LITTLE):   # the layouts are read as little-endian integers
            got = self._slow(head, raws)
            if got is None:
                return None
            return (pa.Table.from_batches(got, self.schema).combine_chunks(), list(range(len(raws))),
                    [b.num_rows for b in got])
        groups: dict[tuple[bytes, int], list[int]] = {}
        prev_key, prev = None, None
        for i, raw in enumerate(raws):
            if not isinstance(raw, bytes):
                raw = raws[i] = bytes(raw)     # slices of bytes are the cheapest keys
            if len(raw) < 8 or raw[:4] != MARKER:
                return None
            meta = 8 + int.from_bytes(raw[4:8], "little", signed=True)
            if meta <= 8 or meta > len(raw):
                return None
            key = (raw[8:meta], len(raw))
            if key == prev_key:     # the common case: the same layout as the batch before (a memcmp)
                prev.append(i)
                continue
            g = groups.get(key)
            if g is None:
                g = groups[key] = [i]
            else:
                g.append(i)
            prev_key, prev = key, g
        parts: list[tuple[list[int], list[pa.RecordBatch], int]] = []
        slow: list[int] = []
        for key, idx in groups.items():
            layout = self._layout_of(key, raws[idx[0]]) if len(idx) >= MIN_GROUP else None
            batch = self._group(layout, [raws[i] for i in idx]) if layout is not None else None
            if batch is None:
                slow += idx
            else:
                self.fast_batches += len(idx)
                parts.append((idx, [batch], layout.rows))
        if slow:
            slow.sort()
            got = self._slow(head, [raws[i] for i in slow])
            if got is None:
                return None
            parts.append((slow, got, -1))
        order: list[int] = []
        lengths: list[int] = []
        batches: list[pa.RecordBatch] = []
        for idx, got, rows in parts:
            order += idx
            lengths += [rows] * len(idx) if rows >= 0 else [b.num_rows for b in got]
            batches += got
        table = pa.Table.from_batches(batches, self.schema).combine_chunks()
        if len(parts) > 1 and keys is not None:
            last: dict = {}
            for i in order:
                k = keys[i]
                if last.get(k, -1) > i:
                    return _in_order(table, order, lengths)
                last[k] = i
        return table, order, lengths


def _in_order(table: pa.Table, order: list[int], lengths: list[int]) -> tuple[pa.Table, list[int], list[int]]:
    """The rows again in the given order of their batches."""
    lens = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    pos = np.empty(len(order), dtype=np.int64)
    pos[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
    n_given, s_given = lens[pos], starts[pos]       # batch i's rows: s_given[i] .. + n_given[i]
    total = int(n_given.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(n_given) - n_given, n_given)
    take = np.repeat(s_given, n_given) + within
    return table.take(pa.array(take)), list(range(len(order))), n_given.tolist()
