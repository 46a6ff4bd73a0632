"""The value checks as pure functions (service/validation.py): a round's batches in, the checked tables
and one verdict per refused batch out, the same whether the service process or the scoring worker
runs them."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from foreshock import schema as sch
from foreshock.collectors.uplink import encode_table, split_stream
from foreshock.service import validation
from foreshock.service.ingest import IngestLimits
from foreshock.service.nodes import lost_gpus


@dataclass
class Batch:
    node: str
    tables: dict = field(default_factory=dict)


def _gpu(node: str, now: dt.datetime, **cols) -> pa.Table:
    row = {"ts": now, "node": node, "gpu": 0, "gpu_lost": False, "temperature_c": 50.0, "energy_j": 10.0, **cols}
    return sch.to_table("gpu", [row]).cast(validation.wire_schema("gpu"))


def test_a_table_in_the_rows_that_pass_and_each_refused_part_out():
    now = dt.datetime.now(dt.timezone.utc)
    now_ns = int(now.timestamp() * 1e9)
    parts = [_gpu("a", now), _gpu("b", now, temperature_c=math.inf), _gpu("x", now),
             _gpu("d", now, ts=now - dt.timedelta(days=2)), _gpu("e", now)]
    table = pa.concat_tables(parts)   # part 2 says it is node c's, its row is node x's
    kept, refused = validation.check_table("gpu", table, ["a", "b", "c", "d", "e"],
                                           np.ones(len(parts), dtype=np.int64), now_ns, IngestLimits())
    assert kept.column("node").to_pylist() == ["a", "e"]
    assert sorted((k, reason) for k, reason, _ in refused) == [(1, "nan_value"), (2, "node_mismatch"),
                                                               (3, "ts_past")]
    assert validation.check_table("gpu", table.slice(0, 1), ["a"], np.array([1]), now_ns, IngestLimits()) == \
        (table.slice(0, 1), [])


def test_a_round_of_raw_and_decoded_batches_names_each_refused_batch_by_its_index():
    now = dt.datetime.now(dt.timezone.utc)
    now_ns = int(now.timestamp() * 1e9)
    head, body = split_stream(encode_table("gpu", _gpu("n0", now)))
    raw = [validation.RawBatch(head, split_stream(encode_table("gpu", _gpu(n, now, **cols)))[1])
           for n, cols in [("n0", {}), ("n1", {"energy_j": -3.0}), ("n2", {"gpu_lost": True})]]
    batches = [Batch(f"n{i}", {"gpu": r}) for i, r in enumerate(raw)]
    batches.append(Batch("n3", {"gpu": _gpu("n3", now, ts=now + dt.timedelta(hours=1))}))
    batches.append(Batch("n4", {"gpu": validation.RawBatch(head, b"\xff\xff\xff\xff\x10\0\0\0" + b"\x01" * 24)}))
    decoders: dict = {}
    checked = validation.check_round(batches, now_ns, IngestLimits(), decoders)
    assert sorted(checked.tables["gpu"].column("node").to_pylist()) == ["n0", "n2"]
    assert checked.rows == {"gpu": 2} and set(decoders) == {"gpu"}
    assert sorted((v.part, v.reason) for v in checked.verdicts) == [(1, "negative_counter"), (3, "ts_future"),
                                                                    (4, "bad_ipc")]
    assert [(e.node, e.kind, e.description) for e in lost_gpus(checked.tables["gpu"], now_ns)] == \
        [("n2", "gpu_lost", "GPU 0 lost")]
