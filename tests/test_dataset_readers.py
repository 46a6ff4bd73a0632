"""The dataset layout read by the tools people use: pandas, pyarrow, DuckDB and Polars open a table
directory as it is written (docs/schema.md, "Layout on disk"), with `node` from the files."""

from __future__ import annotations

import datetime as dt

import duckdb
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from foreshock import dataset

NODES = ["node-a", "node/b"]   # the second is URL-quoted in its path (node=node%2Fb)


@pytest.fixture(scope="module")
def gpu_table(tmp_path_factory):
    root = tmp_path_factory.mktemp("readers")
    w = dataset.DatasetWriter(root, fsync=False)
    midnight = dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc).timestamp()
    rows = [{"ts": dt.datetime.fromtimestamp(midnight - 30 + 10 * i, dt.timezone.utc), "node": node, "gpu": i % 8,
             "gpu_lost": False, "ecc_corrected_volatile": 100 * k + i}
            for k, node in enumerate(NODES) for i in range(6)]   # each node's rows span two dates
    w.append_rows("gpu", rows)
    w.close()
    return root / "table=gpu", {(r["node"], r["ecc_corrected_volatile"]) for r in rows}


def _pairs(nodes, values) -> set:
    return {(str(n), int(v)) for n, v in zip(nodes, values)}


def test_pandas_reads_a_table_directory(gpu_table):
    path, expected = gpu_table
    df = pd.read_parquet(path)
    assert _pairs(df["node"], df["ecc_corrected_volatile"]) == expected
    assert sorted(df["date"].astype(str).unique()) == ["2026-12-01", "2026-12-02"]


def test_pyarrow_reads_a_table_directory(gpu_table):
    path, expected = gpu_table
    t = pq.read_table(path)
    assert _pairs(t.column("node").to_pylist(), t.column("ecc_corrected_volatile").to_pylist()) == expected


def test_pyarrow_dataset_reads_a_table_directory_with_the_documented_partitioning(gpu_table):
    import pyarrow.dataset as ds
    path, expected = gpu_table
    with pytest.raises(pa.ArrowTypeError, match="node"):
        ds.dataset(path, format="parquet", partitioning="hive").to_table()   # the trap docs/schema.md names
    t = ds.dataset(path, format="parquet",
                   partitioning=ds.HivePartitioning.discover(infer_dictionary=True)).to_table()
    assert _pairs(t.column("node").to_pylist(), t.column("ecc_corrected_volatile").to_pylist()) == expected


def test_duckdb_reads_a_table_directory(gpu_table):
    path, expected = gpu_table
    rows = duckdb.sql(f"SELECT node, ecc_corrected_volatile FROM read_parquet('{path}/**/*.parquet', "
                      "hive_partitioning = true)").fetchall()
    assert _pairs(*zip(*rows)) == expected


def test_polars_reads_a_table_directory(gpu_table):
    path, expected = gpu_table
    df = pl.read_parquet(f"{path}/**/*.parquet", hive_partitioning=True)
    assert _pairs(df["node"].to_list(), df["ecc_corrected_volatile"].to_list()) == expected


def test_the_project_reader_still_gives_schema_v1(gpu_table):
    from foreshock import schema
    path, expected = gpu_table
    t = dataset.read_table(path.parent, "gpu")
    assert t.schema.equals(schema.schema("gpu"), check_metadata=False)
    assert _pairs(t.column("node").to_pylist(), t.column("ecc_corrected_volatile").to_pylist()) == expected
