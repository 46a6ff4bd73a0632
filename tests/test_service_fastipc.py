"""The round decoder (service/fastipc.py): many record batches of one table decoded at once give the
same table as Arrow's own reader, and the value checks behind it still refuse each bad batch alone."""

from __future__ import annotations

import datetime as dt
import math
import time

import pyarrow as pa
import pytest

from foreshock import schema as sch
from foreshock.collectors.simulated import SimpleNodeModel
from foreshock.collectors.uplink import encode_table, split_stream
from foreshock.service import fastipc
from foreshock.service.ingest import Ingest
from foreshock.service.validation import wire_schema
from foreshock.service.nodes import NodeBook


def _reference(head: bytes, bodies: list[bytes]) -> list[pa.RecordBatch]:
    return [b for body in bodies for b in pa.ipc.open_stream(head + body + fastipc.EOS)]


def _sweeps(n: int, now: int | None = None) -> dict[str, tuple[bytes, list[bytes]]]:
    now = now or time.time_ns()
    out: dict[str, tuple[bytes, list[bytes]]] = {}
    for i in range(n):
        for name, t in SimpleNodeModel(f"node-{i:03d}", gpus=8, hcas=8, seed=i).sample(now).items():
            head, body = split_stream(encode_table(name, t))
            out.setdefault(name, (head, []))[1].append(body)
    return out


def _in_order(table: pa.Table, order: list[int], lengths: list[int], n: int) -> list[pa.Table]:
    parts: list = [None] * n
    at = 0
    for i, k in zip(order, lengths):
        parts[i] = table.slice(at, k)
        at += k
    return parts


@pytest.mark.parametrize("name", ["gpu", "nvlink", "rdma_port", "netdev", "host_net"])
def test_simulated_sweeps_decode_as_arrow_reads_them(name):
    head, bodies = _sweeps(40)[name]
    dec = fastipc.BatchDecoder(wire_schema(name))
    table, order, lengths = dec.decode(head, bodies)
    assert dec.fast_batches == len(bodies) and sorted(order) == list(range(len(bodies)))
    ref = _reference(head, bodies)
    for part, want in zip(_in_order(table, order, lengths, len(bodies)), ref):
        assert part.equals(pa.Table.from_batches([want]).cast(part.schema))
    plain = fastipc.BatchDecoder(wire_schema(name), fast=False)      # the reference behind the seam
    got = plain.decode(head, bodies)
    assert plain.fast_batches == 0 and plain.slow_batches == len(bodies) and got[1] == list(range(len(bodies)))
    for part, want in zip(_in_order(table, order, lengths, len(bodies)), _in_order(*got, len(bodies))):
        assert part.equals(want)


def _encode(table: pa.Table) -> tuple[bytes, bytes]:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return split_stream(sink.getvalue().to_pybytes())


def test_nulls_odd_row_counts_strings_and_maps():
    schema = pa.schema([("i", pa.int16()), ("f", pa.float32()), ("b", pa.bool_()), ("s", pa.string()),
                        ("t", pa.timestamp("ns", tz="UTC")),
                        ("m", pa.map_(pa.string(), pa.uint64())), ("l", pa.list_(pa.string()))])
    bodies, head = [], None
    for k in range(20):   # 3 rows each, the same layout (string lengths and null counts), other values
        t = pa.table({"i": [k, None, -k], "f": [0.5 * k, None, 1.0], "b": [k % 2 == 0, None, True],
                      "s": [f"a{k % 10}", None, "xyz"], "t": pa.array([k, k + 1, None], pa.timestamp("ns", tz="UTC")),
                      "m": pa.array([[("k1", k)], None, [("k2", 2), ("k3", 3)]], pa.map_(pa.string(), pa.uint64())),
                      "l": pa.array([["x"], [], None], pa.list_(pa.string()))}, schema=schema)
        head, body = _encode(t)
        bodies.append(body)
    dec = fastipc.BatchDecoder(schema)
    table, order, lengths = dec.decode(head, bodies)
    assert dec.fast_batches == 20 and lengths == [3] * 20
    want = pa.Table.from_batches(_reference(head, [bodies[i] for i in order])).combine_chunks()
    assert table.equals(want)
    table.validate(full=True)


def test_a_batch_of_another_layout_or_bad_bytes_goes_arrows_way_and_a_nodes_rows_keep_their_order():
    schema = pa.schema([("node", pa.string()), ("v", pa.int64())])
    rows = [("aa", 1)] * 10 + [("bbb", 2)] + [("aa", 3)] * 2
    bodies, head = [], None
    for node, v in rows:
        head, body = _encode(pa.table({"node": [node], "v": [v]}, schema=schema))
        bodies.append(body)
    keys = [f"k{i}" for i in range(len(rows))]
    keys[10] = keys[11] = "same-node"     # its second batch is in the big group, its first is not
    dec = fastipc.BatchDecoder(schema)
    table, order, lengths = dec.decode(head, bodies, keys)
    assert order == list(range(len(rows))) and table.column("v").to_pylist() == [v for _, v in rows]
    assert dec.fast_batches == 12 and dec.slow_batches == 1

    # A batch whose string bytes are not UTF-8: the group is refused by the full validation and read
    # by Arrow's reader one by one, as before this decoder.
    bad = bytearray(bodies[0])
    bad[bad.rfind(b"aa")] = 0xFF
    dec = fastipc.BatchDecoder(schema)
    got = dec.decode(head, [bytes(bad)] + bodies[1:10])
    assert got is not None and dec.fast_batches == 0 and dec.slow_batches == 10

    # Not exactly one record batch message: None, the caller decodes them one by one.
    assert fastipc.BatchDecoder(schema).decode(head, [bodies[0] + bodies[1]] + bodies[2:10]) is None
    assert fastipc.BatchDecoder(schema).decode(head, [b"garbage!"] + bodies[1:10]) is None


def test_value_checks_behind_the_fast_decoder_refuse_each_bad_batch_alone():
    now = dt.datetime.now(dt.timezone.utc)
    queue: list = []
    ing = Ingest(NodeBook(), lambda p: queue.append(p) or len(queue))
    nodes = [f"n{i:02d}" for i in range(16)]
    sessions = {n: ing.open_session("test", "") for n in nodes}

    def gpu(node, **cols):
        row = {"ts": now, "node": node, "gpu": 0, "gpu_lost": False, "temperature_c": 50.0, "energy_j": 10.0,
               **cols}
        return encode_table("gpu", sch.to_table("gpu", [row]))

    for n in nodes:   # the first sweep of each stream sends the schema: learnt
        assert not ing.accept(sessions[n], n, f"c-{n}", 1, [("gpu", 1, gpu(n))]).rejections
    ing.take_round(queue)
    queue.clear()
    special = {"n03": {"temperature_c": math.nan}, "n05": {"energy_j": -1.0}, "n07": {"node": "n99"},
               "n09": {"ts": now + dt.timedelta(hours=2)}}
    for n in nodes:
        cols = special.get(n, {})
        blob = gpu(cols.pop("node", n), **cols)
        assert not ing.accept(sessions[n], n, f"c-{n}", 2, [("gpu", 1, split_stream(blob)[1], True)]).rejections
    out = ing.take_round(queue)
    assert ing._decoders["gpu"].fast_batches >= 12
    assert sorted(out["gpu"].column("node").to_pylist()) == sorted(set(nodes) - set(special))
    verdicts = {n: [r.reason for r in sessions[n].deferred] for n in nodes}
    assert verdicts["n03"] == ["nan_value"] and verdicts["n05"] == ["negative_counter"]
    assert verdicts["n07"] == ["node_mismatch"] and verdicts["n09"] == ["ts_future"]
    assert all(not v for n, v in verdicts.items() if n not in special)
