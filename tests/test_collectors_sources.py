"""Sources read the real formats: the procfs fixture tree, this machine's /sys/class/net and /proc/net,
the real Xid lines, and keep the three outcomes (absent, unsupported, error) apart."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from pathlib import Path

import pyarrow as pa
import pytest

from foreshock import schema as sch
from foreshock.collectors.host_net import HostNetSource
from foreshock.collectors.kmsg import KmsgSource, parse_dmesg_line, parse_event
from foreshock.collectors.netdev import NetdevSource
from foreshock.collectors.rdma import RdmaSource
from foreshock.collectors.simulated import SimpleNodeModel, SimulatedSource

TS = 1_780_000_000_000_000_000


def _rows(source, table):
    out = source.sweep(TS)
    assert table in out, f"{source.name} yielded {sorted(out)}"
    t = out[table]
    assert t.schema.equals(sch.schema(table), check_metadata=False)
    return t.to_pylist()


@pytest.fixture
def sys_copy(procfs_fixture, tmp_path):
    shutil.copytree(procfs_fixture / "sys", tmp_path / "sys")
    for p in (tmp_path / "sys").rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return tmp_path / "sys"


# -- rdma over the fixture -------------------------------------------------------------------------
def test_rdma_reads_the_fixture_through_the_real_code_path(procfs_fixture):
    rows = {(r["device"], r["port"]): r for r in _rows(RdmaSource("fx", sysfs=str(procfs_fixture / "sys")),
                                                        "rdma_port")}
    assert sorted(rows) == [("hfi1_0", 1), ("mlx4_0", 1), ("mlx4_0", 2), ("mlx5_0", 1)]
    hfi = rows[("hfi1_0", 1)]
    assert (hfi["state"], hfi["phys_state"], hfi["rate_gbps"], hfi["link_layer"]) == (4, 5, 100.0, "InfiniBand")
    assert hfi["port_xmit_bytes"] == 273558326543 * 4 and hfi["port_rcv_bytes"] == 345091702026 * 4
    assert hfi["unicast_xmit_packets"] is None  # hfi1 has no such file: null, not 0
    mlx5 = rows[("mlx5_0", 1)]
    assert mlx5["phys_state"] == 4 and mlx5["rate_gbps"] == 25.0
    assert (mlx5["local_ack_timeout_err"], mlx5["resp_cqe_error"], mlx5["lifespan"]) == (131, 8109, 10)
    assert mlx5["np_cnp_sent"] is None
    assert rows[("mlx4_0", 2)]["port_xmit_wait"] == 3846


def test_rdma_unknown_counters_go_to_extra_counters(sys_copy):
    hw = sys_copy / "class/infiniband/mlx5_0/ports/1/hw_counters"
    (hw / "np_wqe_err").write_text("17\n")
    (hw / "rx_prio0_pause").write_text("N/A (no PMA)\n")
    row = [r for r in _rows(RdmaSource("fx", sysfs=str(sys_copy)), "rdma_port") if r["device"] == "mlx5_0"][0]
    assert dict(row["extra_counters"]) == {"np_wqe_err": 17}


def test_rdma_rereads_open_files_and_rescans_for_new_devices(sys_copy):
    now = [0.0]
    src = RdmaSource("fx", sysfs=str(sys_copy), rescan_seconds=30, clock=lambda: now[0])
    first = {(r["device"], r["port"]): r for r in _rows(src, "rdma_port")}
    f = sys_copy / "class/infiniband/mlx4_0/ports/1/counters/symbol_error"
    with open(f, "r+") as fh:  # rewrite in place: the held descriptor must see the new value
        fh.write("65535\n")
    shutil.copytree(sys_copy / "class/infiniband/mlx4_0", sys_copy / "class/infiniband/mlx4_1")
    second = {(r["device"], r["port"]): r for r in _rows(src, "rdma_port")}
    assert first[("mlx4_0", 1)]["symbol_error"] == 0 and second[("mlx4_0", 1)]["symbol_error"] == 65535
    assert ("mlx4_1", 1) not in second  # not yet re-scanned
    now[0] = 31.0
    third = {(r["device"], r["port"]): r for r in _rows(src, "rdma_port")}
    assert ("mlx4_1", 1) in third and len(third) == 6
    src.close()


def test_rdma_garbage_is_an_error_with_the_path_and_the_sweep_goes_on(sys_copy, caplog):
    f = sys_copy / "class/infiniband/mlx4_0/ports/1/counters/link_downed"
    f.write_text("banana\n")
    src = RdmaSource("fx", sysfs=str(sys_copy))
    with caplog.at_level(logging.WARNING, "foreshock.collectors"):
        rows = {(r["device"], r["port"]): r for r in _rows(src, "rdma_port")}
    assert src.errors == 1 and str(f) in caplog.text
    assert rows[("mlx4_0", 1)]["link_downed"] is None and rows[("mlx4_0", 1)]["symbol_error"] == 0
    assert len(rows) == 4


def _rdma_rows(src, caplog):
    with caplog.at_level(logging.WARNING, "foreshock.collectors"):
        return {(r["device"], r["port"]): r for r in _rows(src, "rdma_port")}


def test_rdma_unreadable_entries_are_errors_with_their_paths_and_the_rest_is_read(sys_copy, caplog):
    counters = sys_copy / "class/infiniband/mlx4_0/ports/1/counters"
    (counters / "symbol_error").unlink()
    (counters / "symbol_error").mkdir()                       # a directory where a file should be
    (counters / "link_downed").unlink()
    (counters / "link_downed").symlink_to("link_downed")      # a symlink loop (ELOOP)
    (counters / "port_xmit_wait").write_text(" \n")            # whitespace only
    state = sys_copy / "class/infiniband/mlx4_0/ports/2/state"
    state.write_text("")
    src = RdmaSource("fx", sysfs=str(sys_copy))
    rows = _rdma_rows(src, caplog)
    assert len(rows) == 4 and src.errors == 4
    for path in (counters / "symbol_error", counters / "link_downed", counters / "port_xmit_wait", state):
        assert str(path) in caplog.text
    port = rows[("mlx4_0", 1)]
    assert port["symbol_error"] is None and port["link_downed"] is None and port["port_xmit_wait"] is None
    assert port["port_rcv_errors"] is not None and rows[("mlx4_0", 2)]["state"] is None
    assert rows[("mlx4_0", 2)]["port_xmit_wait"] == 3846


def test_rdma_permission_denied_costs_one_device_not_the_source(sys_copy, caplog, monkeypatch):
    """chmod 000 cannot refuse root (the tests' user), so os.listdir and os.open refuse one path each."""
    denied_dir = str(sys_copy / "class/infiniband/mlx4_0/ports")
    denied_file = str(sys_copy / "class/infiniband/mlx5_0/ports/1/counters/symbol_error")
    real_listdir, real_open = os.listdir, os.open

    def listdir(path):
        if str(path) == denied_dir:
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)

    def open_(path, *args, **kwargs):
        if str(path) == denied_file:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "open", open_)
    src = RdmaSource("fx", sysfs=str(sys_copy))
    rows = _rdma_rows(src, caplog)
    assert sorted(rows) == [("hfi1_0", 1), ("mlx5_0", 1)]
    assert rows[("mlx5_0", 1)]["symbol_error"] is None and rows[("hfi1_0", 1)]["symbol_error"] is not None
    assert src.errors == 2 and denied_dir in caplog.text and denied_file in caplog.text
    src.close()


def test_a_repeated_error_is_counted_every_time_and_logged_once_a_minute(sys_copy, caplog):
    f = sys_copy / "class/infiniband/mlx4_0/ports/1/counters/link_downed"
    f.write_text("banana\n")
    src = RdmaSource("fx", sysfs=str(sys_copy))
    with caplog.at_level(logging.WARNING, "foreshock.collectors"):
        for k in range(5):
            src.sweep(TS + k)
    assert src.errors == 5 and caplog.text.count(str(f)) == 1
    src.close()


def test_rdma_absent_is_said_once_and_yields_nothing(tmp_path, caplog):
    src = RdmaSource("fx", sysfs=str(tmp_path))
    with caplog.at_level(logging.INFO, "foreshock.collectors"):
        assert src.sweep(TS) == {} and src.sweep(TS + 1) == {}
    assert src.absent and src.errors == 0
    assert caplog.text.count("hardware absent") == 1


# -- netdev ----------------------------------------------------------------------------------------
def test_netdev_reads_the_fixture(procfs_fixture):
    (eth0,) = _rows(NetdevSource("fx", sysfs=str(procfs_fixture / "sys")), "netdev")
    assert eth0["iface"] == "eth0" and eth0["operstate"] == "up" and eth0["carrier"] is True
    assert (eth0["carrier_changes"], eth0["carrier_up_count"], eth0["carrier_down_count"]) == (2, 1, 1)
    assert (eth0["speed_mbps"], eth0["mtu"]) == (1000, 1500)
    assert eth0["rx_bytes"] is None  # the fixture has no statistics/: unsupported, null


def test_netdev_speed_minus_one_is_null(sys_copy):
    (sys_copy / "class/net/eth0/speed").write_text("-1\n")
    (eth0,) = _rows(NetdevSource("fx", sysfs=str(sys_copy)), "netdev")
    assert eth0["speed_mbps"] is None


def test_netdev_reads_this_machines_sys_class_net():
    if not os.path.isdir("/sys/class/net"):
        pytest.skip("no /sys/class/net")
    src = NetdevSource("here")
    rows = {r["iface"]: r for r in _rows(src, "netdev")}
    assert set(rows) == set(os.listdir("/sys/class/net"))
    lo = rows.get("lo")
    if lo is not None:
        assert lo["mtu"] == int(Path("/sys/class/net/lo/mtu").read_text())
        before = lo["tx_packets"]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # traffic on lo moves its counters
            for _ in range(5):
                s.sendto(b"x", ("127.0.0.1", 9))
        after = {r["iface"]: r for r in src.sweep(TS)["netdev"].to_pylist()}["lo"]["tx_packets"]
        assert after >= before + 5
    assert src.errors == 0


# -- host_net --------------------------------------------------------------------------------------
def test_host_net_reads_this_machines_proc_net():
    src = HostNetSource("here")
    (row,) = _rows(src, "host_net")
    snmp = Path("/proc/net/snmp").read_text().splitlines()
    tcp = [ln.split()[1:] for ln in snmp if ln.startswith("Tcp:")]
    real = dict(zip(tcp[0], map(int, tcp[1])))
    assert row["Tcp_OutSegs"] >= real["OutSegs"] - 1000 and row["Tcp_ActiveOpens"] is not None
    assert row["TcpExt_TCPTimeouts"] is not None
    assert src.errors == 0


def test_host_net_probes_a_peer_with_a_timeout():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        src = HostNetSource("here", peers=[f"lab=127.0.0.1:{port}", "peer.invalid:9"], probe_interval=0.05,
                            probe_timeout=0.2)
        try:
            deadline = time.time() + 5
            seen = {}
            while time.time() < deadline and len(seen) < 2:
                time.sleep(0.1)
                for r in src.sweep(TS).get("path_probe", pa.table({})).to_pylist():
                    seen.setdefault(r["peer"], r)
        finally:
            src.close()
    ok, dead = seen[f"lab=127.0.0.1:{port}"], seen["peer.invalid:9"]
    assert ok["peer_site"] == "lab" and ok["received"] == ok["sent"] >= 1 and ok["rtt_ms"] > 0
    assert ok["loss_ratio"] == 0.0
    assert dead["received"] == 0 and dead["loss_ratio"] == 1.0 and dead["rtt_ms"] is None


def test_host_net_absent_procfs(tmp_path):
    src = HostNetSource("x", procfs=str(tmp_path))
    assert src.sweep(TS) == {} and src.absent


# -- kmsg ------------------------------------------------------------------------------------------
EXPECTED_XIDS = [(79, "fatal"), (48, "fatal"), (64, "fatal"), (13, "application"), (109, "fatal"),
                 (31, "application"), (45, "application"), (145, "precursor"), (149, "fatal"), (119, "fatal")]


def test_kmsg_parses_every_real_xid_line(xid_lines):
    events = [parse_event(parse_dmesg_line(ln).message) for ln in xid_lines.read_text().splitlines()
              if ln and not ln.startswith("#")]
    assert [(e["xid"], e["severity"]) for e in events] == EXPECTED_XIDS
    assert events[0]["pci_bus_id"] == "0000:a1:00.0" and events[0]["pid"] is None
    assert (events[4]["pid"], events[4]["process_name"]) == (1797828, "pt_main_thread")
    assert events[7]["pci_bus_id"] == "0018:01:00.0" and "Link 13" in events[7]["message"]


@pytest.mark.parametrize("line,kind,severity", [
    ("NVRM: Xid (0000:03:00): 13, Graphics Exception: ESR 0x404600=0x80000002", "xid", "application"),
    ("NVRM: The NVIDIA GPU 0000:3b:00.0 (PCI ID: 10de:20b0) installed in this system has fallen off the "
     "bus and is not responding to commands.", "gpu_lost", "fatal"),
    ("mlx5_core 0000:5e:00.0 ens1f0np0: Link down", "link_state", "info"),
    ("mlx5_core 0000:3b:00.0: poll_health:800:(pid 0): device's health compromised - reached miss count",
     "nic_error", "fatal"),
    ("mlx5_core 0000:af:00.1 ens2f1: mlx5e_tx_timeout_work:1017:(pid 2311): TX timeout on queue: 3",
     "nic_error", "precursor"),
    ("NETDEV WATCHDOG: ens1f0 (mlx5_core): transmit queue 3 timed out", "nic_error", "precursor"),
    ("usb 1-1: new high-speed USB device number 2 using xhci_hcd", None, None),
])
def test_kmsg_event_formats(line, kind, severity):
    ev = parse_event(line)
    assert (ev and ev["kind"], ev and ev["severity"]) == (kind, severity) if kind else ev is None


def test_kmsg_follows_a_dmesg_file_and_reads_only_new_lines(xid_lines, tmp_path):
    log = tmp_path / "dmesg.txt"
    log.write_text(xid_lines.read_text())
    src = KmsgSource("fx", path=str(log))
    first = src.sweep(TS)["events"]
    assert first.num_rows == 10 and set(first.column("source").to_pylist()) == {"kmsg"}
    assert src.sweep(TS + 1) == {}
    with open(log, "a") as fh:
        fh.write("[  100.000001] NVRM: Xid (PCI:0000:07:00): 63, pid=1, name=x, Row remapper event\n")
        fh.write("[  100.000002] NVRM: Xid (PCI:0000:07:00): 9")  # not yet terminated: waits
    (ev,) = src.sweep(TS + 2)["events"].to_pylist()
    assert ev["xid"] == 63 and ev["severity"] == "precursor"
    assert ev["ts"].value == src.boot_ns + 100_000_001_000
    with open(log, "a") as fh:
        fh.write("4, pid=1, name=x, contained\n")
    assert src.sweep(TS + 3)["events"].column("xid").to_pylist() == [94]
    src.close()


def test_kmsg_reads_this_machines_dev_kmsg():
    if not os.access("/dev/kmsg", os.R_OK):
        src = KmsgSource("here")
        assert src.sweep(TS) == {} and src.absent  # unreadable: said once, nothing yielded
        return
    src = KmsgSource("here")
    src.sweep(TS)
    assert src.records_read > 0 and src.errors == 0 and src._last_seq >= 0
    seq = src._last_seq
    src.sweep(TS + 1)
    assert src._last_seq >= seq
    src.close()


def test_kmsg_missing_device_is_absent(tmp_path):
    src = KmsgSource("x", path=str(tmp_path / "nope"))
    assert src.sweep(TS) == {} and src.absent and src.errors == 0


# -- simulated -------------------------------------------------------------------------------------
def test_simulated_counters_are_cumulative_and_follow_the_step_rhythm():
    src = SimulatedSource("sim0", gpus=4, hcas=2, seed=1)
    t0 = 1_780_000_000 * 10**9
    sweeps = [src.sweep(t0 + k * 10**8) for k in range(60)]  # 6 s at 10 Hz: three 2 s steps
    for name, t in sweeps[0].items():
        sch.conform(name, t)
    tx = [s["rdma_port"].column("port_xmit_bytes").to_pylist()[0] for s in sweeps]
    assert all(b >= a for a, b in zip(tx, tx[1:]))
    incs = [b - a for a, b in zip(tx, tx[1:])]
    assert max(incs) > 20 * min(incs)  # bursts (all-reduce) and quiet (compute) phases
    assert sweeps[-1]["gpu"].num_rows == 4 and sweeps[-1]["rdma_port"].num_rows == 2


def test_simulated_source_takes_any_node_model():
    class OneGpu:
        node = "custom"

        def sample(self, ts_ns):
            return {"gpu": sch.to_table("gpu", [{"ts": ts_ns, "node": self.node, "gpu": 0, "gpu_lost": True}])}

    out = SimulatedSource("custom", node_model=OneGpu()).sweep(TS)
    assert out["gpu"].column("gpu_lost").to_pylist() == [True]
    with pytest.raises(TypeError, match="NodeModel"):
        SimulatedSource("bad", node_model=object())
    assert isinstance(SimpleNodeModel("n"), __import__("foreshock.collectors.simulated").collectors.simulated.NodeModel)


def test_kmsg_overwritten_records_skip_ahead_and_seq_dedupes(tmp_path, monkeypatch):
    """/dev/kmsg semantics: one record per read, EPIPE when records were overwritten, EAGAIN when done."""
    import errno as _errno

    from foreshock.collectors import kmsg as kmsg_mod

    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)  # a character-device stand-in: not a regular file, so read record by record
    script = [b"4,10,1000000,-;NVRM: Xid (PCI:0000:07:00): 48, pid=1, name=a, DBE\n",
              OSError(_errno.EPIPE, "Broken pipe"),
              b"4,15,2000000,-;NVRM: Xid (PCI:0000:07:00): 94, pid=1, name=a, contained\n",
              b"4,15,2000000,-;NVRM: Xid (PCI:0000:07:00): 94, pid=1, name=a, contained\n",  # again: dedupe
              b"6,16,2000001,-;eth0: renamed from veth1\n",
              BlockingIOError()]

    def fake_read(fd, n):
        item = script.pop(0) if script else BlockingIOError()
        if isinstance(item, BaseException):
            raise item
        return item

    src = KmsgSource("k", path=str(fifo), boot_ns=10**18)
    monkeypatch.setattr(kmsg_mod.os, "read", fake_read)
    rows = src.sweep(TS)["events"].to_pylist()
    assert [(r["xid"], r["seq"]) for r in rows] == [(48, 10), (94, 15)]
    assert rows[1]["ts"].value == 10**18 + 2_000_000_000
    assert src.records_lost == 1 and src.records_read == 4 and src.errors == 0
    monkeypatch.undo()
    src.close()


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_CONTENT = st.one_of(st.integers(-2**70, 2**70).map(lambda v: f"{v}\n"), st.just("N/A (no PMA)\n"),
                     st.text(max_size=30), st.just(""))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counters=st.lists(_CONTENT, min_size=4, max_size=4), state=_CONTENT, rate=_CONTENT,
       speed=_CONTENT, mtu=_CONTENT)
def test_any_file_contents_give_values_nulls_or_counted_errors(tmp_path_factory, counters, state, rate,
                                                               speed, mtu):
    root = tmp_path_factory.mktemp("sys")
    port = root / "class/infiniband/mlx5_0/ports/1"
    (port / "counters").mkdir(parents=True)
    names = ["symbol_error", "port_rcv_data", "port_xmit_wait", "np_wqe_err"]
    for name, text in zip(names, counters):
        (port / "counters" / name).write_text(text)
    (port / "state").write_text(state)
    (port / "rate").write_text(rate)
    net = root / "class/net/eth9"
    net.mkdir(parents=True)
    (net / "speed").write_text(speed)
    (net / "mtu").write_text(mtu)
    for src, table in ((RdmaSource("p", sysfs=str(root)), "rdma_port"), (NetdevSource("p", sysfs=str(root)), "netdev")):
        out = src.sweep(TS)[table]
        sch.conform(table, out)  # always a valid schema-v1 table
        assert out.num_rows == 1
        src.close()


def test_out_of_descriptors_files_are_read_open_and_close(procfs_fixture):
    """With RLIMIT_NOFILE exhausted, sources still read every file (EMFILE is not "unsupported")."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    sysfs = str(procfs_fixture / "sys")
    first = RdmaSource("b", sysfs=sysfs)
    want = {(r["device"], r["port"]): r for r in first.sweep(TS)["rdma_port"].to_pylist()}
    first.close()
    held = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 200, hard))
        while True:  # use up the descriptors, leaving a few for the scan's own listdir/open
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        for fd in held[-6:]:
            os.close(fd)
        del held[-6:]
        src, net = RdmaSource("b", sysfs=sysfs), NetdevSource("b", sysfs=sysfs)
        got = {(r["device"], r["port"]): r for r in src.sweep(TS)["rdma_port"].to_pylist()}
        for fd in held[-6:]:  # the rdma source holds what was left; give netdev's scan a few
            os.close(fd)
        del held[-6:]
        (eth0,) = net.sweep(TS)["netdev"].to_pylist()
        assert src._files.transient and src.errors == 0
        src.close()
        net.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert got == want
    assert eth0["mtu"] == 1500 and eth0["carrier_changes"] == 2


def test_port_and_interface_state_changes_become_link_state_events(sys_copy):
    rdma, net = RdmaSource("ls", sysfs=str(sys_copy)), NetdevSource("ls", sysfs=str(sys_copy))
    assert "events" not in rdma.sweep(TS) and "events" not in net.sweep(TS)  # first sight: no change
    port = sys_copy / "class/infiniband/mlx4_0/ports/2"
    (port / "state").write_text("1: DOWN\n")
    (port / "phys_state").write_text("3: Disabled\n")
    (sys_copy / "class/net/eth0/operstate").write_text("down\n")
    (ev,) = rdma.sweep(TS + 1)["events"].to_pylist()
    assert (ev["kind"], ev["source"], ev["device"], ev["port"]) == ("link_state", "sysfs", "mlx4_0", 2)
    assert "port state 4 -> 1, phys_state 5 -> 3" in ev["message"]
    (nev,) = net.sweep(TS + 1)["events"].to_pylist()
    assert nev["device"] == "eth0" and "operstate up -> down" in nev["message"]
    assert "events" not in rdma.sweep(TS + 2) and "events" not in net.sweep(TS + 2)  # no change, no event
