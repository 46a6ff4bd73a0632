"""Sharded training state (FSDP2, `torch.distributed.fsdp.fully_shard`) as one rank's plain tensors.

With FSDP2 no rank holds a replica: each rank owns a shard of every parameter (a DTensor whose local
tensor is that rank's rows) and the matching shard of the optimizer's state. When a rank moves, it
sends these local tensors itself, keyed by the parameter's fully qualified name the way
torch.distributed.checkpoint lays out a state dict (`{"model": {fqn: tensor}, "optimizer": {"state":
{fqn: {name: tensor}}, "param_groups": [{..., "params": [fqn, ...]}]}}`), so the message carries no
object references and no pickle (the tensors travel through foreshock.migrator.transfer).

A new world needs a new DeviceMesh, and FSDP2 cannot be pointed at another one, so the job gives the
migrator a `reshard(mesh)` callable that builds the module and applies fully_shard on that mesh (on
the meta device and `to_empty()` is cheapest: every value is overwritten). `apply_local` then copies
the local shards into the new module's parameters and re-binds the job's own optimizer object to
them (its state becomes DTensors on the new mesh), so an LR scheduler holding that optimizer stays
valid. The shard layout depends only on (rank, world size), which a swap keeps.
"""

from __future__ import annotations

import collections
from typing import Any

import torch


class UnsupportedMeshError(ValueError):
    """A sharded model whose layout the migrator cannot move (named: the parameter and its mesh)."""


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether the module's parameters are DTensors (FSDP2 or another DTensor layout)."""
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in module.parameters())


def check_layout(module: torch.nn.Module) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """The module's mesh (shape, dimension names), if the migrator understands its layout: FSDP2 on a
    1-D mesh (Shard(0)) or HSDP on a 2-D mesh (Replicate(), Shard(0)), every parameter on the same
    mesh. Anything else (tensor parallelism's placements, a mixed layout) raises UnsupportedMeshError."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    known = {1: (Shard(0),), 2: (Replicate(), Shard(0))}
    spec = None
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            raise UnsupportedMeshError(f"parameter {name} is not sharded (a plain tensor beside "
                                       "DTensors): a mixed layout cannot be moved rank by rank")
        if known.get(p.device_mesh.ndim) != tuple(p.placements):
            raise UnsupportedMeshError(
                f"parameter {name} is laid out as {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh "
                f"{tuple(p.device_mesh.shape)}; the migrator moves FSDP2 shards on a 1-D mesh (Shard(0)) "
                "and HSDP's on a 2-D mesh (Replicate(), Shard(0)) only")
        this = (tuple(p.device_mesh.shape), p.device_mesh.mesh_dim_names)
        if spec is not None and this != spec:
            raise UnsupportedMeshError(f"parameter {name} is on mesh {this}, others on {spec}")
        spec = this
    return spec


def replicas(shape: tuple[int, ...], rank: int) -> list[int]:
    """The other ranks that hold the same shards as `rank` (HSDP: the same column of the row-major
    (replicate, shard) mesh that init_device_mesh lays out); none for FSDP2's 1-D mesh."""
    if len(shape) != 2:
        return []
    groups, width = shape
    return [g * width + rank % width for g in range(groups) if g * width + rank % width != rank]


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def local_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """This rank's shards of the parameters and of the optimizer state, keyed by parameter name."""
    names = {id(p): n for n, p in module.named_parameters()}
    state: dict[str, Any] = {"model": {n: _local(p.detach()) for n, p in module.named_parameters()}}
    if optimizer is not None:
        groups = []
        for g in optimizer.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [names[id(p)] for p in g["params"]]})
        per_param = {names[id(p)]: {k: _local(v) for k, v in s.items()} for p, s in optimizer.state.items()}
        state["optimizer"] = {"state": per_param, "param_groups": groups}
    return state


def apply_local(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict) -> None:
    """Copy a rank's shards (from local_state) into `module`, already sharded on the current mesh, and
    re-bind `optimizer` to its parameters with the given state."""
    from torch.distributed.tensor import DTensor
    params = dict(module.named_parameters())
    missing = sorted(set(state["model"]) ^ set(params))
    if missing:
        raise UnsupportedMeshError(f"moved shards and the rebuilt model disagree on parameters {missing[:5]}")
    with torch.no_grad():
        for name, shard in state["model"].items():
            local = _local(params[name])
            if tuple(local.shape) != tuple(shard.shape):
                raise UnsupportedMeshError(f"shard of {name}: moved {tuple(shard.shape)}, rebuilt "
                                           f"{tuple(local.shape)} (the rank's place in the mesh changed)")
            local.copy_(shard)
    for p in module.parameters():
        p.grad = None
    if optimizer is None or "optimizer" not in state:
        return
    moved = state["optimizer"]
    if len(moved["param_groups"]) != len(optimizer.param_groups):
        raise UnsupportedMeshError(f"optimizer has {len(optimizer.param_groups)} parameter groups, the "
                                   f"moved state {len(moved['param_groups'])}")
    for group, saved in zip(optimizer.param_groups, moved["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
        group["params"] = [params[n] for n in saved["params"]]
    new_state: dict = collections.defaultdict(dict)
    for name, per in moved["state"].items():
        p = params[name]
        local_shape = tuple(_local(p).shape)
        entry = {}
        for k, v in per.items():
            if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and tuple(v.shape) == local_shape \
                    and v.dim() > 0:
                # a per-element moment (Adam's exp_avg): a DTensor laid out like its parameter. The
                # tensor is taken as it is (the old world's local tensor, or a view of the receive
                # buffer): nothing else holds it, so the optimizer may update it in place
                v = DTensor.from_local(v.to(_local(p).device), p.device_mesh, p.placements,
                                       shape=p.shape, stride=p.stride(), run_check=False)
            entry[k] = v
        new_state[p] = entry
    optimizer.state = new_state
