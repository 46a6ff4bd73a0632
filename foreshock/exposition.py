"""The registry every Foreshock /metrics endpoint starts from, with the series any Prometheus client exports.

process_* (CPU, resident memory, open file descriptors, start time), python_info and python_gc_* are
what prometheus-client's default registry carries. Foreshock serves private registries instead (tests
read them directly, and two services in one process never share one), so each gets the same three
collectors here: the process dashboards and alerts written for any Prometheus client then work on the
collector and the control plane unchanged.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector


def new_registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
