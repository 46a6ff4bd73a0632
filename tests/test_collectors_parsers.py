"""The collectors' parsers: real formats give the right values; any input gives a value, null or ParseError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foreshock.collectors import host_net, kmsg, netdev, rdma
from foreshock.collectors.base import ParseError, parse_int, parse_uint

FAST = settings(max_examples=150, deadline=None)
TEXT = st.one_of(st.text(max_size=80), st.binary(max_size=80).map(lambda b: b.decode("latin-1")))


# -- real formats ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [
    ("0\n", 0), ("273558326543\n", 273558326543), (b"18446744073709551615\n", 2**64 - 1),
    ("N/A (no PMA)\n", None), ("", None), ("\n", None),
])
def test_parse_uint(text, value):
    assert parse_uint(text) == value


@pytest.mark.parametrize("bad", ["-1", "12abc", "18446744073709551616", "0x10", "١٢"])
def test_parse_uint_refuses_with_the_input_named(bad):
    with pytest.raises(ParseError, match="expected|64 bits"):
        parse_uint(bad)


@pytest.mark.parametrize("text,value", [("4: ACTIVE\n", 4), ("5: LinkUp\n", 5), ("1: DOWN", 1),
                                        ("7: PhyTest\n", 7), ("3", 3)])
def test_parse_state(text, value):
    assert rdma.parse_state(text) == value


@pytest.mark.parametrize("text,value", [("400 Gb/sec (4X NDR)\n", 400.0), ("2.5 Gb/sec (1X SDR)\n", 2.5),
                                        ("100 Gb/sec (4X EDR)\n", 100.0), ("25 Gb/sec (1X EDR)", 25.0),
                                        ("0 GB/sec", 0.0)])
def test_parse_rate(text, value):
    assert rdma.parse_rate(text) == value


def test_parse_counter_normalises_words_to_bytes_and_keeps_unknown_names():
    assert rdma.parse_counter("port_xmit_data", "10\n") == ("port_xmit_bytes", 40)
    assert rdma.parse_counter("port_rcv_data", "3\n") == ("port_rcv_bytes", 12)
    assert rdma.parse_counter("symbol_error", "7\n") == ("symbol_error", 7)
    assert rdma.parse_counter("np_wqe_err", "2\n") == ("np_wqe_err", 2)  # -> extra_counters


@pytest.mark.parametrize("fn,text,value", [
    (netdev.parse_speed, "1000\n", 1000), (netdev.parse_speed, "-1\n", None),
    (netdev.parse_speed, "4294967295\n", None), (netdev.parse_carrier, "1\n", True),
    (netdev.parse_carrier, "0\n", False), (netdev.parse_operstate, "lowerlayerdown\n", "lowerlayerdown"),
    (netdev.parse_mtu, "9000\n", 9000), (parse_int, "-5", -5),
])
def test_netdev_parsers(fn, text, value):
    assert fn(text) == value


SNMP = """Ip: Forwarding DefaultTTL InReceives
Ip: 2 64 4166
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 20 2 0 0 0 4127 1860 7 0 20 0
"""


def test_parse_proc_net_snmp():
    t = host_net.parse_proc_net_pairs(SNMP)
    assert t["Tcp"]["RetransSegs"] == 7 and t["Tcp"]["OutSegs"] == 1860 and t["Tcp"]["MaxConn"] == -1
    assert t["Ip"]["InReceives"] == 4166


@pytest.mark.parametrize("bad", ["Tcp: A B\nTcp: 1\n", "Tcp: A\nUdp: 1\n", "Tcp: A\n", "Tcp: A\nTcp: x\n"])
def test_parse_proc_net_refuses_broken_pairs(bad):
    with pytest.raises(ParseError):
        host_net.parse_proc_net_pairs(bad)


def test_parse_peer():
    assert host_net.parse_peer("eu-west=10.0.0.1:7000") == ("eu-west", "10.0.0.1", 7000)
    assert host_net.parse_peer("[::1]:22") == (None, "::1", 22)
    with pytest.raises(ValueError, match="peer"):
        host_net.parse_peer("nohost")


def test_parse_kmsg_record():
    r = kmsg.parse_kmsg_record(b"4,1234,5678901,-;NVRM: Xid (PCI:0000:07:00): 48, x\n SUBSYSTEM=pci\n")
    assert (r.prio, r.seq, r.usec, r.message) == (4, 1234, 5678901, "NVRM: Xid (PCI:0000:07:00): 48, x")
    assert kmsg.parse_kmsg_record("6,1,2,c,caller=T1;a\\x0ab").message == "a\nb"


def test_parse_dmesg_line_forms():
    assert kmsg.parse_dmesg_line("[ 1234.567890] NVRM: hi").usec == 1234567890
    assert kmsg.parse_dmesg_line("6,7,8,-;msg").seq == 7
    assert kmsg.parse_dmesg_line("NVRM: bare").message == "NVRM: bare"


def test_normalize_pci():
    assert kmsg.normalize_pci("PCI:0000:07:00") == "0000:07:00.0"
    assert kmsg.normalize_pci("00000000:18:00.0") == "0000:18:00.0"
    assert kmsg.normalize_pci("3b:00.1") == "0000:3b:00.1"


# -- properties: any input gives a value, a null or a ParseError -----------------------------------
def _total(fn, text):
    try:
        fn(text)
    except ParseError:
        pass


@FAST
@given(TEXT)
def test_sysfs_parsers_never_crash(text):
    for fn in (parse_uint, parse_int, rdma.parse_state, rdma.parse_rate, netdev.parse_speed,
               netdev.parse_carrier, netdev.parse_operstate, netdev.parse_mtu,
               lambda t: rdma.parse_counter("port_rcv_data", t)):
        _total(fn, text)
        _total(fn, text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)


@FAST
@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_parse_uint_round_trips(n):
    assert parse_uint(f"{n}\n") == n
    assert rdma.parse_counter("port_xmit_data", f"{n}\n")[1] == 4 * n


@FAST
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40), max_size=6))
def test_proc_net_parser_never_crashes(lines):
    _total(host_net.parse_proc_net_pairs, "\n".join(lines))


@FAST
@given(st.dictionaries(st.from_regex(r"[A-Za-z]{1,12}", fullmatch=True), st.integers(-2**63, 2**63 - 1),
                       min_size=1, max_size=8))
def test_proc_net_parser_round_trips(fields):
    text = f"Tcp: {' '.join(fields)}\nTcp: {' '.join(map(str, fields.values()))}\n"
    assert host_net.parse_proc_net_pairs(text) == {"Tcp": fields}


@FAST
@given(TEXT)
def test_kmsg_parsers_never_crash(text):
    _total(kmsg.parse_kmsg_record, text)
    _total(kmsg.parse_dmesg_line, text)
    _total(kmsg.parse_event, text)
    _total(kmsg.parse_event, "NVRM: Xid (PCI:0000:01:00): " + text)
    _total(kmsg.parse_event, "mlx5_core 0000:3b:00.0: " + text)


@FAST
@given(st.integers(min_value=0, max_value=2**31 - 1), st.sampled_from(["", "PCI:"]),
       st.from_regex(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}", fullmatch=True))
def test_any_xid_line_parses_to_its_code_and_bus(xid, prefix, bus):
    ev = kmsg.parse_event(f"NVRM: Xid ({prefix}{bus}): {xid}, pid=42, name=python3, boom")
    assert ev["xid"] == xid and ev["pci_bus_id"] == bus + ".0" and ev["pid"] == 42
    assert ev["severity"] in {"precursor", "application", "fatal", "info"}


@FAST
@given(st.integers(min_value=1, max_value=6000), st.sampled_from(["", "4: ", "N", "-"]))
def test_long_digit_strings_are_errors_not_crashes(n, prefix):
    digits = prefix + "9" * n
    for fn in (parse_uint, parse_int, rdma.parse_state, rdma.parse_rate, netdev.parse_speed):
        _total(fn, digits)
    for text in (f"NVRM: Xid (PCI:0000:01:00): {digits}, x", f"{digits},{digits},{digits},-;m", f"[{digits}.1] m"):
        _total(kmsg.parse_event, text)
        _total(kmsg.parse_kmsg_record, text)
        _total(kmsg.parse_dmesg_line, text)
