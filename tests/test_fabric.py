"""The NVLink fabric's facts (foreshock/fabric.py) and the schema's fabric columns: old files still read."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from foreshock import dataset, fabric, schema

TS = 1_780_000_000_000_000_000
CLUSTER = bytes.fromhex("9a1d5c3e27b04f6a8c11d2e3f4a5b6c7")


def _gpu_row(gpu: int, **extra) -> dict:
    return {"ts": TS, "node": "tray-07", "gpu": gpu, "gpu_lost": False, "power_w": 900.0, **extra}


def test_a_file_written_before_the_fabric_columns_still_reads(tmp_path):
    """Schema v1 gained nullable columns: a file without them reads with them null, beside a new file."""
    old_schema = pa.schema([f for f in schema.schema("gpu") if f.name not in fabric.GPU_COLUMNS])
    old = pa.Table.from_pylist([_gpu_row(0), _gpu_row(1)], schema=old_schema)
    part = tmp_path / "table=gpu" / "date=2026-05-28" / "node=tray-07"
    part.mkdir(parents=True)
    pq.write_table(old, part / "part-1-old-0.parquet")
    w = dataset.DatasetWriter(tmp_path, fsync=False)
    new = {"fabric_state": 3, "fabric_status": 0, "fabric_cluster_uuid": fabric.cluster_uuid(CLUSTER),
           "fabric_clique_id": 32766, "nvlink_domain": "x/32766", "fabric_health_mask": 0x51AA,
           "fabric_degraded_bw": True, "fabric_incorrect_configuration": 5}
    w.append_rows("gpu", [_gpu_row(2, ts=TS + 1, **new)])
    w.flush()
    back = dataset.read_table(tmp_path, "gpu")
    assert back.schema.equals(schema.schema("gpu"), check_metadata=False)
    rows = back.to_pylist()
    assert [r["gpu"] for r in rows] == [0, 1, 2]
    assert all(rows[i][c] is None for i in (0, 1) for c in fabric.GPU_COLUMNS)
    assert rows[0]["power_w"] == 900.0
    assert {c: rows[2][c] for c in new} == new
    # the same through conform, what the control plane does with a batch from an older collector
    conformed = schema.conform("gpu", old)
    assert conformed.schema.equals(schema.schema("gpu")) and conformed.column("nvlink_domain").null_count == 2


def test_every_fabric_column_is_declared_once_in_the_gpu_table():
    names = schema.schema("gpu").names
    assert [c for c in names if c in fabric.GPU_COLUMNS] == list(fabric.GPU_COLUMNS)
    assert set(fabric.gpu_columns(None)) == set(fabric.GPU_COLUMNS)
    info = fabric.FabricInfo(CLUSTER, 0, 1, fabric.STATE_COMPLETED, 0x51AA, 1)
    assert set(fabric.gpu_columns(info)) == set(fabric.GPU_COLUMNS)
    schema.to_table("gpu", [_gpu_row(0, **fabric.gpu_columns(info))])  # the types fit


def test_health_mask_fields_unsupported_or_undefined_are_null():
    assert set(fabric.decode_health_mask(None).values()) == {None}
    assert set(fabric.decode_health_mask(0).values()) == {None}
    # 3 is not a value NVML defines for a two-state field: unknown, not healthy
    assert fabric.decode_health_mask(3)["fabric_degraded_bw"] is None
    assert fabric.decode_health_mask(1)["fabric_degraded_bw"] is True
    assert fabric.decode_health_mask(2)["fabric_degraded_bw"] is False


def test_cluster_uuid_and_domain():
    assert fabric.cluster_uuid(bytes(16)) is None
    assert fabric.cluster_uuid(CLUSTER) == "9a1d5c3e-27b0-4f6a-8c11-d2e3f4a5b6c7"
    with pytest.raises(ValueError, match="12 bytes.*9a1d"):
        fabric.cluster_uuid(CLUSTER[:12])
    assert fabric.nvlink_domain(None, 3) is None and fabric.nvlink_domain("u", None) is None
    assert fabric.nvlink_domain("u", 0) == "u/0"


def test_the_healthy_mask_decodes_to_healthy():
    assert fabric.decode_health_mask(fabric.HEALTHY_MASK) == {
        "fabric_degraded_bw": False, "fabric_route_recovery": False, "fabric_route_unhealthy": False,
        "fabric_access_timeout_recovery": False, "fabric_incorrect_configuration": 1,
        "fabric_gfm_disconnected": False}
