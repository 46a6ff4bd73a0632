"""The gRPC servicers (asyncio): translate protobuf to domain calls and domain errors to gRPC statuses.

Nothing here decides anything: validation lives in jobs.py / ingest.py, decisions in policy.py,
state in store.py. A request that is no valid protobuf of its method's type gets INVALID_ARGUMENT
(UndecodableRequests, on every method, ours and the health and reflection services), logged at most
once a minute per method and peer address. Slow domain calls (SQLite commits) run in a worker thread
so the event loop keeps serving thousands of telemetry streams. A shard (`serve --shard`) refuses the
telemetry of another shard's node with FAILED_PRECONDITION and the right shard in the trailing metadata
(service/shardmap.py). Services: foreshock.v1.Telemetry, Risk, Jobs,
Coordinator (proto/foreshock/v1/*.proto), and `Refusing`: what a coordinator's standby answers, and a
forwarding shard to the Jobs API.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
import time

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from foreshock.ratelimit import LogLimiter
from foreshock.service import shardmap
from foreshock.service.errors import InvalidArgument, NotFound, PermissionDenied, ServiceError, WrongShard
from foreshock.service.ingest import URGENT_TABLES
from foreshock.service.jobs import check_node
from foreshock.service.domain import Directive
from foreshock.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, jobs_pb2, jobs_pb2_grpc, risk_pb2
from foreshock.v1 import risk_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

log = logging.getLogger(__name__)

WATCH_QUEUE = 256          # directives buffered per watcher before it is resynchronised from the store
FINAL_ACK_SECONDS = 3.0    # at a stream's end, how long it waits for its last batches' value checks
# A batch with events is acknowledged once the policy has acted on it (its directives committed), so
# that a collector never forgets a fatal event the service could still lose; a round that fails or
# never comes must not hold the acks back for ever, so after this long it is acknowledged anyway.
ACTED_ACK_SECONDS = 10.0
RISK_WATCH_QUEUE = 64      # scoring rounds buffered per risk watcher; older rounds are dropped


class Undecodable(Exception):
    """A request's bytes that its method's message type does not parse."""


def _decoder(deserializer, *, raise_it: bool):
    """The method's deserializer, with a failure turned into an Undecodable: returned (a unary request,
    which gRPC decodes before any handler code runs) or raised (a streamed one, read by the handler)."""
    def decode(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever a parser raises on garbage
            err = Undecodable(f"{len(raw)} bytes: {type(exc).__name__}: {str(exc)[:120]}")
            if raise_it:
                raise err from None
            return err
    return decode


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT with a one-line message for an undecodable request, instead of gRPC's UNKNOWN
    and a traceback in the log for every such message."""

    def __init__(self):
        self._log = LogLimiter(log)

    async def _refuse(self, context, method: str, err: Undecodable):
        peer = context.peer()
        # by address, not by port: a client that reconnects for every message is still one peer
        self._log.warning((method, peer.rpartition(":")[0]), "%s from %s: undecodable request (%s)", method, peer, err)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid message "
                                                              f"of its type ({err})")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        refuse = self._refuse
        serialize = handler.response_serializer
        if handler.unary_unary or handler.unary_stream:
            decode = _decoder(handler.request_deserializer, raise_it=False)
            if handler.unary_unary:
                inner = handler.unary_unary

                async def unary_unary(request, context):
                    if request.__class__ is Undecodable:
                        await refuse(context, method, request)
                    return await inner(request, context)
                return grpc.unary_unary_rpc_method_handler(unary_unary, decode, serialize)
            inner_us = handler.unary_stream

            async def unary_stream(request, context):
                if request.__class__ is Undecodable:
                    await refuse(context, method, request)
                async for item in inner_us(request, context):
                    yield item
            return grpc.unary_stream_rpc_method_handler(unary_stream, decode, serialize)
        decode = _decoder(handler.request_deserializer, raise_it=True)
        if handler.stream_unary:
            inner_su = handler.stream_unary

            async def stream_unary(request_iterator, context):
                try:
                    return await inner_su(request_iterator, context)
                except Undecodable as err:
                    await refuse(context, method, err)
            return grpc.stream_unary_rpc_method_handler(stream_unary, decode, serialize)
        inner_ss = handler.stream_stream
        if inspect.iscoroutinefunction(inner_ss):  # context.read()/write() (StreamSweeps): no generator layer
            async def stream_stream_rw(request_iterator, context):
                try:
                    await inner_ss(request_iterator, context)
                except Undecodable as err:
                    await refuse(context, method, err)
            return grpc.stream_stream_rpc_method_handler(stream_stream_rw, decode, serialize)

        async def stream_stream(request_iterator, context):
            try:
                async for item in inner_ss(request_iterator, context):
                    yield item
            except Undecodable as err:
                await refuse(context, method, err)
        return grpc.stream_stream_rpc_method_handler(stream_stream, decode, serialize)


def _ts(ns: int) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(int(ns))
    return t


async def _abort(context, err: ServiceError):
    await context.abort(getattr(grpc.StatusCode, err.code), str(err))


def directive_to_proto(d: Directive) -> jobs_pb2.Directive:
    return jobs_pb2.Directive(
        directive_id=d.directive_id, job_id=d.job_id, kind=int(d.kind), ranks=list(d.ranks),
        from_node=d.from_node, to_node=d.to_node, at_step=d.at_step, deadline=_ts(d.deadline_ns),
        reason=d.reason, risk=d.risk,
        signals=[common_pb2.Signal(name=s.name, value=s.value, contribution=s.contribution,
                                   description=s.description) for s in d.signals],
        issued_at=_ts(d.issued_at_ns), state=int(d.state), generation=d.generation, cause=int(d.cause))


class JobsServicer(jobs_pb2_grpc.JobsServicer):
    def __init__(self, plane):
        self.plane = plane

    def _principal(self, context):
        return self.plane.authenticator.principal(context)

    def _job_scope(self, context, job_id: str) -> None:
        p = self._principal(context)
        if p is None or not p.may_act_for_job(job_id):
            raise PermissionDenied(f"credential for {p.subject if p else '?'!r} may not act for job {job_id!r}")

    async def RegisterJob(self, request, context):
        try:
            self._job_scope(context, request.job_id)
            ranks = [(r.rank, r.node, list(r.gpus)) for r in request.ranks]
            job = await asyncio.to_thread(
                self.plane.jobs.register, request.job_id, ranks, list(request.spare_nodes),
                request.max_concurrent_evacuations, int(request.fallback), request.current_step)
            return jobs_pb2.RegisterJobResponse(job_id=job.job_id, generation=job.generation)
        except ServiceError as err:
            await _abort(context, err)

    async def ReportStep(self, request, context):
        try:
            self._job_scope(context, request.job_id)
            await asyncio.to_thread(self.plane.jobs.report_step, request.job_id, request.step,
                                    request.step_seconds)
            return jobs_pb2.ReportStepResponse()
        except ServiceError as err:
            await _abort(context, err)

    async def ReportStepTimes(self, request, context):
        try:
            self._job_scope(context, request.job_id)
            samples = [(t.step, t.step_seconds, t.compute_seconds, t.end_ns) for t in request.steps]
            kept = await asyncio.to_thread(self.plane.step_times.record, request.job_id, request.rank,
                                           request.node, samples)
            return jobs_pb2.ReportStepTimesResponse(accepted=kept)
        except ServiceError as err:
            await _abort(context, err)

    async def DeregisterJob(self, request, context):
        try:
            self._job_scope(context, request.job_id)
            await asyncio.to_thread(self.plane.jobs.deregister, request.job_id)
            return jobs_pb2.DeregisterJobResponse()
        except ServiceError as err:
            await _abort(context, err)

    async def WatchDirectives(self, request, context):
        job_id = request.job_id
        try:
            self._job_scope(context, job_id)
            self.plane.jobs.job(job_id)  # NOT_FOUND before the stream starts
        except ServiceError as err:
            await _abort(context, err)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=WATCH_QUEUE)
        resync = asyncio.Event()

        def put(d):
            try:
                queue.put_nowait(d)
            except asyncio.QueueFull:
                resync.set()
                queue.put_nowait(None) if not queue.full() else None

        def listener(d):  # called from whichever thread changed the directive
            loop.call_soon_threadsafe(put, d)

        token = self.plane.jobs.subscribe(job_id, listener)
        sent: dict[str, int] = {}
        try:
            snapshot = await asyncio.to_thread(self.plane.jobs.snapshot_for_watch, job_id)
            for d in snapshot:
                sent[d.directive_id] = d.state
                yield directive_to_proto(d)
            while True:
                if resync.is_set():
                    resync.clear()
                    while not queue.empty():
                        queue.get_nowait()
                    for d in await asyncio.to_thread(self.plane.jobs.list, job_id):
                        if sent.get(d.directive_id) != d.state:
                            sent[d.directive_id] = d.state
                            yield directive_to_proto(d)
                    continue
                try:
                    d = await asyncio.wait_for(queue.get(), timeout=5.0)
                except asyncio.TimeoutError:
                    if self.plane.jobs.store.find_job(job_id) is None:
                        return  # deregistered: nothing more will come
                    continue
                if d is None or sent.get(d.directive_id) == d.state:
                    continue
                # Watchers hear of new directives and of cancellations (proto: jobs.proto WatchDirectives);
                # progress acks change state too, and are sent so every rank sees the same view.
                sent[d.directive_id] = d.state
                yield directive_to_proto(d)
        except ServiceError as err:
            await _abort(context, err)
        finally:
            self.plane.jobs.unsubscribe(job_id, token)

    async def AckDirective(self, request, context):
        try:
            self._job_scope(context, request.job_id)
            d = await asyncio.to_thread(self.plane.jobs.ack, request.job_id, request.directive_id, request.rank,
                                        int(request.phase), request.reason, request.phase_seconds)
            return jobs_pb2.AckDirectiveResponse(state=int(d.state))
        except ServiceError as err:
            await _abort(context, err)

    async def CancelDirective(self, request, context):
        try:
            d = await asyncio.to_thread(self.plane.jobs.cancel, request.directive_id, request.reason)
            return jobs_pb2.CancelDirectiveResponse(state=int(d.state))
        except ServiceError as err:
            await _abort(context, err)

    async def ListDirectives(self, request, context):
        try:
            p = self._principal(context)
            if not request.job_id:
                if p is None or not p.is_operator:
                    raise PermissionDenied("listing every job's directives needs the operator role; give job_id")
                job_id = None
            else:
                self._job_scope(context, request.job_id)
                job_id = request.job_id
            ds = await asyncio.to_thread(self.plane.jobs.list, job_id)
            return jobs_pb2.ListDirectivesResponse(directives=[directive_to_proto(d) for d in ds])
        except ServiceError as err:
            await _abort(context, err)

    async def DrainNode(self, request, context):
        try:
            check_node("node", request.node)
            if len(request.reason) > 4096:
                raise InvalidArgument("reason is longer than 4096 characters")
            if not self.plane.jobs.jobs_on(request.node) and request.node not in self.plane.nodes.known_nodes():
                raise NotFound(f"node {request.node!r} hosts no registered job and has sent no telemetry")
            ds = await asyncio.to_thread(self.plane.policy.drain, request.node, request.reason, self.plane.clock())
            return jobs_pb2.DrainNodeResponse(directives=[directive_to_proto(d) for d in ds])
        except ServiceError as err:
            await _abort(context, err)


class RiskServicer(risk_pb2_grpc.RiskServicer):
    def __init__(self, plane):
        self.plane = plane

    def node_risk(self, r) -> common_pb2.NodeRisk:
        topo = self.plane.nodes.topo(r.node)
        scorer = self.plane.scorer
        return common_pb2.NodeRisk(
            node=r.node, probability=r.probability, horizon_seconds=int(scorer.horizon_seconds),
            model_version=scorer.model_version,
            signals=[common_pb2.Signal(name=s.name, value=s.value, contribution=s.contribution,
                                       description=s.description) for s in r.signals],
            scored_at=_ts(r.scored_at_ns), above_threshold=r.node in self.plane.policy.alarms,
            leaf_switch=topo.leaf_switch, site=topo.site)

    async def GetNodeRisk(self, request, context):
        try:
            check_node("node", request.node)
            r = self.plane.nodes.risk.get(request.node)
            if r is None:
                raise NotFound(f"node {request.node!r} has not been scored (unknown, or no telemetry yet)")
            return self.node_risk(r)
        except ServiceError as err:
            await _abort(context, err)

    async def ListRiskiest(self, request, context):
        try:
            limit = request.limit or 10
            if limit > 1000:
                raise InvalidArgument(f"limit {limit} is over 1000")
            if not math.isfinite(request.min_probability) or not 0 <= request.min_probability <= 1:
                raise InvalidArgument(f"min_probability {request.min_probability} must be in [0, 1]")
            nodes = self.plane.nodes.riskiest(limit, request.min_probability)
            return risk_pb2.ListRiskiestResponse(nodes=[self.node_risk(r) for r in nodes])
        except ServiceError as err:
            await _abort(context, err)

    async def WatchRisk(self, request, context):
        try:
            for n in request.nodes:
                check_node("nodes[]", n)
            if len(request.nodes) > 100_000:
                raise InvalidArgument("nodes lists more than 100000 names")
            if not math.isfinite(request.min_change) or not 0 <= request.min_change <= 1:
                raise InvalidArgument(f"min_change {request.min_change} must be in [0, 1]")
        except ServiceError as err:
            await _abort(context, err)
        wanted = set(request.nodes) or None
        min_change = request.min_change
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=RISK_WATCH_QUEUE)

        def put(round_):
            if queue.full():
                queue.get_nowait()  # a slow watcher skips rounds; the next one carries the latest values
            queue.put_nowait(round_)

        token = self.plane.scoring.subscribe(lambda risks: loop.call_soon_threadsafe(put, risks))
        last: dict[str, float] = {}
        try:
            while True:
                risks = await queue.get()
                for r in risks:
                    if wanted is not None and r.node not in wanted:
                        continue
                    prev = last.get(r.node)
                    if prev is not None and abs(r.probability - prev) < min_change:
                        continue
                    last[r.node] = r.probability
                    yield self.node_risk(r)
        finally:
            self.plane.scoring.unsubscribe(token)


def _urgent(batch) -> bool:
    """The batch carries events or topology: the scoring loop acts on it at once (ingest.py)."""
    return any(t.table in URGENT_TABLES for t in batch.tables)


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServicer):
    def __init__(self, plane):
        self.plane = plane

    async def StreamSweeps(self, request_iterator, context):
        # context.read()/write() rather than the iterator and a generator: two fewer coroutine hops a
        # batch, at thousands of batches a second.
        principal = self.plane.authenticator.principal(context)
        ingest = self.plane.ingest
        hold = self.plane.hold
        gate = self.plane.shard_gate
        stream_labels = shardmap.labels_from_metadata(context.invocation_metadata()) if gate is not None else None
        placed = None   # (node, its topology, the gate's map generation): admitted again when any changes
        session = ingest.open_session(context.peer(), principal.subject if principal else "")
        last = 0
        Ack, Rej = telemetry_pb2.SweepAck, telemetry_pb2.Rejection
        loop = asyncio.get_running_loop()
        # Batches read and not yet acknowledged: (sequence, the future of its events being acted on or
        # None, when it was read). Acks are cumulative, so one waits for every event batch before it;
        # reading goes on meanwhile, so later batches reach scoring on time.
        owed: collections.deque = collections.deque()
        rejections: list = []
        credits = 0

        def ackable() -> int | None:
            upto, now = None, time.monotonic()
            while owed:
                sequence, done, read_at = owed[0]
                if done is not None and not done.done():
                    if now - read_at < ACTED_ACK_SECONDS:
                        break
                    log.warning("batch %d of %s: no scoring round acted on its events in %.0f s; acknowledged "
                                "anyway", sequence, session.node, ACTED_ACK_SECONDS)
                owed.popleft()
                upto = sequence
            return upto

        def ack(upto: int, cr: int):
            out = Ack(acked_sequence=upto, credits=cr, schemas_kept=True)
            if rejections:
                out.rejections.extend(Rej(sequence=r.sequence, table=r.table, reason=r.reason, detail=r.detail)
                                      for r in rejections)
                rejections.clear()
            return out

        # Acks go out from this loop and, for a batch with events, from a task that waits for its round:
        # one writer at a time, and what is acknowledged is decided under the lock, so acks never go back.
        write_lock = asyncio.Lock()
        waiters: set = set()

        async def send_acks():
            async with write_lock:
                upto = ackable()
                if upto is not None:
                    await context.write(ack(upto, credits))

        async def when_acted(done):
            try:
                await asyncio.wait_for(asyncio.shield(done), ACTED_ACK_SECONDS)
            except asyncio.TimeoutError:
                pass
            await send_acks()

        try:
            while (batch := await context.read()) is not grpc.aio.EOF:
                if gate is not None and batch.node:
                    placed = await self._admit(context, gate, batch, stream_labels, placed)
                urgent = _urgent(batch)
                if hold.held and not urgent:
                    await hold.wait()   # a complete step is closing; events never wait (steps.CloseHold)
                if urgent:
                    done = loop.create_future()

                    def on_acted(done=done):   # from the scoring thread
                        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
                else:
                    done = on_acted = None
                result = ingest.accept(session, batch.node, batch.collector_id, batch.sequence,
                                       [(t.table, t.schema_version, t.arrow_ipc, t.schema_omitted)
                                        for t in batch.tables], batch.watermark_ns, on_acted)
                if result.delay_seconds:
                    await asyncio.sleep(result.delay_seconds)  # backpressure: hold the ack while overloaded
                last, credits = result.acked_sequence, result.credits
                rejections += result.rejections
                owed.append((last, done if result.acting else None, time.monotonic()))
                if result.acting:
                    waiter = asyncio.ensure_future(when_acted(done))
                    waiters.add(waiter)
                    waiter.add_done_callback(waiters.discard)
                await send_acks()
            if waiters:   # half-closed: the last event batches' rounds (each bounded), then their acks
                await asyncio.gather(*waiters, return_exceptions=True)
            # The collector half-closed: its last batches' value checks may still be due. Wait for them
            # (a bounded time; a round is woken for it) and send what they found in a last ack.
            if session.unchecked() > 0:
                self.plane.scoring.wake("flush")
                deadline = time.monotonic() + FINAL_ACK_SECONDS
                while session.unchecked() > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
            # A stream the collector broke (cancelled) hears nothing more: its verdicts stay owed, and
            # close_session hands them to the collector's live or next stream.
            final = [] if context.done() else ingest.final_rejections(session)
            if final:
                try:
                    await context.write(Ack(acked_sequence=last, credits=0, schemas_kept=True,
                                            rejections=[Rej(sequence=r.sequence, table=r.table, reason=r.reason,
                                                            detail=r.detail) for r in final]))
                except BaseException:
                    ingest.still_owed(session, final)
                    raise
        finally:
            for waiter in list(waiters):
                waiter.cancel()
            ingest.close_session(session)

    async def _admit(self, context, gate, batch, stream_labels, placed):
        """Refuse the stream (FAILED_PRECONDITION, before the batch is taken or acknowledged) unless
        this shard serves the batch's node; returns what it was admitted under (shardmap.ShardGate)."""
        node = batch.node
        inventory = next((t.arrow_ipc for t in batch.tables if t.table == "inventory" and not t.schema_omitted), None)
        labels = shardmap.labels_in_inventory(inventory, node) if inventory is not None else None
        topo = self.plane.nodes.topology.get(node)
        generation = gate.generation   # a map taken after this is judged on the next batch
        if labels is None:
            if placed == (node, topo, generation):
                return placed
            labels = shardmap.labels_of(topo) if topo is not None else stream_labels
        try:
            gate.admit(node, labels)
        except WrongShard as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err), trailing_metadata=(
                (shardmap.SHARD_KEY, err.shard), (shardmap.ADDRESS_KEY, err.address)))
        except ServiceError as err:
            await _abort(context, err)
        return node, topo, generation


def shard_events_from_proto(events) -> list:
    from foreshock.service.coordinator import EventKind, ShardEvent
    from foreshock.service.domain import SignalRecord
    from foreshock.service.nodes import Topology

    out = []
    for e in events:
        try:
            kind = EventKind(e.kind)
        except ValueError:
            raise InvalidArgument(f"event {e.sequence} (node {e.node!r}): kind {e.kind} is not a ShardEventKind") from None
        out.append(ShardEvent(
            e.sequence, kind, e.node, e.risk,
            tuple(SignalRecord(s.name, s.value, s.contribution, s.description) for s in e.signals),
            e.ts_ns, e.fatal_kind, e.description,
            Topology(site=e.site, leaf_switch=e.leaf_switch, nvlink_domain=e.nvlink_domain),
            e.unit, e.finding, e.raised))
    return out


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Coordinator.ForwardAlarms: each request's events applied (service/coordinator.py), then acked."""

    def __init__(self, plane):
        self.plane = plane

    async def ForwardAlarms(self, request_iterator, context):
        from foreshock.service.coordinator import check_step_totals
        from foreshock.service.steptimefeed import encode as encode_step_times
        principal = self.plane.authenticator.principal(context)
        shard = None
        try:
            async for request in request_iterator:
                if shard is None:
                    shard = request.shard
                    if principal is None or not principal.may_forward_for(shard):
                        raise PermissionDenied(f"credential for {principal.subject if principal else '?'!r} may "
                                               f"not forward for shard {shard!r}")
                elif request.shard != shard:
                    raise InvalidArgument(f"one stream forwards for one shard: {shard!r}, then {request.shard!r}")
                events = shard_events_from_proto(request.events)
                # checked before the events apply: a request with bad totals changes nothing
                totals = check_step_totals(shard, [(t.step, [(g.group, g.name, list(g.values)) for g in t.groups])
                                                   for t in request.totals])
                coordinator = self.plane.coordinator
                acked = await asyncio.to_thread(coordinator.receive, shard, request.epoch,
                                                request.model_version, events)
                coordinator.peer_totals.put(shard, totals)
                ack = coordinator_pb2.ForwardAck(epoch=request.epoch, acked_sequence=acked)
                sums = coordinator.peer_totals.others(shard)
                if sums is not None:
                    ack.peer_totals.step = sums[0]
                    ack.peer_totals.groups.extend(
                        coordinator_pb2.GroupTotals(group=g, name=name, values=row.tolist())
                        for g, rows in sorted(sums[1].items()) for name, row in sorted(rows.items()))
                rows, more = coordinator.step_times.take(shard)
                if rows is not None:
                    ack.step_times, ack.step_times_pending = encode_step_times(rows), more
                yield ack
        except ServiceError as err:
            await _abort(context, err)


class Refusing(grpc.GenericRpcHandler):
    """Every method of the named services (foreshock.v1 names: "Jobs", "Risk", "Coordinator") answered
    with one status and a message that says why and where to go: a coordinator's standby (UNAVAILABLE,
    clients retry), or the Jobs API of a shard that forwards to the coordinator (FAILED_PRECONDITION)."""

    MODULES = {"Jobs": jobs_pb2, "Risk": risk_pb2, "Coordinator": coordinator_pb2}

    def __init__(self, services, code: grpc.StatusCode, message):
        self.code = code
        self.message = message   # () -> str, read per call (who leads can change)
        self._kinds = {}
        for name in services:
            for m in self.MODULES[name].DESCRIPTOR.services_by_name[name].methods:
                self._kinds[f"/foreshock.v1.{name}/{m.name}"] = (m.client_streaming, m.server_streaming)

    def service(self, handler_call_details):
        kind = self._kinds.get(handler_call_details.method)
        if kind is None:
            return None
        method = handler_call_details.method

        async def refuse(context):
            await context.abort(self.code, f"{method}: {self.message()}")

        async def unary(request, context):
            await refuse(context)

        async def streaming(request, context):
            await refuse(context)
            yield b""   # never reached: makes this an async generator

        client_streaming, server_streaming = kind
        if server_streaming:
            factory = (grpc.stream_stream_rpc_method_handler if client_streaming
                       else grpc.unary_stream_rpc_method_handler)
            return factory(streaming)
        factory = grpc.stream_unary_rpc_method_handler if client_streaming else grpc.unary_unary_rpc_method_handler
        return factory(unary)


def standby_handler(holder) -> Refusing:
    """What a coordinator's standby answers to every Jobs, Risk and Coordinator call: UNAVAILABLE, saying
    that it is the standby and who leads (`holder()`: what the leader wrote in the lease file)."""
    return Refusing(("Jobs", "Risk", "Coordinator"), grpc.StatusCode.UNAVAILABLE,
                    lambda: f"this coordinator is the standby; the leader holds the lease "
                            f"({holder() or 'holder unknown'}): retry, or call the other coordinator")


def shard_jobs_handler(shard: str, coordinators: str) -> Refusing:
    """The Jobs API of a shard that forwards its alarms: the coordinator's, not this instance's."""
    return Refusing(("Jobs",), grpc.StatusCode.FAILED_PRECONDITION,
                    lambda: f"this is shard {shard}, which forwards its alarms to the jobs coordinator; "
                            f"jobs register and watch directives there ({coordinators})")
