"""The collector's uplink: stream each sweep's schema-v1 tables to the control plane, never blocking sampling.

Wire format: foreshock.v1.Telemetry.StreamSweeps (proto/foreshock/v1/telemetry.proto): a SweepBatch per
sweep, one TableRows per table as an Arrow IPC stream in the table's schema-v1 types and names (the
per-field unit/help metadata, documentation only, stays home: it would triple the bytes).

    uplink = StreamingUplink("cp.example:7443", node="gpu-017", tls="/etc/foreshock/ca.pem", token=tok)
    uplink.start()
    uplink.submit({"gpu": table, "rdma_port": table2})   # O(1); never waits on the network
    uplink.close(5.0)

    # a sharded control plane: the node's shard from the map, by its leaf switch
    uplink = StreamingUplink("", node="gpu-017", shard_map=ShardMapFile("/etc/foreshock/shards.toml"),
                             labels={"leaf_switch": "leaf-03"}, tls="/etc/foreshock/ca.pem", token=tok)

- Bounded: `submit` puts the sweep in a queue of `max_queue` sweeps; when full the oldest is dropped
  and counted (`stats()["dropped_oldest"]`). Sequence numbers are given at submit, so the service sees
  the gap.
- Flow control: at most `credits` batches beyond the last acknowledged one are in flight, as the
  service's SweepAck says; unacknowledged batches are re-sent after a reconnect (the service
  acknowledges a re-sent sequence without ingesting it twice).
- Deadlines: connecting (`connect_timeout`), every stream (`stream_seconds`, then it is rotated),
  every ack (`ack_timeout`: no ack for that long and the stream is torn down and reopened), and the
  last ack on close (`final_ack_timeout`: the verdicts of the last batches' value checks, which the
  server sends after the collector half-closes; verdicts a broken stream missed come on the next).
- Reconnects with exponential backoff (`backoff_initial` doubling to `backoff_max`) and full jitter.
- The schema once per stream: a server that keeps schemas (SweepAck.schemas_kept) gets each table's
  schema message whole the first time on a stream (and whenever it changes), then only the record
  batches (TableRows.schema_omitted): the schema is about 80 % of a sweep's bytes.
- Plaintext only to a loopback address; otherwise `tls` (a CA file path, or (ca, cert, key) paths for
  mutual TLS, or grpc.ChannelCredentials) is required. `token` goes as `authorization: Bearer`.
- Shards (docs/scaling.md): with `shard_map` (a service.shardmap.ShardMapFile) the target is the address
  of the shard the map places the node in, by its `labels` (leaf_switch, and site/spine for selectors),
  which every stream also carries as call metadata. A shard that refuses the node as another's
  (FAILED_PRECONDITION with the right shard's address in the trailing metadata) is left for that address
  at once, at most `max_redirects` times in a row without an ack (shards whose maps disagree would
  bounce it for ever); then the usual backoff, from the map's address again. When the map file changes
  (its mtime, or SIGHUP through `ShardMapFile.request_reload`), a stream to a shard the map no longer
  names ends and the next goes to the new one. The queue keeps taking sweeps meanwhile, within its bound;
  unacknowledged ones are re-sent to whichever shard takes the stream.
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
import time
import uuid

import grpc
import pyarrow as pa

from foreshock import schema as sch
from foreshock.net import Endpoint, PlaintextRefused, client_credentials
from foreshock.service.shardmap import ADDRESS_KEY, LABEL_KEYS, LABEL_VALUE_RE, SHARD_KEY, ShardMapError
from foreshock.v1 import telemetry_pb2, telemetry_pb2_grpc

log = logging.getLogger(__name__)

_WAKE = ("wake", None)
_WIRE_SCHEMAS = {name: pa.schema([pa.field(f.name, f.type, f.nullable) for f in s])
                 for name, s in sch.SCHEMAS.items()}


class UplinkError(ValueError):
    """An uplink that cannot be built as asked (the message says which argument)."""


def encode_table(name: str, table: pa.Table) -> bytes:
    """One schema-v1 table as an Arrow IPC stream (the TableRows.arrow_ipc bytes)."""
    return sch.ipc_stream(table, _WIRE_SCHEMAS[name])


_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def split_stream(buf: bytes) -> tuple[bytes, bytes]:
    """An encoded IPC stream as (its schema message, the messages after it without the end marker):
    the parts a stream whose server keeps schemas sends once and every sweep."""
    if len(buf) < 8 or buf[:4] != b"\xff\xff\xff\xff":
        raise ValueError("not an Arrow IPC stream with continuation markers")
    head = 8 + int.from_bytes(buf[4:8], "little", signed=True)
    body = buf[head:-8] if buf.endswith(_EOS) else buf[head:]
    return buf[:head], body


class _Sweep(dict):
    """One sweep's tables, with the watermark it was submitted with."""
    __slots__ = ("watermark_ns",)

    def __init__(self, *args):
        super().__init__(*args)
        self.watermark_ns = 0


class StreamingUplink:
    def __init__(self, target: str, *, node: str, tls=None, token: str | None = None, max_queue: int = 600,
                 collector_id: str | None = None, connect_timeout: float = 5.0, ack_timeout: float = 10.0,
                 stream_seconds: float = 600.0, backoff_initial: float = 0.5, backoff_max: float = 30.0,
                 initial_credits: int = 4, max_batch_bytes: int = 8 << 20, server_name: str | None = None,
                 final_ack_timeout: float = 4.0, shard_map=None, labels: dict[str, str] | None = None,
                 max_redirects: int = 4):
        if not node:
            raise UplinkError("uplink node must be named")
        self.node = node
        unknown = sorted(set(labels or {}) - set(LABEL_KEYS))
        if unknown:
            raise UplinkError(f"uplink label {unknown[0]!r}: not a placement label ({', '.join(LABEL_KEYS)})")
        for label, value in (labels or {}).items():
            if not isinstance(value, str) or not LABEL_VALUE_RE.match(value):
                raise UplinkError(f"uplink label {label} {value!r}: at most 256 printable ASCII characters, no spaces")
        self.labels = {k: v for k, v in (labels or {}).items() if v}
        self.shard_map = shard_map
        self._map_seen = None              # the ShardMap the target was last taken from
        self.shard = ""                    # the shard streamed to, as the map or a redirect names it
        self._map_target = self._map_shard = ""   # where the map places the node
        self._redirect: tuple[str, str] | None = None   # (shard, address) a shard sent this node to
        self._redirects_in_row = 0
        self.max_redirects = max(0, int(max_redirects))
        if shard_map is not None:
            if target:
                raise UplinkError(f"uplink target {target!r} and a shard map: the map names the target; give one")
            try:
                target = shard_map.current().shard_of(node, self.labels.get("leaf_switch", ""), self.labels).address
            except ShardMapError as exc:
                raise UplinkError(str(exc)) from None
        if not target or ":" not in target:
            raise UplinkError(f"uplink target {target!r} must be HOST:PORT")
        self.target = target
        try:
            self._creds = client_credentials(tls)
        except OSError as exc:
            raise UplinkError(f"uplink TLS file {exc.filename}: {exc.strerror}") from None
        options = [("grpc.max_send_message_length", max_batch_bytes + (1 << 20)),
                   ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000)]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        self._options = tuple(options)
        self._token = token
        try:
            self._endpoint = self._endpoint_to(target)
        except PlaintextRefused:
            raise UplinkError(f"uplink to {target}: plaintext is allowed to loopback addresses only; give tls") from None
        self._fixed_target = target
        self.collector_id = collector_id or f"{node}-{uuid.uuid4().hex[:12]}"
        self.max_queue = int(max_queue)
        self.connect_timeout = connect_timeout
        self.ack_timeout = ack_timeout
        self.stream_seconds = stream_seconds
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.initial_credits = max(1, int(initial_credits))
        self.max_batch_bytes = max_batch_bytes
        self.final_ack_timeout = final_ack_timeout
        self._close_deadline = float("inf")
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[int, dict[str, pa.Table]]] = collections.deque()
        self._have_work = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sequence = 0
        self._closed = False
        self._connected = False
        self._counts = collections.Counter()
        self.rejections: collections.Counter = collections.Counter()
        self.last_rejection: str = ""
        self.last_error: str = ""
        self.acked_sequence = 0
        self._session_q: queue.Queue | None = None
        self._next_target()

    # -- the sampling side (never blocks) --------------------------------------------------------------
    def submit(self, tables: dict[str, pa.Table], watermark_ns: int = 0) -> bool:
        """Queue one sweep's tables. O(1); when the queue is full the oldest sweep is dropped and counted.

        watermark_ns: the promise that no sampled row submitted later has an earlier ts (the time of the
        next sweep; 0: none). It travels as SweepBatch.watermark_ns and lets the service close a
        feature step as soon as every node is past it."""
        if self._closed:
            return False
        good = _Sweep((n, t) for n, t in tables.items() if n in _WIRE_SCHEMAS and t.num_rows)
        if not good:
            return False
        good.watermark_ns = max(0, int(watermark_ns))
        with self._lock:
            self._sequence += 1
            self._pending.append((self._sequence, good))
            self._counts["submitted"] += 1
            while len(self._pending) > self.max_queue:
                self._pending.popleft()
                self._counts["dropped_oldest"] += 1
        self._have_work.set()
        q = self._session_q
        if q is not None:
            q.put_nowait(_WAKE)  # the sender sends at once instead of at its next poll
        return True

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counts)
            out["queued"] = len(self._pending)
        out.update(connected=self._connected, acked_sequence=self.acked_sequence,
                   rejected=dict(self.rejections), last_error=self.last_error, collector_id=self.collector_id,
                   target=self.target, shard=self.shard)
        for k in ("submitted", "dropped_oldest", "sent", "acked", "resent", "reconnects", "oversized",
                  "unsent_at_close", "redirects", "shard_moves"):
            out.setdefault(k, 0)
        return out

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> "StreamingUplink":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"foreshock-uplink-{self.node}", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking sweeps, try for `timeout` seconds to deliver what is queued, then stop."""
        self._closed = True
        deadline = time.monotonic() + timeout
        self._close_deadline = deadline
        while time.monotonic() < deadline and self._thread is not None and self._connected:
            with self._lock:
                if not self._pending and self.acked_sequence >= self._sequence:
                    break
            time.sleep(0.02)
        self._stop.set()
        self._have_work.set()
        q = self._session_q
        if q is not None:
            q.put_nowait(_WAKE)  # the sender half-closes at once instead of at its next poll
        if self._thread is not None:
            self._thread.join(max(0.5, deadline - time.monotonic() + 2.0))
        with self._lock:
            unsent = len(self._pending)
            self._counts["unsent_at_close"] += unsent
        if unsent:
            # not lost from the node: the collector's Parquet spool holds every sweep it took
            log.warning("uplink %s: %d sweep(s) not delivered to %s when it closed (%s); they are in the "
                        "node's Parquet spool", self.node, unsent, self.target,
                        "connected" if self._connected else "not connected")

    # -- the network side ------------------------------------------------------------------------------
    def _encode(self, seq: int, tables: dict[str, pa.Table],
                heads: dict[str, bytes] | None = None) -> telemetry_pb2.SweepBatch | None:
        """The sweep as a SweepBatch; with `heads` (this stream's schema messages the server keeps, by
        table), a table whose schema message is already there goes without it."""
        rows = []
        size = 0
        sent_heads: dict[str, bytes] = {}
        for name, t in tables.items():
            try:
                buf = encode_table(name, t)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                log.error("uplink: table %s of sweep %d does not encode: %s", name, seq, exc)
                continue
            omitted = False
            if heads is not None:
                head, body = split_stream(buf)
                if heads.get(name) == head:
                    buf, omitted = body, True
                else:
                    sent_heads[name] = head
            size += len(buf)
            rows.append(telemetry_pb2.TableRows(table=name, schema_version=sch.SCHEMA_VERSION, arrow_ipc=buf,
                                                schema_omitted=omitted))
        if size > self.max_batch_bytes:
            self._counts["oversized"] += 1
            log.error("uplink: sweep %d is %d bytes, over %d; dropped", seq, size, self.max_batch_bytes)
            return None
        if heads is not None:
            heads.update(sent_heads)
        return telemetry_pb2.SweepBatch(node=self.node, collector_id=self.collector_id, sequence=seq, tables=rows,
                                        watermark_ns=getattr(tables, "watermark_ns", 0))

    def _take_ack(self, item, inflight, heads) -> None:
        for r in item.rejections:
            if r.reason == "unknown_schema" and heads is not None:
                heads.pop(r.table, None)   # send that table's schema whole again
            self.rejections[r.reason] += 1
            self.last_rejection = f"sequence {r.sequence} table {r.table}: {r.reason}: {r.detail}"
            log.warning("control plane refused %s", self.last_rejection)
        done = [s for s in inflight if s <= item.acked_sequence]
        for s in done:
            del inflight[s]
        self._counts["acked"] += len(done)
        self.acked_sequence = max(self.acked_sequence, item.acked_sequence)
        self._redirects_in_row = 0   # a shard took the stream: the redirects led somewhere

    # -- where to stream -------------------------------------------------------------------------------
    def _endpoint_to(self, target: str) -> Endpoint:
        return Endpoint(target, self._creds, self._options, self._token)

    def _next_target(self) -> str:
        """The address the next stream goes to: a shard's redirect while the map is unchanged since it
        came, else the map's shard for this node, else the fixed target."""
        if self.shard_map is not None:
            current = self.shard_map.current()
            if current is not self._map_seen:
                moved = self._map_seen is not None
                self._map_seen = current
                try:
                    placed = current.shard_of(self.node, self.labels.get("leaf_switch", ""), self.labels)
                except ShardMapError as exc:
                    log.error("uplink %s: %s; streaming on to %s", self.node, exc, self.target)
                else:
                    if moved and placed.address != self._map_target:
                        self._counts["shard_moves"] += 1
                        log.info("uplink %s: the shard map now places it in shard %s at %s", self.node,
                                 placed.name, placed.address)
                    self._map_target, self._map_shard = placed.address, placed.name
                    self._redirect = None   # the map's newer word replaces what a shard said before
        if self._redirect is not None:
            self.shard = self._redirect[0]
            return self._redirect[1]
        self.shard = self._map_shard
        return self._map_target or self._fixed_target

    def _redirected(self, exc: grpc.RpcError, target: str) -> bool:
        """Whether `exc` is a shard sending this node elsewhere; if so, it is the next stream's target."""
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            return False
        metadata = dict(exc.trailing_metadata() or ())
        shard, address = metadata.get(SHARD_KEY, ""), metadata.get(ADDRESS_KEY, "")
        if not address or address == target:
            return False
        try:
            self._endpoint_to(address)
        except PlaintextRefused:
            log.error("uplink %s: %s sent it to %s, which is no loopback address, and no tls is given",
                      self.node, target, address)
            return False
        self._redirects_in_row += 1
        if self._redirects_in_row > self.max_redirects:
            log.error("uplink %s: redirected %d times in a row without an ack, last to shard %s at %s: the "
                      "shards' maps disagree; backing off, then from the map's shard again", self.node,
                      self._redirects_in_row, shard, address)
            self._redirect, self._redirects_in_row = None, 0
            return False
        self._redirect = (shard, address)
        self._counts["redirects"] += 1
        log.warning("uplink %s: redirected (%s); following", self.node, exc.details())
        return True

    def _run(self) -> None:
        backoff = self.backoff_initial
        while not self._stop.is_set():
            target = self._next_target()   # idle too, so that stats() says where the next sweep goes
            if target != self.target:
                try:
                    self.target, self._endpoint = target, self._endpoint_to(target)
                except PlaintextRefused:
                    log.error("uplink %s: the shard map names %s, which is no loopback address, and no tls is "
                              "given; streaming on to %s", self.node, target, self.target)
                    self._map_target = self.target
            if not self._have_work.wait(0.5):
                continue
            t0 = time.monotonic()
            clean = self._session()
            if self._stop.is_set():
                break
            if clean:
                backoff = self.backoff_initial
                continue
            if self._redirect is not None and self._redirect[1] != self.target:
                continue   # straight to the shard named (bounded by max_redirects in _redirected)
            self._counts["reconnects"] += 1
            if time.monotonic() - t0 > 30:  # it had been up a while: start the backoff over
                backoff = self.backoff_initial
            delay = random.uniform(0, backoff)  # full jitter: a cluster of collectors does not reconnect in step
            backoff = min(self.backoff_max, backoff * 2)
            self._stop.wait(delay)

    def _session(self) -> bool:
        """One stream: returns True when it ended cleanly (rotation), False on trouble."""
        channel = self._endpoint.open()
        out: queue.Queue = queue.Queue()
        acks: queue.Queue = queue.Queue()
        inflight: collections.OrderedDict[int, dict[str, pa.Table]] = collections.OrderedDict()
        call = None
        try:
            try:
                grpc.channel_ready_future(channel).result(timeout=self.connect_timeout)
            except grpc.FutureTimeoutError:
                self.last_error = f"no connection to {self.target} within {self.connect_timeout} s"
                log.warning("uplink: %s", self.last_error)
                return False

            def requests():
                while True:
                    item = out.get()
                    if item is None:
                        return
                    yield item

            call = telemetry_pb2_grpc.TelemetryStub(channel).StreamSweeps(
                requests(), timeout=self.stream_seconds, metadata=self._endpoint.metadata + tuple(
                    (LABEL_KEYS[k], v) for k, v in self.labels.items()))

            def read():
                try:
                    for ack in call:
                        acks.put(ack)
                    acks.put(("end", None))
                except grpc.RpcError as exc:
                    acks.put(("error", exc))
            reader = threading.Thread(target=read, name=f"foreshock-uplink-acks-{self.node}", daemon=True)
            reader.start()
            self._session_q = acks
            self._connected = True
            credits = self.initial_credits
            heads: dict[str, bytes] | None = None   # set once the server says it keeps schemas
            last_ack = time.monotonic()
            map_checked = time.monotonic()
            while not self._stop.is_set():
                if self.shard_map is not None and time.monotonic() - map_checked >= 1.0:
                    map_checked = time.monotonic()
                    if self._next_target() != self.target:
                        return True   # the map moved this node: the next stream goes to its new shard
                # Send what the credits allow.
                while len(inflight) < max(1, credits):
                    with self._lock:
                        if not self._pending:
                            break
                        seq, tables = self._pending.popleft()
                    msg = self._encode(seq, tables, heads)
                    if msg is None:
                        continue
                    if not inflight:
                        last_ack = time.monotonic()
                    inflight[seq] = tables
                    out.put(msg)
                    self._counts["sent"] += 1
                if inflight and time.monotonic() - last_ack > self.ack_timeout:
                    self.last_error = f"no ack from {self.target} for {self.ack_timeout} s"
                    log.warning("uplink: %s; reconnecting", self.last_error)
                    return False
                try:
                    item = acks.get(timeout=0.25)
                except queue.Empty:
                    if not inflight:
                        self._have_work.clear()
                        with self._lock:
                            if self._pending:
                                self._have_work.set()
                    continue
                if isinstance(item, tuple):
                    kind, exc = item
                    if kind == "wake":
                        continue
                    if kind == "end":
                        return True
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not inflight:
                        return True  # the stream's own deadline: rotate
                    if self._redirected(exc, self.target):
                        return False
                    self.last_error = f"{exc.code().name}: {exc.details()}"
                    log.warning("uplink to %s: %s", self.target, self.last_error)
                    return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                last_ack = time.monotonic()
                credits = item.credits
                if item.schemas_kept and heads is None:
                    heads = {}
                self._take_ack(item, inflight, heads)
            # Closing: half-close, and hear the server out (it sends the verdicts of the last batches'
            # value checks in a last ack, then ends the stream), within the final-ack time.
            out.put(None)
            deadline = min(time.monotonic() + self.final_ack_timeout, max(time.monotonic() + 0.2, self._close_deadline))
            while time.monotonic() < deadline:
                try:
                    item = acks.get(timeout=max(0.01, min(0.25, deadline - time.monotonic())))
                except queue.Empty:
                    continue
                if isinstance(item, tuple):
                    if item[0] == "wake":
                        continue
                    break
                self._take_ack(item, inflight, heads)
            return True
        finally:
            self._connected = False
            self._session_q = None
            out.put(None)
            if call is not None:
                call.cancel()
            channel.close()
            if inflight:
                # Unacknowledged sweeps go back to the front, oldest first; the bound still holds.
                with self._lock:
                    for seq in reversed(list(inflight)):
                        self._pending.appendleft((seq, inflight[seq]))
                    self._counts["resent"] += len(inflight)
                    while len(self._pending) > self.max_queue:
                        self._pending.popleft()
                        self._counts["dropped_oldest"] += 1
                self._have_work.set()
