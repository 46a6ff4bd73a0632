"""foreshock.migrator: the in-job library that moves ranks off an at-risk node to a warm spare.

Public API (docs/migrator.md): MigratorConfig (arguments or FORESHOCK_* environment variables),
Migrator (the PyTorch integration: start, end_step, guard, close), WorldChange (what end_step tells the
loop), init_process_group (the script's own group; a no-op on a spare), Directive / DirectiveKind /
AckPhase (the domain types), DirectiveSource with ServiceClient (the control plane over gRPC),
LocalDirectiveSource and StoreDirectiveSource (no control plane). FSDP2 state: foreshock.migrator.sharded;
gloo and NCCL differ only in foreshock.migrator.backends.
torch is imported only when a torch-side name (Migrator, WorldChange, StoreDirectiveSource) is used,
so the core client works without the optional extra.
"""

from foreshock.migrator.config import MigratorConfig, MigratorConfigError
from foreshock.migrator.directives import (Ack, AckPhase, Directive, DirectiveBook, DirectiveKind,
                                           DirectiveSource, LocalDirectiveSource)

_TORCH_NAMES = {"Migrator", "WorldChange", "StoreDirectiveSource", "publish_directive", "init_process_group"}

__all__ = ["MigratorConfig", "MigratorConfigError", "Ack", "AckPhase", "Directive", "DirectiveBook",
           "DirectiveKind", "DirectiveSource", "LocalDirectiveSource", "ServiceClient", *sorted(_TORCH_NAMES)]


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        from foreshock.migrator import world
        return getattr(world, name)
    if name == "ServiceClient":
        from foreshock.migrator.client import ServiceClient
        return ServiceClient
    raise AttributeError(f"module 'foreshock.migrator' has no attribute {name!r}")
