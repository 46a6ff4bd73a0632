"""A history written by another writer than Foreshock's (schema v1, docs/schema.md) gives the features
Foreshock's own files give: rows in any order within a file, a column the schema does not name, wider
floats and plain strings where Foreshock writes float32 and dictionaries. A writer that samples less often
than once per feature step is told so by `foreshock evaluate`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from foreshock import cli
from foreshock.predictor import offline, signals


def _features(root):
    with offline.FeatureBuilder(root, workers=1) as fb:
        return {nf.node: (nf.step_end_ns, nf.X) for nf in fb}


def _rewritten(table: pa.Table, rng) -> pa.Table:
    cols = []
    for field, col in zip(table.schema, table.columns):
        if pa.types.is_float32(field.type):
            col = col.cast(pa.float64())
        elif pa.types.is_dictionary(field.type):
            col = col.cast(pa.string())
        cols.append(col)
    out = pa.Table.from_arrays(cols, names=table.column_names).append_column(
        "vendor_note", pa.array(["written elsewhere"] * len(table)))
    return out.take(rng.permutation(len(out)))


def test_another_writers_files_give_the_same_features(small_world, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(small_world, other)
    rng = np.random.default_rng(0)
    rewritten = 0
    for path in sorted(other.rglob("*.parquet")):
        if "table=incidents" in str(path):
            continue
        table = pq.read_table(path)
        if len(table) > 1:
            pq.write_table(_rewritten(table, rng), path, use_dictionary=False)
            rewritten += 1
    assert rewritten > 50
    ours, theirs = _features(small_world), _features(other)
    assert sorted(ours) == sorted(theirs) and len(ours) == 12
    for node, (ends, X) in ours.items():
        np.testing.assert_array_equal(theirs[node][0], ends)
        np.testing.assert_array_equal(theirs[node][1], X, err_msg=node)   # NaN where NaN, bit for bit


def _sampled_every_other_minute(table: pa.Table) -> pa.Table:
    minute = np.asarray(table.column("ts").cast(pa.int64())) // 60_000_000_000
    return table.filter(pa.array(minute % 2 == 0))


def test_a_history_sampled_every_two_minutes_is_named_by_evaluate(small_world, tmp_path, capsys):
    """Every sampled table kept at one row in two minutes (events and incidents whole): each node is sampled
    less often than once per feature step, and evaluate's report and stderr say so and that its counts were
    spread over the steps between samples, so it evaluates about as many node-days as the history as
    written, sampled every minute with its missed samples and outages, which raises no such warning. With
    only its ports' rows thinned so, the warning names that table alone."""
    thinned = {}
    for name, tables in (("sparse", [t for t in signals.TABLES if t != "events"]), ("ports", ["rdma_port"])):
        thinned[name] = tmp_path / name
        shutil.copytree(small_world, thinned[name])
        for table in tables:
            for path in sorted(thinned[name].glob(f"table={table}/**/*.parquet")):
                pq.write_table(_sampled_every_other_minute(pq.read_table(path)), path)
    reports = {}
    for data, sparse_nodes in ((small_world, 0), (thinned["sparse"], 12), (thinned["ports"], 12)):
        out = tmp_path / f"{data.name}.json"
        assert cli.main(["evaluate", "--data", str(data), "--json", str(out)]) == 0
        report = reports[data.name] = json.loads(out.read_text())
        interval = report["telemetry_interval"]
        assert interval["nodes"] == 12 and interval["nodes_sampled_less_than_once_a_step"] == sparse_nodes
        assert interval["of_those_spread_over_their_steps"] == sparse_nodes
        err = capsys.readouterr().err
        assert ("12 of 12 nodes were sampled less often than once per feature step" in err) == bool(sparse_nodes)
        assert ("12 of them had each sample's counts spread over the steps it covers" in err) == bool(sparse_nodes)
    sparse, ports = reports["sparse"]["telemetry_interval"], reports["ports"]["telemetry_interval"]
    assert 110 <= sparse["median_seconds_between_samples"] <= 130
    assert sparse["by_table"]["gpu"]["nodes_sampled_less_than_once_a_step"] == 12
    # only the ports every two minutes: named by table, the GPUs sampled every minute are not
    assert ports["by_table"]["rdma_port"]["nodes_sampled_less_than_once_a_step"] == 12
    assert ports["by_table"]["rdma_port"]["of_those_spread_over_their_steps"] == 12
    assert ports["by_table"]["gpu"]["nodes_sampled_less_than_once_a_step"] == 0
    assert "by table: rdma_port on 12 (median 120 s)" in err and "gpu on" not in err
    for name in ("sparse", "ports"):
        assert reports[name]["node_days"] == pytest.approx(reports[small_world.name]["node_days"], rel=0.02)
