"""NVSwitch SXid lines (collectors/sxid.py) through the kmsg source: real lines, malformed lines, any text."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foreshock.collectors import kmsg, sxid
from foreshock.collectors.base import ParseError

REPO = Path(__file__).resolve().parents[1]
SXID_LINES = REPO / "examples" / "kmsg" / "sxid-lines.txt"


def _real_lines() -> list[str]:
    return [ln for ln in SXID_LINES.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_every_real_sxid_line_parses_to_an_event():
    got = [kmsg.parse_event(kmsg.parse_dmesg_line(ln).message) for ln in _real_lines()]
    assert [(e["sxid"], e["device"], e["pci_bus_id"], e["link"], e["severity"]) for e in got] == [
        (12028, "nvswitch3", "0000:05:00.0", 32, "precursor"),
        (20034, "nvswitch0", "0000:a9:00.0", 30, "fatal"),
        (20034, "nvswitch0", "0000:a9:00.0", None, "info"),  # the detail lines after a fatal SXid
        (20034, "nvswitch0", "0000:a9:00.0", None, "info"),
        (19084, "nvswitch4", "0000:c6:00.0", 29, "precursor"),
        (28006, "nvswitch3", "0000:c1:00.0", 46, "precursor"),
        (28006, "nvswitch3", "0000:c1:00.0", None, "info"),  # ... and after a non-fatal one
        (28006, "nvswitch3", "0000:c1:00.0", None, "info"),
    ]
    assert {e["kind"] for e in got} == {"sxid"} and all(e.get("xid") is None for e in got)
    assert got[0]["message"] == "Non-fatal, Link 32 egress non-posted PRIV error (First)"
    assert got[3]["message"].startswith("Data {0x50610002")


@pytest.mark.parametrize("message,severity,link", [
    # the driver's other report formats (intr_nvswitch.h, error_nvswitch.h): a correctable link error and
    # a correctable error of the device (NVSWITCH_REPORT_CORRECTABLE, _CORRECTABLE_DEVICE_DATA), both
    # non-fatal to the driver; a fatal error that is not a link's, a non-fatal PRI error
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20009, Correctable, Link 04 RX Short Error Rate", "precursor", 4),
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 10004, Correctable, thermal alert: throttling enabled.",
     "precursor", None),
    ("nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 10003, Fatal, unhandled interrupt in _nvswitch_service(1234)",
     "fatal", None),
    ("nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12030, Non-fatal, PRI error, instance=3, chiplet=0",
     "precursor", None),
    # lines without a class: the details of any recorded error (error_nvswitch.c, with the flags word the
    # newer drivers print first), and reports the driver gives no class
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20009, Severity 0 Engine instance 04 Sub-engine instance 00",
     "info", None),
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20009, Data {0x00000001, 0x00000000, 0x00000000, 0x00000000, "
     "0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}", "info", None),
    ("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 10007, IO failure", "info", None),
    ("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 10004, NVSWITCH Temperature 96C | TSENSE WARN Threshold 95C",
     "info", None),
])
def test_the_drivers_report_formats(message, severity, link):
    ev = sxid.parse_sxid(message)
    assert (ev["severity"], ev["link"]) == (severity, link)


def test_a_correctable_sxid_is_written_apart_from_a_detail_line_and_as_the_driver_files_it():
    line = "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20009, {}"
    correctable = sxid.parse_sxid(line.format("Correctable, Link 04 RX Short Error Rate (First)"))
    detail = sxid.parse_sxid(line.format("Severity 0 Engine instance 04 Sub-engine instance 00"))
    nonfatal = sxid.parse_sxid(line.format("Non-fatal, Link 04 RX Short Error Rate (First)"))
    assert correctable["severity"] != detail["severity"] == sxid.NO_CLASS
    assert correctable["severity"] == nonfatal["severity"] and correctable["message"].startswith("Correctable,")
    assert set(sxid.SEVERITY) == set(sxid.CLASSES) and sxid.NO_CLASS not in sxid.SEVERITY.values()


@pytest.mark.parametrize("bad", [
    "nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): garbled, Fatal",
    "nvidia-nvswitch3: SXid (PCI:0000:c1:00.0",
    "nvidia-nvswitch3: SXid (PCI:zzzz): 12028, Non-fatal, Link 32",
    "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 99999999999, Fatal, Link 1",
])
def test_malformed_sxid_lines_are_parse_errors_naming_the_line(bad):
    with pytest.raises(ParseError, match="SXid"):
        kmsg.parse_event(bad)


def test_lines_that_are_not_sxid_lines_are_not_events():
    assert sxid.parse_sxid("nvidia-nvswitch0: probe of 0000:05:00.0 failed") is None
    assert kmsg.parse_event("systemd[1]: Started nvidia-fabricmanager.service - NVIDIA fabric manager.") is None


def test_the_kmsg_source_reads_sxid_lines_and_counts_the_malformed_one(tmp_path):
    log = tmp_path / "dmesg.txt"
    lines = _real_lines()
    log.write_text("\n".join([lines[0], "[131453.1] nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): garbled, Fatal",
                              *lines[1:]]) + "\n")
    src = kmsg.KmsgSource("hgx-01", path=str(log), boot_ns=0)
    table = src.sweep(0)["events"]
    rows = table.to_pylist()
    assert [(r["kind"], r["source"], r["sxid"], r["severity"]) for r in rows] == [
        ("sxid", "kmsg", 12028, "precursor"), ("sxid", "kmsg", 20034, "fatal"), ("sxid", "kmsg", 20034, "info"),
        ("sxid", "kmsg", 20034, "info"), ("sxid", "kmsg", 19084, "precursor"), ("sxid", "kmsg", 28006, "precursor"),
        ("sxid", "kmsg", 28006, "info"), ("sxid", "kmsg", 28006, "info")]
    assert table.column("ts").cast("int64")[1].as_py() == 131453_740743_000 and rows[1]["link"] == 30
    assert src.errors == 1 and src.unknown_xids == 0


def test_a_dev_kmsg_record_with_an_sxid():
    rec = kmsg.parse_kmsg_record(
        "3,2417,131453740743,-;nvidia-nvswitch0: SXid (PCI:0000:a9:00.0): 20034, Fatal, Link 30 LTSSM Fault Up\n")
    ev = kmsg.parse_event(rec.message)
    assert (rec.seq, ev["sxid"], ev["severity"], ev["link"]) == (2417, 20034, "fatal", 30)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=120), st.sampled_from(["", "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): ",
                                                "nvidia-nvswitch0: SXid (", "SXid nvswitch"]))
def test_any_text_gives_an_event_none_or_a_parse_error(text, prefix):
    try:
        ev = sxid.parse_sxid(prefix + text)
    except ParseError:
        return
    assert ev is None or (ev["kind"] == "sxid" and 0 <= ev["sxid"] < 1 << 31
                          and ev["severity"] in sxid.SEVERITIES)
