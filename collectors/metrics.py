"""The collector's own health on a local Prometheus endpoint: a custom collector over the latest snapshot.

Families (all labelled by nothing but what they say; the node is the scrape target):
foreshock_collector_source_success{source}, foreshock_collector_source_duration_seconds{source},
foreshock_collector_source_errors_total{source}, foreshock_collector_source_absent{source},
foreshock_collector_unknown_xids_total{source}, foreshock_collector_xid_repeats_folded_total{source},
foreshock_collector_rows_written_total{table}, foreshock_collector_bytes_written_total,
foreshock_collector_files_written_total, foreshock_collector_files_dropped_total,
foreshock_collector_bytes_dropped_total, foreshock_collector_write_errors_total,
foreshock_collector_buffered_rows, foreshock_collector_spool_bytes, foreshock_collector_sweeps_total,
foreshock_collector_last_sweep_duration_seconds, foreshock_collector_rejected_tables_total,
foreshock_collector_uplink_batches_total{result}, and with an uplink: foreshock_collector_uplink_connected,
_uplink_queued_sweeps, _uplink_dropped_sweeps_total, _uplink_acked_sweeps_total,
_uplink_target_info{target,shard} (shard "" without a shard map), _uplink_redirects_total (a shard sent
the node to another) and _uplink_shard_moves_total (the shard map moved it).

Served by prometheus-client on a private registry (never the global one), so tests can read it directly;
it also carries process_*, python_info and python_gc_* (foreshock/exposition.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from foreshock.exposition import new_registry

P = "foreshock_collector_"


class CollectorMetrics:
    """prometheus-client custom collector: yields metric families from `collector.snapshot()`."""

    def __init__(self, collector):
        self.collector = collector

    def describe(self):
        return []  # families are built per scrape from the snapshot

    def collect(self):
        s = self.collector.snapshot()
        ok = GaugeMetricFamily(P + "source_success", "1 if the source's last sweep succeeded.", labels=["source"])
        dur = GaugeMetricFamily(P + "source_duration_seconds", "Wall time of the source's last sweep.",
                                labels=["source"])
        err = CounterMetricFamily(P + "source_errors", "Read errors and failed sweeps of the source.",
                                  labels=["source"])
        absent = GaugeMetricFamily(P + "source_absent", "1 if the source's hardware is absent on this node.",
                                   labels=["source"])
        # a new driver's Xid the catalogue does not know raises nothing: this is where it shows
        unknown = CounterMetricFamily(P + "unknown_xids", "Xid events outside Foreshock's Xid catalogue.",
                                      labels=["source"])
        # an Xid flood writes a row a window, not a row a line: its size shows here
        folded = CounterMetricFamily(P + "xid_repeats_folded", "Xid lines counted into a folded events row "
                                     "instead of a row each.", labels=["source"])
        for name, st in sorted(s.sources.items()):
            ok.add_metric([name], 1.0 if st.success else 0.0)
            dur.add_metric([name], st.duration_seconds)
            err.add_metric([name], st.errors)
            absent.add_metric([name], 1.0 if st.absent else 0.0)
            unknown.add_metric([name], st.unknown_xids)
            folded.add_metric([name], st.folded_xids)
        yield from (ok, dur, err, absent, unknown, folded)
        rows = CounterMetricFamily(P + "rows_written", "Rows written to Parquet, by table.", labels=["table"])
        for table, n in sorted(s.rows_written.items()):
            rows.add_metric([table], n)
        yield rows
        yield CounterMetricFamily(P + "bytes_written", "Parquet bytes written.", value=s.bytes_written)
        yield CounterMetricFamily(P + "files_written", "Parquet files written.", value=s.files_written)
        yield CounterMetricFamily(P + "files_dropped", "Spooled files dropped to stay under the spool bound.",
                                  value=s.files_dropped)
        yield CounterMetricFamily(P + "bytes_dropped", "Bytes of spooled files dropped.", value=s.bytes_dropped)
        yield CounterMetricFamily(P + "write_errors", "Table writes that failed (rows of that interval lost).",
                                  value=s.write_errors)
        yield CounterMetricFamily(P + "rejected_tables", "Sweep tables refused for not fitting schema v1.",
                                  value=s.rejected_tables)
        yield GaugeMetricFamily(P + "buffered_rows", "Rows buffered in the open interval.", value=s.buffered_rows)
        yield GaugeMetricFamily(P + "spool_bytes", "Bytes of closed Parquet files on disk.", value=s.spool_bytes)
        yield CounterMetricFamily(P + "sweeps", "Sweeps done.", value=s.sweeps)
        yield GaugeMetricFamily(P + "last_sweep_duration_seconds", "Wall time of the last sweep.",
                                value=s.last_sweep_duration_seconds)
        up = CounterMetricFamily(P + "uplink_batches", "Sweeps handed to the uplink, by result.", labels=["result"])
        up.add_metric(["accepted"], s.uplink_submitted)
        up.add_metric(["refused"], s.uplink_refused)
        yield up
        if s.uplink:
            yield GaugeMetricFamily(P + "uplink_connected", "1 while the uplink has a stream open.",
                                    value=1.0 if s.uplink.get("connected") else 0.0)
            yield GaugeMetricFamily(P + "uplink_queued_sweeps", "Sweeps waiting to be sent.",
                                    value=s.uplink.get("queued", 0))
            yield CounterMetricFamily(P + "uplink_dropped_sweeps", "Sweeps dropped because the queue was full.",
                                      value=s.uplink.get("dropped_oldest", 0))
            yield CounterMetricFamily(P + "uplink_acked_sweeps", "Sweeps the control plane acknowledged.",
                                      value=s.uplink.get("acked", 0))
            target = GaugeMetricFamily(P + "uplink_target_info", "Where the uplink streams: the control plane's "
                                       "address and, with a shard map, the shard.", labels=["target", "shard"])
            target.add_metric([str(s.uplink.get("target", "")), str(s.uplink.get("shard", ""))], 1.0)
            yield target
            yield CounterMetricFamily(P + "uplink_redirects", "Streams a shard refused as another shard's, "
                                      "followed to the shard it named.", value=s.uplink.get("redirects", 0))
            yield CounterMetricFamily(P + "uplink_shard_moves", "Times a changed shard map placed the node in "
                                      "another shard.", value=s.uplink.get("shard_moves", 0))


def registry_for(collector) -> CollectorRegistry:
    registry = new_registry()
    registry.register(CollectorMetrics(collector))
    return registry


def render(collector) -> bytes:
    """The text exposition of the collector's metrics (what /metrics serves)."""
    return generate_latest(registry_for(collector))


def serve(collector, listen: str):
    """Start the endpoint on its own thread; returns (server, thread) for shutdown()."""
    from prometheus_client import start_http_server
    from foreshock.config import parse_listen
    addr, port = parse_listen(listen)
    return start_http_server(port, addr=addr, registry=registry_for(collector))
