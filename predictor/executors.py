"""Where the per-node work of offline feature building runs: in this process, a local process pool,
or a Ray cluster. One seam, `Executor.map`, that offline.FeatureBuilder calls for both of its passes.

Every executor returns the results in the order of the work items and keeps at most `in_flight`
items submitted ahead of the one the caller waits for, so memory is bounded by that many node
partitions whatever the cluster's size. The work functions are plain module-level functions of
offline.py with picklable arguments: the dataset as a dataset.DatasetRoot (its pyarrow filesystem
pickled with the path, so a worker reads a URI's storage itself) and the feature cache by path, so on
a Ray cluster of several machines the cache directory must be on a filesystem every worker mounts
(docs/scaling.md). The results are the same on every executor: the functions are the same and
the parent reduces their results in node order (tests/test_predictor_executors.py checks it bit for
bit on a local Ray cluster).

    executor = make_executor("ray", workers=2, ray_address="10.0.0.5:6379")
    for result in executor.map(fn, [(args...), ...], labels=["node-001", ...]):
        ...
    executor.close()

A work item that fails is retried (Ray: `max_retries` times, a worker that dies included); one that
keeps failing stops the map with `WorkError`, which names the item's label (the node partition); an
executor that cannot start raises `ExecutorError`.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor

log = logging.getLogger(__name__)

KINDS = ("local", "ray")
RAY_CONNECT_TIMEOUT_S = 10.0
RAY_MAX_RETRIES = 2
RAY_MAX_RETRIES_RANGE = (0, 10)


class ExecutorError(RuntimeError):
    """An executor cannot start: Ray missing, a Ray address that does not answer."""


class WorkError(RuntimeError):
    """A work item failed for good; `label` names it (a node partition)."""

    def __init__(self, label: str, cause: BaseException | str):
        super().__init__(f"{label}: {cause}")
        self.label = label


class Executor:
    """map(fn, argses, labels) -> fn(*args) for each, in order; close() releases the workers. An item
    that fails for good raises WorkError, or with keep_going=True is yielded as one in its place."""

    in_flight: int = 1

    def map(self, fn: Callable, argses: Iterable[tuple], labels: Sequence[str] | None = None, *,
            keep_going: bool = False) -> Iterator:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SerialExecutor(Executor):
    """In this process, one item at a time (small datasets, tests)."""

    def map(self, fn, argses, labels=None, *, keep_going=False):
        for k, args in enumerate(argses):
            try:
                result = fn(*args)
            except Exception as exc:
                error = WorkError(_label(labels, k), _cause(exc))
                if not keep_going:
                    raise error from exc
                result = error
            yield result


class ProcessExecutor(Executor):
    """A pool of `workers` spawned processes on this machine, at most 2 items per worker ahead."""

    def __init__(self, workers: int):
        self.workers = max(1, int(workers))
        self.in_flight = 2 * self.workers
        self._pool: ProcessPoolExecutor | None = None

    def map(self, fn, argses, labels=None, *, keep_going=False):
        if self._pool is None:
            # spawn: a fresh interpreter, not a fork of a parent that holds threads and large arrays
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=exit_with_parent, initargs=(os.getpid(),))
        yield from _ordered(lambda args: self._pool.submit(fn, *args), lambda fut: fut.result(),
                            argses, labels, self.in_flight, keep_going)

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def exit_with_parent(parent_pid: int) -> None:
    """A pool worker's initializer: the kernel sends the worker SIGTERM when the thread that started it
    ends (prctl PR_SET_PDEATHSIG, Linux; elsewhere nothing), so a `foreshock train` killed by a batch
    system's time limit or the OOM killer, which runs no cleanup, leaves no worker behind holding a node
    partition's memory. ProcessExecutor.map starts its workers on the caller's thread: use one executor
    from the thread that lives as long as it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:   # the parent died before the signal was asked for
        os._exit(1)


class RayExecutor(Executor):
    """Ray tasks on the cluster at `address` (None: a local Ray instance of `workers` CPUs, started
    here and stopped by close()). Each task takes one CPU; `max_retries` retries a failed task,
    exceptions included (a node partition that cannot be read fails every time and is then named)."""

    def __init__(self, workers: int, address: str | None = None, *, max_retries: int = RAY_MAX_RETRIES,
                 connect_timeout_s: float = RAY_CONNECT_TIMEOUT_S):
        lo, hi = RAY_MAX_RETRIES_RANGE
        if not lo <= int(max_retries) <= hi:
            raise ExecutorError(f"ray max_retries {max_retries} is outside [{lo}, {hi}]")
        try:
            import ray
        except ImportError as exc:
            raise ExecutorError("--executor ray needs Ray: pip install 'foreshock[ray]'") from exc
        self._ray = ray
        self.workers = max(1, int(workers))
        self.max_retries = int(max_retries)
        self._started_here = False
        if address:
            _check_answers(address, connect_timeout_s)
        if ray.is_initialized() and address and ray.get_runtime_context().gcs_address != address:
            ray.shutdown()   # this process is joined to another cluster (a test, a notebook)
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=self.workers, include_dashboard=False, log_to_driver=False)
                self._started_here = True
        cpus = int(ray.cluster_resources().get("CPU", self.workers))
        self.in_flight = 2 * max(1, cpus)
        self._remote: dict[Callable, object] = {}

    def map(self, fn, argses, labels=None, *, keep_going=False):
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(num_cpus=1, max_retries=self.max_retries,
                                                         retry_exceptions=True)(fn)
        yield from _ordered(lambda args: remote.remote(*args), self._ray.get, argses, labels, self.in_flight,
                            keep_going)

    def close(self):
        if self._started_here and self._ray.is_initialized():
            self._ray.shutdown()
        self._started_here = False


def make_executor(kind: str, workers: int, ray_address: str | None = None) -> Executor:
    """The executor for `kind` ("local": serial for one worker, else a process pool; "ray")."""
    if kind == "local":
        return SerialExecutor() if workers <= 1 else ProcessExecutor(workers)
    if kind == "ray":
        return RayExecutor(workers, ray_address or None)
    raise ExecutorError(f"executor {kind!r} is not one of {', '.join(KINDS)}")


def _ordered(submit, wait, argses, labels, in_flight: int, keep_going: bool) -> Iterator:
    pending: collections.deque = collections.deque()
    it = enumerate(argses)
    for k, args in it:
        pending.append((k, submit(args)))
        if len(pending) >= in_flight:
            break
    while pending:
        k, handle = pending.popleft()
        try:
            result = wait(handle)
        except Exception as exc:
            error = WorkError(_label(labels, k), _cause(exc))
            if not keep_going:
                for _, other in pending:
                    _cancel(other)
                raise error from exc
            result = error
        nxt = next(it, None)
        if nxt is not None:
            pending.append((nxt[0], submit(nxt[1])))
        yield result


def _cancel(handle) -> None:
    cancel = getattr(handle, "cancel", None)
    if cancel is not None:
        cancel()


def _cause(exc: BaseException) -> str:
    # a Ray task error carries the worker's exception; say that one, not Ray's wrapper
    inner = getattr(exc, "cause", None)
    if isinstance(inner, BaseException):
        exc = inner
    return f"{type(exc).__name__}: {exc}"


def _label(labels, k: int) -> str:
    return labels[k] if labels is not None and k < len(labels) else f"work item {k}"


def _check_answers(address: str, timeout_s: float) -> None:
    """Refuse, within `timeout_s`, a Ray address (HOST:PORT of the head's GCS) that does not answer."""
    host, _, port = address.rpartition(":")
    if address.startswith("ray://") or not host or not port.isdigit():
        raise ExecutorError(f"--ray-address {address!r}: expected HOST:PORT of the Ray head (its GCS port, 6379 "
                         "by default)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ExecutorError(f"the Ray cluster at {address} does not answer within {timeout_s:g} s: {exc}") from None
