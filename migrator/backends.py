"""The one place where gloo (CPU) and NCCL (CUDA) differ for the migrator: forming a world, its mesh,
and abandoning a broken one.

Everything else (agreement, plan, state transfer, digests) is the same for both: the transfer group is
always gloo on CPU tensors (foreshock.migrator.transfer copies CUDA tensors to the host), so a spare's
state crosses the network the same way whatever the training backend. What differs:

- forming a world: NCCL needs the process's CUDA device (`LOCAL_RANK`, as torchrun sets it) before the
  communicator is created, and binds the group to it (`device_id`), so the communicator is created
  eagerly inside the switch's pause rather than lazily inside the first new-world step;
- the mesh for FSDP2: a DeviceMesh of device type "cuda" or "cpu", and the device of the agreement's
  own small all-reduce (NCCL reduces CUDA tensors only);
- abandoning a world whose peer died: a gloo group fails its pending operations when a peer's socket
  closes, so destroying it is enough; an NCCL communicator may have kernels waiting on the dead peer
  forever, so it is aborted (ncclCommAbort, `_abort_process_group`) before it is destroyed.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("foreshock.migrator")

BACKENDS = ("gloo", "nccl")


@dataclasses.dataclass(frozen=True)
class BackendSeam:
    name: str

    @property
    def device_type(self) -> str:
        return "cuda" if self.name == "nccl" else "cpu"

    def device(self) -> torch.device:
        if self.name != "nccl":
            return torch.device("cpu")
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def collective_device(self) -> torch.device:
        """Where a tensor for a collective of this backend must live (NCCL: the current CUDA device)."""
        if self.name != "nccl":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def init_world(self, store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
        kwargs = {"device_id": self.device()} if self.name == "nccl" else {}
        dist.init_process_group(self.name, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                **kwargs)

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        if self.name == "nccl":
            self.device()
        return init_device_mesh(self.device_type, tuple(shape), mesh_dim_names=names)

    def abandon(self) -> None:
        """Leave the current default group, which may be broken (a peer died mid-collective)."""
        if not dist.is_initialized():
            return
        if self.name == "nccl":
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as exc:  # noqa: BLE001 - fall through to destroy
                log.warning("aborting the NCCL communicators failed: %r", exc)
            if not dist.is_initialized():
                return
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - a broken group may refuse a clean shutdown
            log.warning("destroying the broken process group failed: %r", exc)


def backend_seam(name: str) -> BackendSeam:
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: the migrator supports {BACKENDS}")
    return BackendSeam(name)
