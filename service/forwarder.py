"""A shard's side of Coordinator.ForwardAlarms: its policy's alarms, fatal events, each node's latest risk and
the fabric's services' findings, sent to the jobs coordinator over one acked stream
(proto/foreshock/v1/coordinator.proto; the coordinator's side is service/coordinator.py).

- `AlarmForwarder` numbers each event (from 1 under an epoch, the forwarder's start time), keeps it until
  the coordinator acks it (an ack means the coordinator has committed it and what it decided on it),
  and sends it again on the next stream after a break: the coordinator knows an event it has applied by
  its (shard, epoch, sequence) and applies it once. The buffer is bounded (`buffer_events`): when it is
  full the oldest risk summary goes first (the next summary carries the node's latest risk), then the
  oldest event a later one in the buffer supersedes (a node's alarm or clear by its next alarm or
  clear, a fabric finding's raise or clear by its next: the coordinator ends in the same state
  without it), then the oldest other event; each drop is counted and logged, never a crash. A fatal
  event is a fact and is superseded by nothing. Every stream has a deadline
  (`stream_seconds`, then a new one at once), and so has every batch: one not acked within
  `ack_timeout_seconds` ends the stream, and the forwarder tries the next of its coordinator addresses
  (the standby, which answers UNAVAILABLE until it leads), with backoff.
- Peer totals ride the same stream beside the events (`put_totals`: the job and site totals of the
  steps the shard's scorer closed; each ack may bring the other shards' sums, `take_peer_totals`). They
  are not events: the newest MAX_TOTALS_STEPS steps wait for the next request, older ones go, and each
  is sent once (a stream that breaks loses them: the scorer uses its own nodes' until the next arrive).
  The coordinator answers only on a request, and a shard that sends its step first hears of the others'
  only later: until the sums of the step it sent last come, an empty request asks again every
  `totals_poll_seconds`, at most TOTALS_POLLS times a step.
- The jobs' step times come back on the acks (ForwardAck `step_times`: the rows of the jobs with a node
  on this shard, service/steptimefeed.py, which defines the format): each ack's rows go to
  `on_step_times` (the round scheduler's take_checked: the scorer takes them with its next drain, as an
  unsharded service's Jobs API hands them over). An ack that carried rows makes the forwarder ask again,
  at once when the coordinator says more wait, else after `totals_poll_seconds`, so rows flow while a
  job reports and an idle shard sends nothing more. Best effort, counted: `step_time_rows_received_total`,
  and `step_time_acks_refused_total` for rows that do not decode (logged).
- `ShardReporter` turns a shard's rounds into events: a node that enters risk alarm (ALARM), leaves it
  (CLEARED), a fatal event (FATAL), and every `summary_seconds` every scored node's risk and topology
  (RISK), by which the coordinator ranks spares and finds a fabric incident across shards; and as the
  policy judges them, each fabric-service finding raised or cleared (FABRIC_SERVICE: node, unit,
  finding; service/fabricunits.py), by which the coordinator refuses a spare whose Fabric Manager is
  down or crash-looping.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field

import grpc

from foreshock import config
from foreshock.net import Endpoint, PlaintextRefused, client_credentials
from foreshock.ratelimit import LogLimiter
from foreshock.service.coordinator import MAX_EVENTS, MAX_SIGNALS, MAX_TEXT, MAX_TOTALS_STEPS
from foreshock.service.steptimefeed import decode as decode_step_times
from foreshock.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

# [serve] keys of the forwarder -> their ranges, declared once; ForwardSettings holds its values to them.
CHECKS: dict[str, config.Check] = {
    "buffer_events": config.between(100, 10_000_000),
    "batch_events": config.between(1, MAX_EVENTS),
    "ack_timeout_seconds": config.between(0.1, 300),
    "stream_seconds": config.between(1, 86_400),
    "backoff_initial_seconds": config.between(0.01, 60),
    "backoff_max_seconds": config.between(0.01, 600),
    "summary_seconds": config.between(1, 3600),
    "totals_poll_seconds": config.between(0.05, 60),
}


# Events searched from the oldest for one a later event supersedes, when the buffer is full: a drop
# stays cheap however large the buffer (a superseded event is usually among the oldest).
SUPERSEDED_SCAN = 4096

# Half a 60 s step at the default poll period: the other shards' totals normally follow within the
# grace period of the step's close, and a coordinator that has none (a shard down) is not asked all step.
TOTALS_POLLS = 30


class ForwardError(ValueError):
    """Forwarder settings that cannot work; the message names the setting."""


@dataclass(frozen=True)
class ForwardSettings:
    addresses: tuple[str, ...]           # the coordinator and its standby, HOST:PORT each
    shard: str                           # this shard's name: the events' ids are (shard, epoch, sequence)
    buffer_events: int = 100_000         # events not yet acked; beyond, the oldest summary (then alarm) drops
    batch_events: int = 256              # events per request
    ack_timeout_seconds: float = 5.0     # a batch not acked this long ends the stream (next address)
    stream_seconds: float = 600.0        # each stream's deadline; the next opens at once
    backoff_initial_seconds: float = 0.1
    backoff_max_seconds: float = 5.0
    summary_seconds: float = 15.0        # every scored node's risk and topology, this often
    totals_poll_seconds: float = 1.0     # asks again this often for the others' sums of the step it sent last
    tls_ca: str = ""                     # the coordinator's CA (PEM); "": plaintext, loopback only
    token: str = field(default="", repr=False)   # a shard:NAME bearer token; "": none (mutual TLS, insecure)

    def __post_init__(self):
        if not self.addresses:
            raise ForwardError("coordinator_address is empty: give HOST:PORT[,HOST:PORT] (the coordinator, "
                               "then its standby)")
        for a in self.addresses:
            host, sep, port = a.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ForwardError(f"coordinator_address {a!r} is not HOST:PORT")
        if not self.shard:
            raise ForwardError("shard is empty: a forwarding shard needs a name (--shard NAME)")
        for key, check in CHECKS.items():
            value = getattr(self, key)
            if isinstance(value, float) and not math.isfinite(value) or not check.ok(value):
                raise ForwardError(f"forward {key} {value!r}: {check.allowed}")


def parse_addresses(spec: str) -> tuple[str, ...]:
    """"a:1,b:2" -> ("a:1", "b:2")."""
    return tuple(a.strip() for a in spec.split(",") if a.strip())


def _state_key(ev) -> tuple | None:
    """What an event sets at the coordinator, so that a later event with the same key supersedes it: a
    node's risk alarm (raised or cleared), a fabric finding on a node's unit; None for a fatal event."""
    K = coordinator_pb2
    if ev.kind in (K.SHARD_EVENT_KIND_ALARM, K.SHARD_EVENT_KIND_CLEARED):
        return ("alarm", ev.node)
    if ev.kind == K.SHARD_EVENT_KIND_FABRIC_SERVICE:
        return ("fabric_service", ev.node, ev.unit, ev.finding)
    return None


class AlarmForwarder:
    """Construct, `start()`, then `put(...)` events from any thread; `stop()` at the end.

    Counters (read by service/metrics.py): `acked_total`, `dropped_total` (per kind name),
    `reconnects_total`, `connected`, `buffered()`, and the peer totals' and step times' (`totals_sent_total`,
    `peer_totals_received_total`, `step_time_rows_received_total`, `step_time_acks_refused_total`)."""

    def __init__(self, settings: ForwardSettings, *, model_version: str, clock=time.time_ns, on_step_times=None):
        """on_step_times(table name, rows): takes the step_times rows the acks bring; None: they are
        counted and let go."""
        self.settings = settings
        self.on_step_times = on_step_times
        self.model_version = model_version
        credentials = client_credentials(settings.tls_ca or None)   # OSError names an unreadable CA file
        try:
            self._endpoints = [Endpoint(a, credentials, (("grpc.keepalive_time_ms", 10_000),), settings.token or None)
                               for a in settings.addresses]
        except PlaintextRefused as exc:
            raise ForwardError(f"coordinator_address {exc}; give the coordinator's CA (forward_tls_ca)") from None
        self.epoch = clock()
        self._seq = 0
        self._alarms: collections.deque = collections.deque()   # (sequence, ShardEvent) not acked
        self._latest: dict[tuple, int] = {}   # a buffered event's state key -> the newest sequence with it
        self._risk: collections.deque = collections.deque()     # RISK summaries not acked
        self._cv = threading.Condition()
        self._sent_upto = 0
        self._acked = 0
        self._in_flight: collections.deque = collections.deque()   # (last sequence of a batch, sent at)
        self._totals: dict[int, coordinator_pb2.StepTotals] = {}   # steps of this shard's totals not sent yet
        self._peer_totals: coordinator_pb2.StepTotals | None = None   # the others' sums not taken yet
        self._totals_step = 0      # the newest step of this shard's totals sent ...
        self._peer_step = 0        # ... and of the others' sums received
        self._polls = 0            # empty requests asking for the sums of _totals_step
        self._requested_at = 0.0
        self._rows_ask_at: float | None = None   # when to ask again for step times (monotonic); None: not
        self._stream = 0           # the stream the request generator belongs to
        self._call = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = LogLimiter(log)
        self.acked_total = 0
        self.dropped_total: dict[str, int] = {}
        self.dropped_superseded_total = 0   # of those, events a later buffered one superseded: no state lost
        self.reconnects_total = 0
        self.totals_sent_total = 0
        self.peer_totals_received_total = 0
        self.step_time_rows_received_total = 0
        self.step_time_acks_refused_total = 0
        self.connected = False
        self.address = settings.addresses[0]

    # -- events in -----------------------------------------------------------------------------------
    def put(self, kind: int, node: str, *, risk: float = 0.0, ts_ns: int = 0, signals=(), fatal_kind: str = "",
            description: str = "", topology=None, unit: str = "", finding: str = "", raised: bool = False) -> int:
        """Queue one event (a coordinator_pb2.ShardEventKind); returns its sequence. Never blocks."""
        ev = coordinator_pb2.ShardEvent(
            kind=kind, node=node, risk=float(risk), ts_ns=int(ts_ns), fatal_kind=fatal_kind,
            description=description[:MAX_TEXT], unit=unit, finding=finding, raised=raised,
            signals=[common_pb2.Signal(name=s.name, value=s.value, contribution=s.contribution,
                                       description=s.description) for s in list(signals)[:MAX_SIGNALS]])
        if topology is not None:
            ev.leaf_switch, ev.site, ev.nvlink_domain = topology.leaf_switch, topology.site, topology.nvlink_domain
        with self._cv:
            self._seq += 1
            ev.sequence = self._seq
            if kind == coordinator_pb2.SHARD_EVENT_KIND_RISK:
                self._risk.append(ev)
            else:
                self._alarms.append(ev)
                key = _state_key(ev)
                if key is not None:
                    self._latest[key] = ev.sequence
            while len(self._alarms) + len(self._risk) > self.settings.buffer_events:
                self._drop_oldest()
            self._cv.notify_all()
            return ev.sequence

    def _drop_oldest(self) -> None:
        superseded = False
        if self._risk:
            victim = self._risk.popleft()
        else:
            for i, ev in enumerate(itertools.islice(self._alarms, SUPERSEDED_SCAN)):
                key = _state_key(ev)
                if key is not None and self._latest.get(key, 0) > ev.sequence:
                    del self._alarms[i]
                    victim, superseded = ev, True
                    break
            else:
                victim = self._alarms.popleft()
                self._forget(victim)
        name = coordinator_pb2.ShardEventKind.Name(victim.kind).removeprefix("SHARD_EVENT_KIND_").lower()
        self.dropped_total[name] = self.dropped_total.get(name, 0) + 1
        self.dropped_superseded_total += superseded
        self._log.warning("drop", "forwarder buffer full (%d events, the coordinator at %s not acking): "
                          "dropped %s %s event (node %s); %s dropped so far, %d of them superseded",
                          self.settings.buffer_events, self.address,
                          "a superseded" if superseded else "the oldest", name, victim.node, self.dropped_total,
                          self.dropped_superseded_total)

    def _forget(self, ev) -> None:
        """`ev` leaves the buffer (acked or dropped): its state key with it, when it was the newest."""
        key = _state_key(ev)
        if key is not None and self._latest.get(key) == ev.sequence:
            del self._latest[key]

    def put_totals(self, steps) -> None:
        """This shard's job and site totals, [(step, {group: {name: row}})] (OnlineScorer.take_local_totals),
        for the next request. Never blocks."""
        with self._cv:
            for step, groups in steps:
                self._totals[int(step)] = coordinator_pb2.StepTotals(step=int(step), groups=[
                    coordinator_pb2.GroupTotals(group=g, name=name, values=[float(v) for v in row])
                    for g, rows in sorted(groups.items()) for name, row in sorted(rows.items())])
            for step in sorted(self._totals)[:-MAX_TOTALS_STEPS]:
                del self._totals[step]
            self._cv.notify_all()

    def take_peer_totals(self):
        """The other shards' sums the coordinator sent last, (step, {group: {name: [values]}}), once; None
        when none came since the last call."""
        with self._cv:
            got, self._peer_totals = self._peer_totals, None
        if got is None:
            return None
        groups: dict[str, dict[str, list[float]]] = {}
        for g in got.groups:
            groups.setdefault(g.group, {})[g.name] = list(g.values)
        return got.step, groups

    def buffered(self) -> int:
        with self._cv:
            return len(self._alarms) + len(self._risk)

    # -- the stream ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="foreshock-forwarder", daemon=True)
            self._thread.start()

    def stop(self, flush_seconds: float = 2.0) -> None:
        """Stop, after waiting up to `flush_seconds` for what is buffered to be acked."""
        end = time.monotonic() + flush_seconds
        while self.buffered() and time.monotonic() < end and self.connected:
            time.sleep(0.02)
        self._stop.set()
        with self._cv:
            call = self._call
            self._cv.notify_all()
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(10)
        left = self.buffered()
        if left:
            log.warning("forwarder stopped with %d events the coordinator has not acked", left)

    def _requests(self, stream: int):
        s = self.settings
        while True:
            with self._cv:
                while True:
                    if self._stop.is_set() or stream != self._stream:
                        return
                    if self._in_flight and time.monotonic() - self._in_flight[0][1] > s.ack_timeout_seconds:
                        self._log.warning(("ack", self.address), "coordinator %s: no ack in %.1f s; reconnecting",
                                          self.address, s.ack_timeout_seconds)
                        if self._call is not None:
                            self._call.cancel()
                        return
                    batch = []
                    for ev in heapq.merge(self._alarms, self._risk, key=lambda e: e.sequence):
                        if ev.sequence > self._sent_upto:
                            batch.append(ev)
                            if len(batch) >= s.batch_events:
                                break
                    if batch or self._totals:
                        break
                    if (self._peer_step < self._totals_step and self._polls < TOTALS_POLLS and not self._in_flight
                            and time.monotonic() - self._requested_at >= s.totals_poll_seconds):
                        self._polls += 1
                        break
                    if self._rows_ask_at is not None and time.monotonic() >= self._rows_ask_at:
                        break
                    self._cv.wait(min(0.1, s.totals_poll_seconds))
                totals = [self._totals[step] for step in sorted(self._totals)]
                self._totals.clear()
                if totals:
                    self.totals_sent_total += len(totals)
                    self._totals_step, self._polls = max(self._totals_step, totals[-1].step), 0
                self._requested_at = time.monotonic()
                self._rows_ask_at = None   # this request's ack says whether to ask again
                if batch:
                    self._sent_upto = batch[-1].sequence
                    self._in_flight.append((self._sent_upto, time.monotonic()))
            yield coordinator_pb2.ForwardRequest(shard=s.shard, epoch=self.epoch, model_version=self.model_version,
                                                 events=batch, totals=totals)

    def _on_ack(self, ack) -> None:
        if ack.epoch != self.epoch:
            return
        if ack.step_times:
            self._take_step_times(ack.step_times, ack.step_times_pending)
        with self._cv:
            if ack.HasField("peer_totals") and ack.peer_totals.step:
                self._peer_totals = ack.peer_totals
                self._peer_step = max(self._peer_step, ack.peer_totals.step)
                self.peer_totals_received_total += 1
            upto = ack.acked_sequence
            if upto <= self._acked:
                return
            while self._alarms and self._alarms[0].sequence <= upto:
                self._forget(self._alarms.popleft())
                self.acked_total += 1
            while self._risk and self._risk[0].sequence <= upto:
                self._risk.popleft()
                self.acked_total += 1
            while self._in_flight and self._in_flight[0][0] <= upto:
                self._in_flight.popleft()
            self._acked = upto
            self._cv.notify_all()

    def _take_step_times(self, data: bytes, more: bool) -> None:
        try:
            rows = decode_step_times(data)
        except ValueError as exc:
            self.step_time_acks_refused_total += 1
            self._log.warning("step_times", "coordinator %s: step times refused: %s", self.address, exc)
            rows = None
        if rows is not None:
            self.step_time_rows_received_total += rows.num_rows
            if self.on_step_times is not None:
                self.on_step_times("step_times", rows)
        with self._cv:
            self._rows_ask_at = time.monotonic() + (0.0 if more else self.settings.totals_poll_seconds)
            self._cv.notify_all()

    def _run(self) -> None:
        s = self.settings
        failures, index = 0, 0
        while not self._stop.is_set():
            endpoint = self._endpoints[index % len(self._endpoints)]
            self.address = endpoint.target
            channel = endpoint.open()
            with self._cv:
                self._stream += 1
                stream = self._stream
                self._sent_upto = self._acked   # what was sent and not acked goes again
                self._in_flight.clear()
            try:
                call = coordinator_pb2_grpc.CoordinatorStub(channel).ForwardAlarms(
                    self._requests(stream), timeout=s.stream_seconds, metadata=endpoint.metadata)
                with self._cv:
                    self._call = call
                if self._stop.is_set():
                    call.cancel()
                for ack in call:
                    if not self.connected:
                        log.info("forwarding to the coordinator at %s", endpoint.target)
                    self.connected = True
                    failures = 0
                    self._on_ack(ack)
                failures = 0
            except grpc.RpcError as exc:
                code = exc.code()
                if self._stop.is_set():
                    break
                self.connected = False
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and failures == 0:
                    continue   # the stream's window ended: the next one at once, same address
                self._log.warning(("rpc", endpoint.target, code), "coordinator %s: %s %s; trying %s",
                                  endpoint.target, code.name, (exc.details() or "")[:200],
                                  self._endpoints[(index + 1) % len(self._endpoints)].target)
                failures += 1
                index += 1
                self.reconnects_total += 1
                delay = min(s.backoff_max_seconds, s.backoff_initial_seconds * 2 ** min(failures - 1, 16))
                self._stop.wait(delay * random.uniform(0.5, 1.0))
            finally:
                with self._cv:
                    self._stream += 1    # the request generator of this stream ends
                    self._call = None
                    self._cv.notify_all()
                channel.close()
        self.connected = False


class ShardReporter:
    """A shard's policy state after each round -> the forwarder's events (see the module docstring)."""

    def __init__(self, forwarder: AlarmForwarder, nodes, policy, *, summary_seconds: float,
                 monotonic=time.monotonic):
        self.forwarder = forwarder
        self.nodes = nodes
        self.policy = policy
        self.summary_seconds = summary_seconds
        self._monotonic = monotonic
        self._sent: dict[str, tuple] = {}   # node -> ("alarm",) or ("fatal", event ts)
        self._summary_at = -math.inf
        policy.on_fabric_change.append(self.fabric_changed)

    def fabric_changed(self, change, now_ns: int) -> None:
        """A fabric-service finding the policy's judge raised or cleared (a fabricunits.Change)."""
        u = change.unit
        self.forwarder.put(coordinator_pb2.SHARD_EVENT_KIND_FABRIC_SERVICE, u.node, ts_ns=now_ns,
                           description=change.reason, unit=u.unit, finding=change.finding, raised=change.raised)

    def after_round(self, now_ns: int) -> None:
        put, K = self.forwarder.put, coordinator_pb2
        with self.policy.lock:
            alarms = {n: (a.fatal, a.since_ns, a.risk, a.reason) for n, a in self.policy.alarms.items()}
        for node, (fatal, since_ns, risk, reason) in sorted(alarms.items()):
            topo = self.nodes.topo(node)
            if fatal:
                ev = self.nodes.fatal.get(node)
                key = ("fatal", ev.ts_ns if ev else since_ns)
                if self._sent.get(node) != key:
                    put(K.SHARD_EVENT_KIND_FATAL, node, risk=risk, ts_ns=key[1], topology=topo,
                        fatal_kind=ev.kind if ev else "fatal", description=ev.description if ev else reason)
                    self._sent[node] = key
            elif self._sent.get(node) != ("alarm",):
                rec = self.nodes.risk.get(node)
                put(K.SHARD_EVENT_KIND_ALARM, node, risk=risk, ts_ns=since_ns, topology=topo, description=reason,
                    signals=rec.signals if rec else ())
                self._sent[node] = ("alarm",)
        for node in [n for n in self._sent if n not in alarms]:
            if self._sent.pop(node) == ("alarm",):
                put(K.SHARD_EVENT_KIND_CLEARED, node, risk=self.nodes.probability(node) or 0.0, ts_ns=now_ns,
                    topology=self.nodes.topo(node))
        if self._monotonic() - self._summary_at >= self.summary_seconds:
            self._summary_at = self._monotonic()
            for r in self.nodes.snapshot():
                put(K.SHARD_EVENT_KIND_RISK, r.node, risk=r.probability, ts_ns=r.scored_at_ns,
                    topology=self.nodes.topo(r.node))


__all__ = ["AlarmForwarder", "ForwardSettings", "ForwardError", "ShardReporter", "CHECKS", "parse_addresses"]
