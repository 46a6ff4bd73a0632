"""Telemetry value checks, as pure functions: a round's batches in, the checked tables and the verdicts out.

Receipt (service/ingest.py) has already checked each batch's header and schema; what is left is its
values, checked once a round, vectorised over every batch of a table received since the last one:

  oversized (rows), bad_schema (a null in a key column), node_mismatch (rows of another node than the
  batch's), ts_future / ts_past (clock or replay trouble), nan_value (NaN or infinity: a missing value
  is null, never NaN), negative_counter, bad_ipc (record batches that do not decode).

A batch that fails a check on a table is taken out of that table, and its verdict (`Verdict`, the
batch's index in the round) goes back to the caller: the service process puts it on the batch's
stream (ingest.Ingest.take_round), the scoring worker sends it there (service/worker.py). Both run
these functions; nothing here holds state but the caller's decoders (fastipc.BatchDecoder, one per
table), which only cache how record batches are laid out.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from foreshock import schema as sch
from foreshock.service.fastipc import EOS, BatchDecoder

log = logging.getLogger(__name__)

COUNTER_UNITS = frozenset({"errors", "count", "bytes", "rows", "replays", "KiB", "J", "probes"})


class _TableCheck:
    """What to check in one schema-v1 table, derived from its declaration once."""

    def __init__(self, table: str):
        self.schema = sch.schema(table)
        # The canonical in-memory schema: schema-v1 names and types, no unit/help metadata, one object
        # shared by every batch so that combining thousands of them is cheap.
        self.wire = pa.schema([pa.field(f.name, f.type, f.nullable) for f in self.schema])
        self.keys = [f.name for f in self.schema if not f.nullable]
        fields = sch.TABLES[table]
        self.floats = [f.name for f in fields if pa.types.is_floating(f.type)]
        self.signed_counters = [f.name for f in fields if f.unit in COUNTER_UNITS and
                                (pa.types.is_signed_integer(f.type) or pa.types.is_floating(f.type))]
        self.ts_columns = [f.name for f in fields if pa.types.is_timestamp(f.type)]


_CHECKS = {name: _TableCheck(name) for name in sch.TABLES}


def wire_schema(table: str) -> pa.Schema:
    """The schema-v1 table's in-memory schema as every checked batch has it (names, types, nullability;
    no unit/help metadata)."""
    return _CHECKS[table].wire


class ValueLimits(Protocol):
    """The bounds the value checks read (ingest.IngestLimits has them)."""
    max_table_rows: int
    max_past_seconds: float
    max_future_seconds: float


@dataclass(frozen=True)
class RawBatch:
    """A table's IPC stream whose schema message is known good: decoded with its round's others."""
    head: bytes        # the schema message
    body: bytes        # the record batch message(s), without the end-of-stream marker


class Received(Protocol):
    """A batch as the checks read it: its node and its tables (ingest.Pending is one)."""
    node: str
    tables: Mapping[str, pa.Table | RawBatch]


class Verdict(NamedTuple):
    """A table of one batch refused: `part` is the batch's index in the round."""
    part: int
    table: str
    reason: str
    detail: str


@dataclass
class CheckedRound:
    tables: dict[str, pa.Table] = field(default_factory=dict)   # what passed, per table, never empty
    verdicts: list[Verdict] = field(default_factory=list)       # in the order the checks found them
    rows: collections.Counter = field(default_factory=collections.Counter)   # table -> rows taken


def decode_raw(name: str, raw: RawBatch) -> pa.Table | None:
    """One RawBatch read the general way; None when it is not an Arrow IPC stream."""
    try:
        return pa.ipc.open_stream(raw.head + raw.body + EOS).read_all().cast(_CHECKS[name].wire)
    except Exception:
        return None


def check_round(batches: Sequence[Received], now_ns: int, limits: ValueLimits,
                decoders: dict[str, BatchDecoder]) -> CheckedRound:
    """Decode and check the values of every batch at once, per table. `decoders`: the caller's, kept
    from round to round (one per table, made here when missing)."""
    by_table: dict[str, list[tuple[int, object]]] = collections.defaultdict(list)
    for i, batch in enumerate(batches):
        for name, t in batch.tables.items():
            by_table[name].append((i, t))
    out = CheckedRound()
    for name, parts in by_table.items():
        try:
            table = _round_table(batches, name, parts, now_ns, limits, decoders, out.verdicts)
        except Exception:
            log.exception("ingest: value checks of %d %s tables failed; dropping them", len(parts), name)
            continue
        if table is not None and table.num_rows:
            out.tables[name] = table
            out.rows[name] += table.num_rows
    return out


def _round_table(batches: Sequence[Received], name: str, parts: list[tuple[int, object]], now_ns: int,
                 limits: ValueLimits, decoders: dict[str, BatchDecoder], verdicts: list[Verdict]) -> pa.Table | None:
    """One table of the round: raw batches decoded in one Arrow read (a stream of the schema message
    and every batch's record batches), then the value checks over all rows at once."""
    raws = [(i, t) for i, t in parts if isinstance(t, RawBatch)]
    ready = [(i, t) for i, t in parts if not isinstance(t, RawBatch)]
    chunks: list[pa.Table] = []
    owners: list[int] = []
    lengths: list[int] = []
    if raws:
        decoder = decoders.get(name)
        if decoder is None:
            decoder = decoders[name] = BatchDecoder(_CHECKS[name].wire)
        try:
            # Vectorised across batches (service/fastipc.py); a node's rows keep their order.
            got = decoder.decode(raws[0][1].head, [r.body for _, r in raws], [batches[i].node for i, _ in raws])
        except Exception:
            log.exception("ingest: decoding %d %s batches failed; one by one instead", len(raws), name)
            got = None
        if got is not None:   # else some stream held several batches: take them one by one
            joined, order, sizes = got
            chunks.append(joined)
            owners += [raws[k][0] for k in order]
            lengths += sizes
        else:
            for i, raw in raws:
                t = decode_raw(name, raw)
                if t is None:
                    verdicts.append(Verdict(i, name, "bad_ipc", f"table {name!r}: not an Arrow IPC stream"))
                    continue
                chunks.append(t)
                owners.append(i)
                lengths.append(t.num_rows)
    for i, t in ready:
        chunks.append(t)
        owners.append(i)
        lengths.append(t.num_rows)
    if not chunks:
        return None
    table = pa.concat_tables(chunks) if len(chunks) > 1 else chunks[0]
    # One chunk per column: the checks here and the scorer's kernels then run once, not per batch.
    if any(c.num_chunks > 1 for c in table.columns):
        table = table.combine_chunks()
    kept, refused = check_table(name, table, [batches[i].node for i in owners],
                                np.asarray(lengths, dtype=np.int64), now_ns, limits)
    verdicts += [Verdict(owners[k], name, reason, detail) for k, reason, detail in refused]
    return kept


def check_table(name: str, table: pa.Table, nodes: Sequence[str], lengths: np.ndarray, now_ns: int,
                limits: ValueLimits) -> tuple[pa.Table | None, list[tuple[int, str, str]]]:
    """The value checks over one table made of consecutive parts (part k: `lengths[k]` rows, sent by
    node `nodes[k]`). Returns the rows of the parts that pass (None: none did) and, per part refused,
    (k, reason, detail)."""
    check, lim = _CHECKS[name], limits
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    bad: dict[int, tuple[str, str]] = {}   # part index -> (reason, detail)
    for i in np.flatnonzero(lengths > lim.max_table_rows).tolist():
        bad[i] = ("oversized", f"table {name!r}: {int(lengths[i])} rows, at most {lim.max_table_rows}")

    def per_part(fn):
        """Run a check on each part (only when the whole-table check found something)."""
        for i in range(len(nodes)):
            if i not in bad:
                verdict = fn(table.slice(int(starts[i]), int(lengths[i])))
                if verdict:
                    bad[i] = verdict

    for col in check.keys:
        if table.column(col).null_count:
            per_part(lambda t, col=col: ("bad_schema", f"table {name!r}: column {col!r} must not be null")
                     if t.column(col).null_count else None)
    # Rows of another node: compare each row's node with its part's node, in one pass.
    node_codes = pc.dictionary_encode(table.column("node")).combine_chunks()
    code_of = {n: i for i, n in enumerate(node_codes.dictionary.to_pylist())}
    row_owner = np.repeat(np.array([code_of.get(n, -2) for n in nodes]), lengths)
    codes = node_codes.indices.to_numpy(zero_copy_only=False)
    codes = np.where(np.isnan(codes), -1, codes).astype(np.int64) if codes.dtype.kind == "f" else codes
    mismatch = codes != row_owner
    row_part = np.repeat(np.arange(len(nodes)), lengths)
    for i in np.unique(row_part[mismatch]).tolist():
        if i not in bad:
            bad[i] = ("node_mismatch", f"table {name!r}: rows of another node in a batch from {nodes[i]!r}")
    for col in check.ts_columns:
        mm = pc.min_max(table.column(col))
        lo, hi = mm["min"], mm["max"]
        if not hi.is_valid:
            continue
        future = now_ns + lim.max_future_seconds * 1e9
        past = now_ns - lim.max_past_seconds * 1e9
        if hi.value > future or (col == "ts" and lo.value < past):
            def ts_check(t, col=col):
                m = pc.min_max(t.column(col))
                if not m["max"].is_valid:
                    return None
                if m["max"].value > future:
                    return ("ts_future", f"table {name!r}: {col} {(m['max'].value - now_ns) / 1e9:.0f} s in the "
                            f"future (at most {lim.max_future_seconds:.0f} s; check the node's clock)")
                if col == "ts" and m["min"].value < past:
                    return ("ts_past", f"table {name!r}: ts {(now_ns - m['min'].value) / 1e9:.0f} s in the past "
                            f"(at most {lim.max_past_seconds:.0f} s)")
                return None
            per_part(ts_check)
    for col in check.floats:
        c = table.column(col)
        if c.null_count == len(c):
            continue
        if pc.any(pc.invert(pc.is_finite(c))).as_py():
            per_part(lambda t, col=col: ("nan_value", f"table {name!r}: column {col!r} holds NaN or infinity "
                                         "(a missing value is null)")
                     if pc.any(pc.invert(pc.is_finite(t.column(col)))).as_py() else None)
    for col in check.signed_counters:
        c = table.column(col)
        if c.null_count == len(c):
            continue
        lo_c = pc.min(c).as_py()
        if lo_c is not None and lo_c < 0:
            per_part(lambda t, col=col: ("negative_counter", f"table {name!r}: counter {col!r} is negative "
                                         f"({pc.min(t.column(col)).as_py()})")
                     if (pc.min(t.column(col)).as_py() or 0) < 0 else None)
    if not bad:
        return table, []
    refused = [(i, reason, detail) for i, (reason, detail) in bad.items()]
    keep = np.ones(len(nodes), dtype=bool)
    keep[list(bad)] = False
    return (table.filter(pa.array(np.repeat(keep, lengths))) if keep.any() else None), refused
