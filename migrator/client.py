"""The job's gRPC client of the control plane's Jobs API (proto/foreshock/v1/jobs.proto).

Two background threads, so the training loop never waits on the network: a watcher holds the
WatchDirectives stream (re-opened every `watch_window_s` and after any error, with exponential backoff
and jitter; the service re-delivers unacknowledged directives after a reconnect, and DirectiveBook
drops the duplicates; `service` may list several addresses, a jobs coordinator and its standby, and
every call moves to the next one when the one it used answers UNAVAILABLE), and a sender drains a bounded queue of acknowledgements and step reports. The
sender also sends this rank's step times (`record_step_time`, kept in a ring of `STEP_TIME_BUFFER`) in
blocks of steps aligned on step numbers (`step_block`), so that every rank of a job sends the same
steps at about the same time and the service judges each step with all of them; at least every
2 x `step_report_interval_s` when steps stall, one ReportStepTimes call each. A batch the service does
not take (unreachable, refused) is dropped and counted (`dropped_step_times`), never retried: the
fail-slow rule wants recent steps, not old ones late. Every unary call has a deadline
(`rpc_timeout_s`). Nothing here raises into the caller: service trouble is logged (once per outage)
and degrades to "no directives". Credentials: a bearer token in the `authorization` metadata; TLS when
a CA file is given, plaintext only to a loopback address.
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
import time

import grpc

from foreshock.migrator.config import MigratorConfig, MigratorConfigError
from foreshock.migrator.directives import Ack, AckPhase, Directive, DirectiveKind, drain
from foreshock.net import Endpoint, PlaintextRefused, client_credentials
from foreshock.v1 import jobs_pb2, jobs_pb2_grpc

log = logging.getLogger("foreshock.migrator.client")

_KIND_FROM_PROTO = {
    jobs_pb2.DIRECTIVE_KIND_EVACUATE: DirectiveKind.EVACUATE,
    jobs_pb2.DIRECTIVE_KIND_SHRINK: DirectiveKind.SHRINK,
    jobs_pb2.DIRECTIVE_KIND_CHECKPOINT_EXIT: DirectiveKind.CHECKPOINT_EXIT,
}
_PHASE_TO_PROTO = {
    AckPhase.ACCEPTED: jobs_pb2.ACK_PHASE_ACCEPTED,
    AckPhase.STATE_TRANSFERRED: jobs_pb2.ACK_PHASE_STATE_TRANSFERRED,
    AckPhase.COMPLETED: jobs_pb2.ACK_PHASE_COMPLETED,
    AckPhase.FAILED: jobs_pb2.ACK_PHASE_FAILED,
}
_FALLBACK_TO_PROTO = {
    "shrink": jobs_pb2.FALLBACK_POLICY_SHRINK,
    "checkpoint_exit": jobs_pb2.FALLBACK_POLICY_CHECKPOINT_EXIT,
}
_FINISHED = {jobs_pb2.DIRECTIVE_STATE_CANCELLED, jobs_pb2.DIRECTIVE_STATE_COMPLETED,
             jobs_pb2.DIRECTIVE_STATE_FAILED}
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL}
STEP_TIME_BATCH = 256     # step times per ReportStepTimes (the service takes up to 1,024); a power of two
STEP_TIME_BUFFER = 1024   # step times waiting to be sent; when full, the oldest is dropped and counted


def step_block(step_seconds: float, interval_s: float) -> int:
    """How many steps a rank sends at once: the largest power of two that lasts at most `interval_s`
    (1 to STEP_TIME_BATCH). It depends on the whole step, which is the same on every rank of a
    synchronous job, so all its ranks cut the same blocks."""
    n = 1
    while n < STEP_TIME_BATCH and 2 * n * step_seconds <= interval_s:
        n *= 2
    return n


def directive_from_proto(msg: jobs_pb2.Directive) -> Directive | None:
    """The domain directive, or None (logged) for one this client cannot act on."""
    kind = _KIND_FROM_PROTO.get(msg.kind)
    # a cancelled, completed or failed directive is no longer actionable: it withdraws a pending one
    cancelled = msg.state in _FINISHED
    if kind is None and not cancelled:
        log.warning("directive %s has unknown kind %d; ignored", msg.directive_id, msg.kind)
        return None
    if not msg.directive_id:
        log.warning("directive without an id ignored: %s", msg)
        return None
    deadline = msg.deadline.ToSeconds() + msg.deadline.nanos / 1e9 if msg.HasField("deadline") else None
    return Directive(directive_id=msg.directive_id, kind=kind or DirectiveKind.EVACUATE,
                     ranks=tuple(msg.ranks), from_node=msg.from_node, to_node=msg.to_node,
                     at_step=msg.at_step, reason=msg.reason, cancelled=cancelled,
                     generation=msg.generation, deadline=deadline)


def endpoints(config: MigratorConfig) -> list[Endpoint]:
    """The control plane as the job reaches it, one Endpoint per address it lists: TLS when a CA file is
    given, its bearer token."""
    options = (("grpc.keepalive_time_ms", 10_000), ("grpc.max_receive_message_length", 4 << 20))
    credentials = client_credentials(config.tls_ca)
    out = []
    for address in config.services or (config.service,):
        try:
            out.append(Endpoint(address, credentials, options, config.token or None))
        except PlaintextRefused:
            raise MigratorConfigError(f"service {address}: plaintext is allowed to loopback only; "
                                      "set FORESHOCK_TLS_CA for a remote control plane") from None
    return out


def endpoint(config: MigratorConfig) -> Endpoint:
    return endpoints(config)[0]


def open_channel(config: MigratorConfig) -> grpc.Channel:
    return endpoint(config).open()


class ServiceClient:
    """DirectiveSource backed by the control plane. Construct, then `register()` / `watch(rank)`."""

    def __init__(self, config: MigratorConfig, *, watch_window_s: float = 30.0,
                 backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0, queue_size: int = 1024) -> None:
        self.config = config
        reaches = endpoints(config)
        # One channel per address; calls go to one of them until it answers UNAVAILABLE (a coordinator's
        # standby, or the leader gone), then to the next (_fail_over).
        self._channels = [reach.open() for reach in reaches]
        self._stubs = [jobs_pb2_grpc.JobsStub(channel) for channel in self._channels]
        self._current = 0
        self._metadata = reaches[0].metadata
        self._timeout = config.rpc_timeout_s
        self._watch_window = watch_window_s
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._inbox: queue.Queue[Directive] = queue.Queue(maxsize=queue_size)
        self._outbox: queue.Queue[Ack | tuple | None] = queue.Queue(maxsize=queue_size)
        self._step: tuple[int, float] | None = None
        self._step_lock = threading.Lock()
        self._stop = threading.Event()
        self._watch_rank: int | None = None
        self._watch_call = None
        self._watch_lock = threading.Lock()
        self._watch_thread: threading.Thread | None = None
        self._sender = threading.Thread(target=self._send_loop, name="foreshock-acks", daemon=True)
        self._sender.start()
        self.healthy = False            # last call to the service succeeded
        self.deliveries = 0
        self.dropped_acks = 0
        # (rank, node, step, step_seconds, compute_seconds, end_ns); appended by the loop, taken by the sender
        self._step_times: collections.deque = collections.deque(maxlen=STEP_TIME_BUFFER)
        self._step_times_lock = threading.Lock()
        self._step_times_due = threading.Event()   # a block of steps is complete
        self.sent_step_times = 0
        self.dropped_step_times = 0

    # --- calls made before or after training (bounded by deadlines, never raise) -------------
    def register(self, placement: dict[int, str], spare_nodes=(), *, current_step: int = 0,
                 fallback: str = "shrink", max_concurrent: int = 0) -> int | None:
        req = jobs_pb2.RegisterJobRequest(
            job_id=self.config.job_id,
            ranks=[jobs_pb2.RankPlacement(rank=r, node=n) for r, n in sorted(placement.items())],
            spare_nodes=list(spare_nodes), max_concurrent_evacuations=max_concurrent,
            fallback=_FALLBACK_TO_PROTO[fallback], current_step=current_step)
        resp = self._call("RegisterJob", req)
        return None if resp is None else resp.generation

    def deregister(self) -> None:
        self._call("DeregisterJob", jobs_pb2.DeregisterJobRequest(job_id=self.config.job_id))

    @property
    def _stub(self) -> jobs_pb2_grpc.JobsStub:
        return self._stubs[self._current % len(self._stubs)]

    def _fail_over(self, code) -> None:
        """After UNAVAILABLE, the next address the service lists (if it lists several)."""
        if code == grpc.StatusCode.UNAVAILABLE and len(self._stubs) > 1:
            self._current += 1
            log.info("control plane: trying %s", self.config.services[self._current % len(self._stubs)])

    def _call(self, name: str, request):
        try:
            resp = getattr(self._stub, name)(request, timeout=self._timeout, metadata=self._metadata)
            self._set_health(True)
            return resp
        except grpc.RpcError as exc:
            self._set_health(False, f"{name}: {exc.code().name} {exc.details()}")
            self._fail_over(exc.code())
            return None
        except Exception as exc:  # noqa: BLE001 - never raise into the training loop
            self._set_health(False, f"{name}: {exc!r}")
            return None

    def _set_health(self, ok: bool, why: str = "") -> None:
        if ok and not self.healthy:
            log.info("control plane %s answers", self.config.service)
        elif not ok and self.healthy:
            # unreachable or only slow (DEADLINE_EXCEEDED): `why` says which
            log.warning("control plane %s did not answer (%s); the job goes on, and the calls and the "
                        "directive watch keep trying", self.config.service, why)
        elif not ok:
            log.debug("control plane call failed: %s", why)
        self.healthy = ok

    # --- DirectiveSource -------------------------------------------------------------------
    def watch(self, rank: int) -> None:
        """Watch this rank's directive stream from now on (re-targets an existing watch)."""
        with self._watch_lock:
            self._watch_rank = rank
            if self._watch_call is not None:
                self._watch_call.cancel()
            if self._watch_thread is None:
                self._watch_thread = threading.Thread(target=self._watch_loop, name="foreshock-watch",
                                                      daemon=True)
                self._watch_thread.start()

    def poll(self) -> list[Directive]:
        return drain(self._inbox)

    def ack(self, ack: Ack) -> None:
        try:
            self._outbox.put_nowait(ack)
        except queue.Full:
            self.dropped_acks += 1
            log.warning("ack queue full; dropped %s %s", ack.directive_id, ack.phase.value)

    def register_later(self, placement: dict[int, str], spare_nodes=(), *, current_step: int = 0,
                       fallback: str = "shrink") -> None:
        """Queue a re-registration behind the acknowledgements already queued (after a shrink the
        ranks are renumbered, and the service must see that after the COMPLETED ack)."""
        item = ("register", dict(placement), tuple(spare_nodes), current_step, fallback)
        try:
            self._outbox.put_nowait(item)
        except queue.Full:
            log.warning("queue full; re-registration of job %s dropped", self.config.job_id)

    def report_step(self, step: int, step_seconds: float) -> None:
        with self._step_lock:
            self._step = (step, step_seconds)

    def record_step_time(self, rank: int, step: int, step_seconds: float, compute_seconds: float = 0.0,
                         end_ns: int | None = None) -> None:
        """One step of this rank (O(1), never blocks, never raises): sent in the next batch. `end_ns`:
        when the step ended, by the wall clock (Unix ns); None: now, for a caller that records each step
        as it ends."""
        if end_ns is None:
            end_ns = time.time_ns()
        with self._step_times_lock:
            if len(self._step_times) == self._step_times.maxlen:
                self.dropped_step_times += 1
            self._step_times.append((rank, self.config.node, step, step_seconds, compute_seconds, end_ns))
        if (step + 1) % step_block(step_seconds, self.config.step_report_interval_s) == 0:
            self._step_times_due.set()

    def close(self, deregister: bool = False, flush_s: float = 2.0) -> None:
        end = time.monotonic() + flush_s
        while not self._outbox.empty() and time.monotonic() < end:
            time.sleep(0.01)
        if deregister:
            self.deregister()
        self._stop.set()
        with self._watch_lock:
            if self._watch_call is not None:
                self._watch_call.cancel()
        try:
            self._outbox.put_nowait(None)
        except queue.Full:
            pass
        for thread in (self._watch_thread, self._sender):
            if thread is not None:
                thread.join(timeout=2.0)
        for channel in self._channels:
            channel.close()

    # --- background threads ----------------------------------------------------------------
    def _sleep_backoff(self, attempt: int) -> None:
        initial, cap = self._backoff
        delay = min(cap, initial * (2 ** min(attempt, 16)))
        self._stop.wait(delay * random.uniform(0.5, 1.0))

    def _watch_loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            with self._watch_lock:
                rank = self._watch_rank
                req = jobs_pb2.WatchDirectivesRequest(job_id=self.config.job_id, rank=rank)
                call = self._stub.WatchDirectives(req, timeout=self._watch_window, metadata=self._metadata)
                self._watch_call = call
            try:
                for msg in call:
                    self._set_health(True)
                    failures = 0
                    directive = directive_from_proto(msg)
                    if directive is None:
                        continue
                    self.deliveries += 1
                    try:
                        self._inbox.put_nowait(directive)
                    except queue.Full:
                        log.warning("directive inbox full; %s will come again after a reconnect",
                                    directive.directive_id)
                failures = 0    # the window ended normally
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.CANCELLED or (code == grpc.StatusCode.DEADLINE_EXCEEDED
                                                         and self.healthy):
                    continue        # re-targeted, closed, or the watch window ended: reconnect at once
                self._set_health(False, f"WatchDirectives: {code.name} {exc.details()}")
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                    log.warning("WatchDirectives refused for job %s rank %s: %s %s (retrying)",
                                self.config.job_id, rank, code.name, exc.details())
                failures += 1
                self._fail_over(code)
                self._sleep_backoff(failures)
            except Exception as exc:  # noqa: BLE001
                self._set_health(False, f"WatchDirectives: {exc!r}")
                failures += 1
                self._sleep_backoff(failures)

    def _send_step_times(self) -> None:
        """Everything waiting, STEP_TIME_BATCH at a time (more than one batch only after a stall)."""
        self._step_times_due.clear()
        while True:
            with self._step_times_lock:
                batch = [self._step_times.popleft() for _ in range(min(STEP_TIME_BATCH, len(self._step_times)))]
            if batch:
                self._send_batch(batch)
            if len(batch) < STEP_TIME_BATCH:
                return

    def _send_batch(self, batch: list[tuple]) -> None:
        by_rank: dict[tuple[int, str], list] = {}
        for rank, node, step, total, compute, end_ns in batch:   # one rank, except across a renumbering
            by_rank.setdefault((rank, node), []).append(
                jobs_pb2.StepTime(step=step, step_seconds=total, compute_seconds=compute, end_ns=end_ns))
        for (rank, node), steps in by_rank.items():
            req = jobs_pb2.ReportStepTimesRequest(job_id=self.config.job_id, rank=rank, node=node, steps=steps)
            try:
                self._stub.ReportStepTimes(req, timeout=self._timeout, metadata=self._metadata)
                self._set_health(True)
                self.sent_step_times += len(steps)
            except grpc.RpcError as exc:
                self.dropped_step_times += len(steps)
                self._fail_over(exc.code())
                if exc.code() in _RETRYABLE:
                    self._set_health(False, f"ReportStepTimes: {exc.code().name} {exc.details()}")
                else:   # refused (a move the service has not applied yet, bad values): said, not retried
                    log.debug("step times of rank %d refused: %s %s", rank, exc.code().name, exc.details())
            except Exception as exc:  # noqa: BLE001 - never raise into the training loop
                self.dropped_step_times += len(steps)
                self._set_health(False, f"ReportStepTimes: {exc!r}")

    def _send_loop(self) -> None:
        last_report = 0.0
        last_sent: tuple[int, float] | None = None
        last_times = time.monotonic()
        while True:
            try:
                item = self._outbox.get(timeout=0.2)
            except queue.Empty:
                item = ...
            if item is None:
                self._send_step_times()
                return
            stalled = time.monotonic() - last_times >= 2 * self.config.step_report_interval_s
            if self._step_times_due.is_set() or stalled:
                last_times = time.monotonic()
                self._send_step_times()
            if isinstance(item, Ack):
                self._send_ack(item)
            elif isinstance(item, tuple) and item[0] == "register":
                _, placement, spares, step, fallback = item
                if self.register(placement, spares, current_step=step, fallback=fallback) is None:
                    log.warning("re-registration of job %s failed; the service keeps the old placement",
                                self.config.job_id)
            with self._step_lock:
                pending, self._step = self._step, None
            due = time.monotonic() - last_report >= self.config.report_interval_s
            if pending is None and due and last_sent is not None:
                # No step since the last report (a checkpoint, a stall, a held job): say so again. The
                # service extrapolates the step from its last report's time and step time, and would
                # otherwise schedule a switch hundreds of steps past where the job really is.
                pending = last_sent
            if pending is not None:
                if due:
                    last_report = time.monotonic()
                    last_sent = pending
                    self._call("ReportStep", jobs_pb2.ReportStepRequest(
                        job_id=self.config.job_id, step=pending[0], step_seconds=pending[1]))
                else:
                    with self._step_lock:
                        if self._step is None:
                            self._step = pending
            if self._stop.is_set() and self._outbox.empty():
                self._send_step_times()
                return

    def _send_ack(self, ack: Ack, attempts: int = 5) -> None:
        req = jobs_pb2.AckDirectiveRequest(
            job_id=self.config.job_id, directive_id=ack.directive_id, rank=max(ack.rank, 0),
            phase=_PHASE_TO_PROTO[ack.phase], reason=ack.reason, phase_seconds=ack.phase_seconds)
        for attempt in range(attempts):
            try:
                self._stub.AckDirective(req, timeout=self._timeout, metadata=self._metadata)
                self._set_health(True)
                return
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:
                    log.warning("ack %s %s refused: %s %s", ack.directive_id, ack.phase.value,
                                exc.code().name, exc.details())
                    return
                self._set_health(False, f"AckDirective: {exc.code().name}")
                self._fail_over(exc.code())
            except Exception as exc:  # noqa: BLE001
                self._set_health(False, f"AckDirective: {exc!r}")
            if self._stop.is_set():
                break
            self._sleep_backoff(attempt)
        self.dropped_acks += 1
        log.warning("ack %s %s not delivered after %d attempts", ack.directive_id, ack.phase.value, attempts)
