"""Process tuning for the service's own processes (`foreshock serve` and its scoring worker): the
cyclic garbage collector, glibc's allocator and the GIL's switch interval, each with the measurement
that made it worth doing. Called by the process's entry point (service/command.py, service/worker.py,
the service benchmark), never by ControlPlane.start(): tests and the demo embed the service in a
process of their own, whose settings are not the service's to change.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def tune_gc() -> None:
    """For a process that is the service (`foreshock serve`), once it has started: what is alive then
    (imports, the model, the gRPC server) is moved out of the cyclic collector's sight, and collections
    run every 50,000 allocations instead of 700. Each telemetry message allocates dozens of objects
    (protobuf, futures, acks), almost none in cycles; at 2,048 nodes a second the default thresholds ran
    several collections a second over everything the service holds. Not done by start(): tests and the
    demo embed the service in their own process."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def tune_malloc() -> None:
    """For the service and its scoring worker: glibc's fast bins off (mallopt M_MXFAST = 0). A drain
    frees hundreds of thousands of small blocks (Arrow and numpy buffers), and with fast bins the next
    large allocation merges them all first: measured 150-190 ms stalls inside a 15 ms scoring round,
    at a random numpy call. Without them freed blocks merge as they are freed, at no cost measured
    here. Nothing happens where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    M_MXFAST = 1
    if mallopt(M_MXFAST, 0) != 1:
        log.debug("mallopt(M_MXFAST, 0) refused")


def tune_threads() -> None:
    """For the service process: the GIL changes hands after 1 ms instead of 5. Its scoring thread hands
    the GIL to the event loop at every socket, SQLite or queue call of a closing round, and while the
    loop is busy with telemetry each hand-back waits up to a whole switch interval (measured at 2,048
    nodes, three step closes a run: crossing to directive p99 405 and 560 ms at 5 ms, 304 and 431 ms
    at 1 ms: a small gain inside the runs' spread, at no CPU cost measured)."""
    import sys

    sys.setswitchinterval(0.001)
