"""The Xid catalogue (foreshock/xid.py) and its readers: the kmsg and NVML collectors, the simulator, the
service's fatal/precursor decision and the predictor's Xid signals all derive their class from it, the
predictor's classes for the codes the old tables listed are unchanged, replayed kmsg sequences of the
documented cases (issue 20) give the outcomes the catalogue says, and repeats of one Xid fold into counted
rows that every reader counts as lines (collectors/repeats.py). The documented cases through a real
control plane, with the Xid context on: tests/test_service_xidcontext.py."""

from __future__ import annotations

import datetime as dt

import pytest

from foreshock import schema as sch
from foreshock import xid as xidcat
from foreshock.collectors.kmsg import KmsgSource, parse_dmesg_line, parse_event
from foreshock.collectors.nvml import FakeNvml, NvmlSource
from foreshock.predictor import signals as sg
from foreshock.service.ingest import Ingest
from foreshock.service.nodes import NodeBook
from foreshock.simulator.model import APP_XIDS

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

# The tables the catalogue replaced, as they were: collectors/kmsg.py (XID_SEVERITY; 144-150 from their
# token, else info), service/ingest.py (FATAL_XIDS, PRECURSOR_XIDS, plus any row marked fatal),
# predictor/signals.py (the row's severity; NVLINK_XIDS), simulator/model.py (XID_SEVERITY, else fatal).
OLD_COLLECTOR = {
    **{x: "precursor" for x in (63, 92, 137)},
    **{x: "application" for x in (13, 31, 43, 45, 68, 69, 94)},
    **{x: "fatal" for x in (48, 62, 64, 74, 79, 95, 119, 120, 136, 140, 155)},
}
OLD_SERVICE_FATAL = {48, 62, 64, 74, 79, 95, 119, 120, 136, 140, 155}
OLD_SERVICE_PRECURSOR = {63, 92, 137}
OLD_PREDICTOR_NVLINK = {74, 137, 144, 145, 146, 147, 148, 149, 150}
OLD_SIMULATOR = {13: "application", 31: "application", 43: "application", 45: "application", 94: "application",
                 63: "precursor", 92: "precursor"}   # everything else: fatal
NVLINK5 = range(144, 151)
UNKNOWN_CODE = 4242


def _events(rows: list[dict]):
    return sch.to_table("events", [{"ts": NOW, "node": "n1", "source": "kmsg", **r} for r in rows])


def _predictor_class(code, severity) -> tuple[str, bool]:
    base = sg.node_base_signals({"events": _events([{"kind": "xid", "severity": severity, "xid": code}])})
    r = base.row(0)
    counted = [c for c in ("fatal", "precursor", "application") if r[f"xid_{c}"] == 1]
    assert len(counted) <= 1
    return (counted[0] if counted else "info"), r["xid_nvlink"] == 1


def _service_decision(code, severity) -> str:
    book = NodeBook()
    ingest = Ingest(book, sink=lambda p: 0)
    ingest.act_on_events({"events": _events([{"kind": "xid", "severity": severity, "xid": code, "gpu": 0}])},
                         now=0)
    if book.fatal:
        return "fatal"
    return "precursor" if ingest.precursors else "none"


def _sum(base, name: str) -> float:
    col = base.values[:, base.names.index(name)]
    return float(col[col == col].sum())


def _kmsg_line(code: int, message: str = "boom") -> str:
    return f"NVRM: Xid (PCI:0000:07:00): {code}, pid=42, name=python3, {message}"


# -- the catalogue ------------------------------------------------------------------------------------

def test_every_entry_is_well_formed():
    for code, e in xidcat.CATALOGUE.items():
        assert e.code == code and e.name and e.severity in xidcat.SEVERITIES
        assert e.resolution in xidcat.RESOLUTIONS
        assert e.generations and set(e.generations) <= set(xidcat.ALL_GPUS)
        assert all(c in xidcat.CATALOGUE for c in e.cancels)
        # A solo hardware verdict is a fatal Xid (or a Fatal NVLink5 one), never an application's.
        assert not e.solo or e.severity == "fatal" or e.token


def test_the_catalogue_covers_the_old_tables_and_the_documented_cases():
    listed = set(OLD_COLLECTOR) | OLD_SERVICE_FATAL | OLD_SERVICE_PRECURSOR | OLD_PREDICTOR_NVLINK | set(OLD_SIMULATOR)
    documented = {45, 95, 162, 163, 109}   # 109: ../shared/fixtures/kmsg/xid-lines.txt
    assert listed | documented <= set(xidcat.CATALOGUE)


def test_unknown_is_one_explicit_entry():
    for code in (UNKNOWN_CODE, 999, None, float("nan"), 2**31 - 1):
        assert xidcat.lookup(code) is xidcat.UNKNOWN
    assert xidcat.severity(UNKNOWN_CODE) == "info" and xidcat.classify(UNKNOWN_CODE, "fatal") == "info"
    assert xidcat.lookup(79).name == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert xidcat.lookup(79).resolution == "RESTART_BM" and xidcat.lookup(95).resolution == "RESET_GPU"


def test_162_cancels_163_and_45_is_never_solo():
    assert xidcat.lookup(162).cancels == (163,)
    assert not xidcat.lookup(45).solo and xidcat.lookup(45).severity == "application"
    assert xidcat.lookup(74).generations == ("A100", "H100")
    assert set(xidcat.lookup(149).generations) == {"B100", "GB200"}


def test_collateral_xids_are_those_a_failing_job_or_domain_puts_on_healthy_gpus():
    collateral = {c for c, e in xidcat.CATALOGUE.items() if e.collateral}
    # every application Xid (teardown, a peer's crash), NVLink errors of a domain, a domain's lost GPUs
    assert {c for c, e in xidcat.CATALOGUE.items() if e.severity == "application"} <= collateral
    assert {74, 79, 109, 155, *range(144, 151)} <= collateral
    # memory and firmware faults are the GPU's own, whatever its neighbours log
    assert not collateral & {48, 62, 63, 64, 92, 95, 119, 120, 136, 140, 154, 162, 163}
    assert xidcat.outstanding_until(163) == (162,) and xidcat.outstanding_until(162) == ()
    assert xidcat.outstanding_until(None) == () and xidcat.outstanding_until(UNKNOWN_CODE) == ()


def test_nvlink5_take_their_class_from_the_token():
    assert xidcat.severity(149, "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x0)") == "fatal"
    assert xidcat.severity(145, "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0)") == "precursor"
    assert xidcat.severity(145, "") == "info"
    assert xidcat.classify(145, "fatal") == "fatal" and xidcat.classify(145, "info") == "info"
    assert xidcat.classify(145, "application") == "info"


# -- the predictor: its classes for the codes the old tables listed are unchanged ---------------------

@pytest.mark.parametrize("code", sorted(OLD_COLLECTOR))
def test_predictor_class_of_an_old_code_is_unchanged(code):
    old = OLD_COLLECTOR[code]
    # What it read from the rows the collectors wrote, and what it reads from the rows they write now.
    assert _predictor_class(code, old) == (old, code in OLD_PREDICTOR_NVLINK)
    assert _predictor_class(code, xidcat.severity(code)) == (old, code in OLD_PREDICTOR_NVLINK)


@pytest.mark.parametrize("code", NVLINK5)
@pytest.mark.parametrize("severity", ["fatal", "precursor", "info"])
def test_predictor_class_of_nvlink5_is_unchanged(code, severity):
    assert _predictor_class(code, severity) == (severity, True)


def test_codes_the_old_tables_agreed_on_keep_their_class():
    agreed = {c for c, s in OLD_COLLECTOR.items() if OLD_SIMULATOR.get(c, "fatal") == s}
    assert agreed == set(OLD_COLLECTOR) - {68, 69, 137}
    for code in agreed:
        assert xidcat.lookup(code).severity == OLD_COLLECTOR[code]
        assert (code in OLD_SERVICE_FATAL) == (xidcat.classify(code) == "fatal")
        assert (code in OLD_SERVICE_PRECURSOR) == (xidcat.classify(code) == "precursor")
    # Where they disagreed, the collector's class (what real rows carried) stands: see foreshock/xid.py.
    assert [xidcat.lookup(c).severity for c in (68, 69, 137)] == ["application", "application", "precursor"]


# -- every reader agrees with the catalogue ------------------------------------------------------------

@pytest.mark.parametrize("code", sorted(xidcat.CATALOGUE) + [UNKNOWN_CODE])
def test_readers_agree(code):
    ev = parse_event(_kmsg_line(code))
    collector = ev["severity"]
    assert collector == xidcat.lookup(code).severity
    service = _service_decision(code, collector)
    predictor, nvlink = _predictor_class(code, collector)
    assert predictor == collector and nvlink == xidcat.lookup(code).nvlink
    assert service == {"fatal": "fatal", "precursor": "precursor"}.get(collector, "none")


@pytest.mark.parametrize("code", sorted(xidcat.CATALOGUE) + [UNKNOWN_CODE])
def test_a_row_marked_fatal_by_its_sender_is_judged_by_the_catalogue(code):
    want = "fatal" if xidcat.classify(code, "fatal") == "fatal" else (
        "precursor" if xidcat.classify(code, "fatal") == "precursor" else "none")
    assert _service_decision(code, "fatal") == want
    assert _predictor_class(code, "fatal")[0] == xidcat.classify(code, "fatal")


def test_simulator_writes_the_catalogue_class_and_text():
    from foreshock.simulator import model
    assert set(APP_XIDS) <= {c for c, e in xidcat.CATALOGUE.items() if e.severity == "application"}
    assert all(xidcat.lookup(c).example for c in APP_XIDS)
    assert "xid_severity" not in vars(model) and "XID_SEVERITY" not in vars(model)


def test_nvml_events_take_the_catalogue_class_and_count_unknowns():
    import time
    fake = FakeNvml.hopper(2)
    src = NvmlSource("n", backend=fake)
    try:
        src.sweep(0)
        fake.push_xid(1, 63)
        fake.push_xid(0, 999)
        events, deadline = [], time.time() + 5
        while time.time() < deadline and len(events) < 2:
            time.sleep(0.05)
            t = src.sweep(0).get("events")
            events += t.to_pylist() if t is not None else []
    finally:
        src.close()
    assert [(e["xid"], e["severity"]) for e in events] == [(63, "precursor"), (999, "info")]
    assert src.unknown_xids == 1


# -- bad input ----------------------------------------------------------------------------------------

def test_kmsg_counts_malformed_lines_and_unknown_xids(tmp_path, caplog):
    log = tmp_path / "kern.log"
    log.write_text("\n".join([
        "[  1.000000] " + _kmsg_line(79, "GPU has fallen off the bus."),
        "[  1.000001] NVRM: Xid (PCI:0000:07:00): 48x, garbled",            # not a code
        "[  1.000002] NVRM: Xid (43, pid: 5678): ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR",  # another format
        "[  1.000003] NVRM: Xid (PCI:0000:07:00",                          # truncated
        "[  1.000004] " + _kmsg_line(UNKNOWN_CODE),
        "[  1.000005] " + _kmsg_line(UNKNOWN_CODE + 1),
        "[  1.000006] NVRM: Xid (PCI:0000:07:00): 99999999999, too wide",
    ]) + "\n")
    src = KmsgSource("n", path=str(log), boot_ns=0)
    with caplog.at_level("INFO"):
        events = src.sweep(0)["events"].to_pylist()
    assert [(e["xid"], e["severity"]) for e in events] == [(79, "fatal"), (UNKNOWN_CODE, "info"),
                                                           (UNKNOWN_CODE + 1, "info")]
    assert src.errors == 4 and src.unknown_xids == 2
    assert sum("not in the Xid catalogue" in r.getMessage() for r in caplog.records) == 1


def test_the_collectors_metrics_count_unknown_xids_by_source(tmp_path):
    """A new driver's Xid raises nothing, so the collector's /metrics is where an SRE sees it arrive."""
    from prometheus_client import generate_latest

    from foreshock.collectors.collector import Collector
    from foreshock.collectors.metrics import registry_for

    log = tmp_path / "kern.log"
    log.write_text("".join(f"[  1.00000{i}] " + _kmsg_line(c) + "\n"
                           for i, c in enumerate((79, UNKNOWN_CODE, UNKNOWN_CODE))))
    collector = Collector("n", [KmsgSource("n", path=str(log), boot_ns=0)], writer=None)
    collector.sweep_once()
    text = generate_latest(registry_for(collector)).decode()
    assert 'foreshock_collector_unknown_xids_total{source="kmsg"} 2.0' in text, text


# -- the documented cases, replayed -------------------------------------------------------------------

def _replay(lines_by_node: dict[str, list[str]]):
    """kmsg lines per node -> events rows (as each node's collector writes them) -> the service and the
    predictor."""
    rows = []
    for node, lines in lines_by_node.items():
        for i, ln in enumerate(lines):
            ev = parse_event(parse_dmesg_line(ln).message)
            rows.append({"ts": NOW + dt.timedelta(milliseconds=i), "node": node, "source": "kmsg", **ev})
    table = sch.to_table("events", rows)
    book = NodeBook()
    ingest = Ingest(book, sink=lambda p: 0)
    ingest.act_on_events({"events": table}, now=0)
    base = sg.node_base_signals({"events": table})
    return book, base


def test_teardown_xid45_on_77_nodes_of_a_crashed_nvlink_job_alarms_no_node():
    # GB300 NVL72: one crashed multi-node job, 77 healthy nodes in 11 racks log Xid 45 at its teardown.
    lines = {f"rack{n % 11:02d}-node{n:03d}": [_kmsg_line(45, "Ch 00000001 caused by previous Xid 149")]
             for n in range(77)}
    book, base = _replay(lines)
    assert not book.fatal
    assert _sum(base, "xid_fatal") == 0 and _sum(base, "xid_application") == 77


def test_application_churn_xid45_makes_no_fatal_events():
    # 672 Xid 45 in 3 hours across a 288-node fleet: application churn, not 672 fatal events.
    lines: dict[str, list[str]] = {}
    for i in range(672):
        lines.setdefault(f"node{i % 288:03d}", []).append(_kmsg_line(45, f"Ch {i:08x}"))
    book, base = _replay(lines)
    assert not book.fatal and _sum(base, "xid_fatal") == 0


def test_a_flood_of_xid95_on_one_node_is_one_fatal_node():
    # One node logged ~800,000 Xid 95 lines, 29 distinct; a slice of it here.
    distinct = [_kmsg_line(95, f"Uncontained: LTC TAG (0x{k:x},0x0). RST: Yes, D-RST: No") for k in range(29)]
    book, base = _replay({"n95": [distinct[i % 29] for i in range(2900)]})
    assert set(book.fatal) == {"n95"} and "Xid 95" in book.fatal["n95"].description
    assert _sum(base, "xid_fatal") == 2900


# -- repeats folded into counts (collectors/repeats.py) ----------------------------------------------

BOOT = 1_780_000_000 * 10**9
FLOOD_MESSAGES = [f"Uncontained: LTC TAG (0x{k:x},0x0). RST: Yes, D-RST: No" for k in range(29)]


def _flood_file(path, n_lines: int, seconds: float, code: int = 95, messages=FLOOD_MESSAGES):
    """n_lines Xid lines over `seconds` of kernel time, cycling through `messages`, each with its own pid."""
    with open(path, "w") as fh:
        for i in range(n_lines):
            sec = 100 + seconds * i / n_lines
            fh.write(f"[{sec:12.6f}] NVRM: Xid (PCI:0000:07:00): {code}, pid={1000 + i}, name=python3, "
                     f"{messages[i % len(messages)]}\n")
    return path


def _read_folded(src: KmsgSource, seconds: float, window: float) -> tuple[list[dict], list[dict]]:
    """Sweep the source every 5 s of kernel time until its windows are past, then close it as the
    collector does; returns (rows of the first sweep, all rows)."""
    rows, first = [], None
    t = 100.0
    while t <= 100 + seconds + 2 * window:
        got = src.sweep(BOOT + int(t * 1e9)).get("events")
        got = got.to_pylist() if got is not None else []
        first = got if first is None else first
        rows += got
        t += 5
    rest = src.flush(BOOT + int(t * 1e9)).get("events")
    rows += rest.to_pylist() if rest is not None else []
    return first, rows


def _occurrences(rows) -> int:
    return sum(r["occurrences"] or 1 for r in rows)


@pytest.mark.parametrize("n_lines", [20_000, 60_000])
def test_an_xid95_flood_is_a_bounded_number_of_rows_with_the_exact_count(tmp_path, n_lines):
    # The documented flood, 800,000 lines with 29 distinct messages, at a smaller N: the rows are bounded
    # by distinct messages x windows, whatever the number of lines (here 20,000 or 60,000 over 10 min).
    seconds, window = 600.0, 60.0
    src = KmsgSource("n95", path=str(_flood_file(tmp_path / "kern.log", n_lines, seconds)), boot_ns=BOOT,
                     xid_fold_seconds=window)
    first, rows = _read_folded(src, seconds, window)
    assert _occurrences(rows) == n_lines                       # nothing lost, nothing counted twice
    assert len(rows) <= 29 * (2 + seconds / window)           # 29 first lines + one count per window
    # Each distinct message's first line is written in the sweep that read it, unfolded.
    assert {r["message"] for r in first if r["occurrences"] is None} == set(FLOOD_MESSAGES)
    folded = [r for r in rows if r["occurrences"] is not None]
    assert all(r["first_ts"] <= r["last_ts"] <= r["ts"] for r in folded)
    assert all(r["severity"] == "fatal" and r["xid"] == 95 for r in rows)
    # The readers count lines, not rows: the predictor's xid_fatal and the service's fatal node.
    table = sch.to_table("events", rows)
    assert _sum(sg.node_base_signals({"events": table}), "xid_fatal") == n_lines
    book = NodeBook()
    Ingest(book, sink=lambda p: 0).act_on_events({"events": table}, now=0)
    assert set(book.fatal) == {"n95"}


def test_a_precursor_flood_counts_every_line_in_the_service_and_the_predictor(tmp_path):
    src = KmsgSource("n63", path=str(_flood_file(tmp_path / "kern.log", 5000, 300.0, code=63,
                                                 messages=["Row Remapper: New row marked for remapping"])),
                     boot_ns=BOOT)
    _, rows = _read_folded(src, 300.0, 60.0)
    assert len(rows) <= 2 + 300 / 60 and _occurrences(rows) == 5000
    table = sch.to_table("events", rows)
    ingest = Ingest(NodeBook(), sink=lambda p: 0)
    ingest.act_on_events({"events": table}, now=0)
    assert ingest.precursors == 5000
    assert _sum(sg.node_base_signals({"events": table}), "xid_precursor") == 5000


def test_folding_keys_on_device_code_and_message_without_channel_ids(tmp_path):
    lines = [
        "[ 100.000000] NVRM: Xid (PCI:0000:dc:00): 45, pid=1, name=python3, Ch 00000001 caused by previous Xid 149",
        "[ 100.100000] NVRM: Xid (PCI:0000:dc:00): 45, pid=2, name=python3, Ch 0000000a caused by previous Xid 149",
        "[ 100.200000] NVRM: Xid (PCI:0000:dd:00): 45, pid=3, name=python3, Ch 00000001 caused by previous Xid 149",
        "[ 100.300000] NVRM: Xid (PCI:0000:dc:00): 45, pid=4, name=python3, Ch 00000001 caused by previous Xid 74",
        "[ 100.400000] NVRM: Xid (PCI:0000:dc:00): 43, pid=5, name=python3, Ch 00000001 caused by previous Xid 149",
        "[ 100.500000] NVRM: Xid (PCI:0000:dc:00): 45, pid=6, name=python3, Ch 00000002 caused by previous Xid 149",
    ]
    log = tmp_path / "kern.log"
    log.write_text("\n".join(lines) + "\n")
    src = KmsgSource("n", path=str(log), boot_ns=BOOT)
    now = src.sweep(BOOT + 101 * 10**9)["events"].to_pylist()
    # Another GPU, another cause, another code: each a first line; another channel: a repeat.
    assert [(r["pci_bus_id"], r["xid"], r["pid"]) for r in now] == [
        ("0000:dc:00.0", 45, 1), ("0000:dd:00.0", 45, 3), ("0000:dc:00.0", 45, 4), ("0000:dc:00.0", 43, 5)]
    (later,) = src.sweep(BOOT + 161 * 10**9)["events"].to_pylist()
    assert (later["occurrences"], later["pid"], later["message"]) == (2, 6, lines[-1].split("python3, ")[1])
    assert (later["first_ts"].value, later["last_ts"].value) == (BOOT + 100_100_000_000, BOOT + 100_500_000_000)
    assert later["ts"].value == BOOT + 161 * 10**9     # written now: the service's step watermark covers it
    # The window has passed quietly: the next line is a first occurrence again, written at once.
    log.write_text(log.read_text() + lines[0].replace("100.000000", "300.000000") + "\n")
    (again,) = src.sweep(BOOT + 301 * 10**9)["events"].to_pylist()
    assert again["occurrences"] is None and again["pid"] == 1


def test_folding_is_off_at_zero_and_its_window_is_range_checked(tmp_path):
    from foreshock.collectors import command

    log = _flood_file(tmp_path / "kern.log", 50, 10.0)
    src = KmsgSource("n", path=str(log), boot_ns=BOOT, xid_fold_seconds=0)
    assert len(src.sweep(BOOT + 200 * 10**9)["events"]) == 50
    for bad in (-1, 3601, float("nan")):
        with pytest.raises(ValueError, match="xid_fold_seconds"):
            KmsgSource("n", path=str(log), xid_fold_seconds=bad)
    with pytest.raises(Exception, match="xid_fold_seconds"):
        command.config.resolve("collect", command.DEFAULTS, flags={"xid_fold_seconds": 7200.0},
                               checks=command.CHECKS)


def test_the_collector_writes_counts_it_still_holds_when_it_closes(tmp_path):
    from foreshock.collectors.collector import Collector
    from foreshock.dataset import DatasetWriter, read_table

    log = _flood_file(tmp_path / "kern.log", 300, 5.0)
    writer = DatasetWriter(tmp_path / "ds", fsync=False)
    collector = Collector("n", [KmsgSource("n", path=str(log), boot_ns=BOOT)], writer,
                          clock=lambda: BOOT + 106 * 10**9)
    collector.sweep_once()
    from prometheus_client import generate_latest

    from foreshock.collectors.metrics import registry_for
    text = generate_latest(registry_for(collector)).decode()
    assert 'foreshock_collector_xid_repeats_folded_total{source="kmsg"} 271.0' in text   # 300 lines, 29 first
    collector.close()
    rows = read_table(tmp_path / "ds", "events").to_pylist()
    assert len(rows) == 29 * 2 and _occurrences(rows) == 300


def test_the_folder_is_bounded_and_loses_no_count(monkeypatch):
    from foreshock.collectors.repeats import XidFolder

    folder = XidFolder(60.0, max_keys=8)
    out = []
    for i in range(1000):   # 100 distinct keys, 10 lines each, within one window
        out += folder.feed({"ts": BOOT + i, "node": "n", "kind": "xid", "xid": 95, "gpu": 0,
                            "message": f"Uncontained: unit {i % 100}"}, BOOT + i)
        assert len(folder) <= 8
    out += folder.flush(BOOT + 1000)
    assert sum(r.get("occurrences") or 1 for r in out) == 1000


def test_nvml_xid_events_are_folded_too():
    import time
    fake = FakeNvml.hopper(1)
    src = NvmlSource("n", backend=fake)
    rows = []
    try:
        src.sweep(0)
        for _ in range(200):
            fake.push_xid(0, 63)
        deadline = time.time() + 10
        while time.time() < deadline and _occurrences(rows) < 1:
            time.sleep(0.05)
            t = src.sweep(time.time_ns()).get("events")
            rows += t.to_pylist() if t is not None else []
        time.sleep(0.5)
        rest = src.flush(time.time_ns()).get("events")
        rows += rest.to_pylist() if rest is not None else []
    finally:
        src.close()
    assert _occurrences(rows) == 200 and len(rows) <= 3


def test_event_files_written_before_the_new_columns_read_as_one_occurrence_each(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from foreshock.dataset import partition_dir, read_table

    old = sch.schema("events")
    old = pa.schema([f for f in old if f.name not in ("occurrences", "first_ts", "last_ts")], metadata=old.metadata)
    rows = [{"ts": NOW + dt.timedelta(seconds=i), "node": "n", "kind": "xid", "source": "kmsg",
             "severity": "fatal", "xid": 95, "message": "Uncontained"} for i in range(3)]
    d = partition_dir(tmp_path, "events", "2026-01-01", "n")
    d.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=old), d / "part-1-old-000001.parquet")
    table = read_table(tmp_path, "events")
    assert table.schema.names == sch.schema("events").names
    assert table.column("occurrences").null_count == 3
    assert _sum(sg.node_base_signals({"events": table}), "xid_fatal") == 3


def test_xid162_after_163_raises_nothing():
    book, base = _replay({"gb": [_kmsg_line(163, "PSHC disengaged"), _kmsg_line(162, "PSHC reengaged")]})
    assert not book.fatal
    assert sum(_sum(base, f"xid_{c}") for c in ("fatal", "precursor", "application")) == 0


def test_the_same_xid_alone_on_one_node_alarms_it():
    book, _ = _replay({"lonely": [_kmsg_line(79, "GPU has fallen off the bus.")]})
    assert set(book.fatal) == {"lonely"}
