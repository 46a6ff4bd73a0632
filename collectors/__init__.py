"""Node collectors: sources that read a GPU node's fabric signals into schema-v1 tables, and the service.

Sources (one module each, registered by name in `registry`): `nvml`, `rdma`, `netdev`, `host_net`,
`kmsg`, `simulated`. `Collector` (collector.py) sweeps them into a DatasetWriter; `command` is
`foreshock collect`. See docs/collectors.md. Names here load lazily, so `foreshock --help` stays fast.
"""

import importlib

_EXPORTS = {
    "Collector": "collector", "Snapshot": "collector",
    "SOURCES": "registry", "DEFAULT_SOURCES": "registry", "SourceConfig": "registry",
    "build_sources": "registry",
    "NodeModel": "simulated", "SimpleNodeModel": "simulated", "SimulatedSource": "simulated",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
