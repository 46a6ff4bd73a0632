"""node_exporter parity: the rdma source reads, for every InfiniBand counter, what node_exporter reports.

Two oracles, both committed under tests/golden with their provenance:
- node_exporter_infiniband_procfs_fixture.txt: what node_exporter reports for ../shared/fixtures/procfs
  (procfs's expectations for that tree, under node_exporter's metric names);
- node_exporter_infiniband.txt: node_exporter's own e2e output for its own fixture tree, which the test
  rebuilds as sysfs files (data counters / 4, as the kernel stores words) and reads back.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from foreshock.collectors.rdma import COUNTER_COLUMNS, RdmaSource

GOLDEN = Path(__file__).resolve().parent / "golden"

LINE_RE = re.compile(r'^(?P<name>[A-Za-z0-9_]+)\{device="(?P<device>[^"]+)",port="(?P<port>\d+)"\} (?P<value>\S+)$')

# node_exporter collector/infiniband_linux.go metric -> (sysfs file, multiplier from file to metric)
NODE_EXPORTER_FILES = {
    "link_downed_total": ("link_downed", 1),
    "link_error_recovery_total": ("link_error_recovery", 1),
    "multicast_packets_received_total": ("multicast_rcv_packets", 1),
    "multicast_packets_transmitted_total": ("multicast_xmit_packets", 1),
    "port_constraint_errors_received_total": ("port_rcv_constraint_errors", 1),
    "port_constraint_errors_transmitted_total": ("port_xmit_constraint_errors", 1),
    "port_data_received_bytes_total": ("port_rcv_data", 4),
    "port_data_transmitted_bytes_total": ("port_xmit_data", 4),
    "port_discards_received_total": ("port_rcv_discards", 1),
    "port_discards_transmitted_total": ("port_xmit_discards", 1),
    "port_errors_received_total": ("port_rcv_errors", 1),
    "port_packets_received_total": ("port_rcv_packets", 1),
    "port_packets_transmitted_total": ("port_xmit_packets", 1),
    "port_transmit_wait_total": ("port_xmit_wait", 1),
    "unicast_packets_received_total": ("unicast_rcv_packets", 1),
    "unicast_packets_transmitted_total": ("unicast_xmit_packets", 1),
}
FILE_TO_COLUMN = {"port_rcv_data": "port_rcv_bytes", "port_xmit_data": "port_xmit_bytes"}


def load_golden(name: str) -> dict[tuple[str, str, int], float]:
    out = {}
    for line in (GOLDEN / name).read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        m = LINE_RE.match(line)
        assert m, f"{name}: unparsable golden line {line!r}"
        out[(m["name"], m["device"], int(m["port"]))] = float(m["value"])
    return out


def camel_to_file(field: str) -> str:
    if field == "VL15Dropped":
        return "VL15_dropped"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", field).lower()


def our_value(row: dict, file: str):
    column = FILE_TO_COLUMN.get(file, file)
    if column in row:
        return row[column]
    return dict(row["extra_counters"] or {}).get(file)


def rows_by_port(sysfs) -> dict[tuple[str, int], dict]:
    src = RdmaSource("parity", sysfs=str(sysfs))
    table = src.sweep(time.time_ns())["rdma_port"]
    assert src.errors == 0
    src.close()
    return {(r["device"], r["port"]): r for r in table.to_pylist()}


def test_every_counter_of_the_procfs_fixture_matches_node_exporter(procfs_fixture):
    golden = load_golden("node_exporter_infiniband_procfs_fixture.txt")
    rows = rows_by_port(procfs_fixture / "sys")
    checked = set()
    for (metric, device, port), expected in golden.items():
        row = rows[(device, port)]
        if metric.startswith("node_infiniband_"):
            name = metric[len("node_infiniband_"):]
            if name == "state_id":
                got = row["state"]
            elif name == "physical_state_id":
                got = row["phys_state"]
            elif name == "rate_bytes_per_second":
                got = row["rate_gbps"] * 1e9 / 8
            else:
                file, _mult = NODE_EXPORTER_FILES[name]
                got = our_value(row, file)
                checked.add((device, port, FILE_TO_COLUMN.get(file, file)))
        else:
            file = camel_to_file(metric[len("procfs_infiniband_"):])
            got = our_value(row, file)
            checked.add((device, port, file))
        assert got == expected, f"{metric}{{{device},{port}}}: collector {got}, node_exporter {expected}"
    # ...and the other way round: every counter the collector read is one node_exporter/procfs reports.
    for (device, port), row in rows.items():
        read = {c for c in COUNTER_COLUMNS if row[c] is not None} | set(dict(row["extra_counters"] or {}))
        missing = read - {c for d, p, c in checked if (d, p) == (device, port)}
        assert not missing, f"{device}/{port}: counters without a node_exporter value: {sorted(missing)}"


def _build_tree_from_e2e(root, golden):
    for (metric, device, port), value in golden.items():
        name = metric[len("node_infiniband_"):]
        if name.startswith("legacy_"):
            continue
        file, mult = NODE_EXPORTER_FILES[name]
        raw = int(value)
        assert raw % mult == 0, f"{metric}: {raw} bytes is not a whole number of 4-byte words"
        d = root / "class" / "infiniband" / device / "ports" / str(port) / "counters"
        d.mkdir(parents=True, exist_ok=True)
        (d / file).write_text(f"{raw // mult}\n")


def test_node_exporters_own_e2e_tree_reads_back_equal(tmp_path):
    golden = load_golden("node_exporter_infiniband.txt")
    assert len(golden) > 40
    _build_tree_from_e2e(tmp_path, golden)
    rows = rows_by_port(tmp_path)
    compared = 0
    for (metric, device, port), expected in golden.items():
        name = metric[len("node_infiniband_"):]
        if name.startswith("legacy_"):
            continue
        file, _ = NODE_EXPORTER_FILES[name]
        assert our_value(rows[(device, port)], file) == expected, (metric, device, port)
        compared += 1
    # Nothing read that node_exporter did not report:
    reported = {(d, p) for (_m, d, p) in golden}
    assert set(rows) == reported
    assert compared == sum(1 for (m, _d, _p) in golden if "legacy_" not in m)


def test_a_counter_reading_na_no_pma_is_null_not_zero(procfs_fixture, tmp_path):
    shutil.copytree(procfs_fixture / "sys", tmp_path / "sys")
    f = tmp_path / "sys/class/infiniband/mlx4_0/ports/1/counters/symbol_error"
    f.chmod(0o644)
    f.write_text("N/A (no PMA)\n")
    rows = rows_by_port(tmp_path / "sys")
    assert rows[("mlx4_0", 1)]["symbol_error"] is None
    assert rows[("mlx4_0", 2)]["symbol_error"] == 0


@pytest.mark.parametrize("words", [0, 1, 2**32 - 1, 2**61])
def test_data_words_become_bytes(tmp_path, words):
    d = tmp_path / "class/infiniband/mlx5_9/ports/1/counters"
    d.mkdir(parents=True)
    (d / "port_rcv_data").write_text(f"{words}\n")
    (d / "port_xmit_data").write_text(f"{words + 1}\n")
    row = rows_by_port(tmp_path)[("mlx5_9", 1)]
    assert row["port_rcv_bytes"] == 4 * words
    assert row["port_xmit_bytes"] == 4 * (words + 1)
