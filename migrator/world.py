"""The PyTorch side of the migrator: one training world per generation, and the switch between them.

Every process of the job (ranks and warm spares) runs the same script and builds a Migrator around its
model, optimizer and scheduler. Generation 0 is the group the script made (torchrun's env://), adopted
with its DDP wrapper, or one the migrator makes; generation g > 0's default process group is built on
PrefixStore("<job>/world/g<g>") of the job's TCPStore; each switch uses a fresh prefix, because a reused
one hands out stale addresses and hangs. At each step boundary `end_step()` reads the agreement (three
extra elements in the first gradient bucket's all-reduce, via a DDP communication hook; a separate tiny
all-reduce when no backward ran), and on an agreed directive whose step has come:

1. plan: the coordinator (the lowest rank off the leaving node, which is also the state source) claims
   the switch for (generation, step), picks live spares from the standby registry in the store (their
   heartbeats are fresh), falls back to the job's policy when there are none, and publishes the plan;
2. transfer (evacuate only): the coordinator, the leaving ranks and the spares form a short-lived gloo
   group on a fresh prefix; the coordinator sends the replicated state (model, optimizer, scheduler,
   registered replicated objects, step, generation, directives done), each leaving rank, still alive,
   sends its own rank-local state (RNG states, per-rank objects such as the data position; with FSDP2
   its parameter and optimizer shards, foreshock.migrator.sharded) to the spare that replaces it; each
   spare checks the senders' digests against what it loaded and confirms in the store;
3. commit or abort: the coordinator publishes the outcome. On commit the leaving ranks return
   `leave=True`, everyone else destroys the old group, joins generation g+1, and re-wraps the model in
   DistributedDataParallel (which holds its process group) or, with FSDP2, rebuilds it on the new mesh
   with its own shards. On abort (a spare died, a timeout) nothing of the old world was touched:
   training goes on in it and the directive is reported failed.

A rank that dies unannounced breaks a collective inside a step; `guard()` around the step turns that
into a heal (_heal): the survivors tell the dead from the slow through the store (reports and
heartbeats), and the first to know plans: a replica hands the state to a spare (DDP), or, with no
replica (FSDP2) or no consistent step, every survivor leaves with checkpoint_exit.

Upstream torch 2.13 cannot reconfigure a process group (and gloo cannot shrink one), so a new world is
always destroy + init on a new prefix store, as torchft does; what NCCL does differently is in
foreshock.migrator.backends (the state transfer group stays gloo on CPU tensors).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from foreshock.migrator.backends import backend_seam
from foreshock.migrator.config import MigratorConfig
from foreshock.migrator.directives import (MAX_EXACT_WORLD, Ack, AckPhase, Directive, DirectiveBook,
                                           DirectiveKind, DirectiveSource)
from foreshock.migrator.transfer import digest, load_checkpoint, recv_state, save_checkpoint, send_state

log = logging.getLogger("foreshock.migrator")

LOCAL_TAG = 1 << 20
HEAL_TIMEOUTS = 4       # a heal waits this many group timeouts for every survivor to report


@dataclasses.dataclass
class WorldChange:
    """What `end_step` tells the loop. `leave`: this process must stop training now."""
    kind: str = "none"               # none | evacuate | shrink | checkpoint_exit | failed | rejected
    directive_id: str = ""
    leave: bool = False
    rank: int = -1
    world_size: int = 0
    generation: int = 0
    checkpoint: str = ""
    reason: str = ""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.kind != "none"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class StepClock:
    """This rank's step times, for the control plane's fail-slow rule: the whole step (from the end
    of the last end_step to this one), and its compute part, from the step's start to the moment its
    last gradient bucket is handed to the all-reduce (the DDP communication hook): data, forward and
    backward, before any wait for the other ranks. In a synchronous job the whole step is the same on
    every rank (each waits for the slowest in the all-reduce); the compute part is what differs, and
    the slow rank's is the longest. CPU tensors: the host clock. CUDA tensors: events on the current
    stream (the host runs ahead of the GPU and its clock would time kernel launches, not work), read a
    step late with query(), so reading them never waits for the GPU. Without the hook (FSDP2, no
    backward) the compute part is 0: not measured. Each step's end is also stamped by the wall clock
    (Unix ns), for the archive's rows: when end_step ran on the host (with CUDA, the GPU finishes the
    step's work up to the host's lead later)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.compute_end: float | None = None
        self.cuda = False
        self._events: list | None = None                   # [start, compute] events of this step
        self._pending: collections.deque = collections.deque(maxlen=8)   # (step, start, compute, end, end_ns)

    def begin(self) -> None:
        self.start = time.monotonic()
        self.compute_end = None
        self._events = None
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = [start, None]

    def mark_compute(self, tensor: torch.Tensor) -> None:
        """From the DDP hook, for every bucket: the last one of the step wins."""
        if tensor.is_cuda:
            self.cuda = True
            if self._events is not None:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self._events[1] = ev
        else:
            self.compute_end = time.monotonic()

    def end(self, step: int) -> list[tuple[int, float, float, int]]:
        """(step, step_seconds, compute_seconds, end_ns) of the steps whose times are known now."""
        end_ns = time.time_ns()
        if self._events is None:
            total = time.monotonic() - self.start
            compute = self.compute_end - self.start if self.compute_end is not None else 0.0
            return [(step, total, min(max(compute, 0.0), total), end_ns)]
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((step, self._events[0], self._events[1], end, end_ns))
        self._events = None
        out = []
        while self._pending and self._pending[0][3].query():
            s, a, c, e, e_ns = self._pending.popleft()
            total = a.elapsed_time(e) / 1e3
            compute = a.elapsed_time(c) / 1e3 if c is not None else 0.0
            out.append((s, total, min(max(compute, 0.0), total), e_ns))
        return out


class Migrator:
    """Moves this job's ranks to warm spares at step boundaries. See docs/migrator.md."""

    def __init__(self, config: MigratorConfig | None = None, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                 replicated: dict[str, Any] | None = None, per_rank: dict[str, Any] | None = None,
                 source: DirectiveSource | None = None, backend: str | None = None, wrap_ddp: bool = True,
                 ddp_kwargs: dict | None = None, store: Any = None, warmup=None,
                 reshard: Callable[[Any], torch.nn.Module] | None = None) -> None:
        self.config = config or MigratorConfig.from_env()
        if isinstance(model, DistributedDataParallel):
            # the script wrapped it already: adopt that wrapper (its options are kept for later worlds)
            self._adopted_ddp = model
            model = model.module
        else:
            self._adopted_ddp = None
        self.reshard = reshard        # FSDP2: mesh -> the module, fully_shard applied on that mesh
        if reshard is None and _has_dtensor_params(model):
            raise ValueError("model: its parameters are DTensors (FSDP2); pass reshard=<mesh -> sharded "
                             "module> so the migrator can rebuild it in a new world")
        self.module = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.replicated = dict(replicated or {})
        self.per_rank = dict(per_rank or {})
        self.backend = backend or ("nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo")
        self.seam = backend_seam(self.backend)
        self.wrap_ddp = wrap_ddp and reshard is None
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.warmup = warmup          # spare only: run one throw-away step in standby (kernels, allocator)
        self.rank = self.config.rank if self.config.role == "rank" else -1
        self.world_size = self.config.world_size if self.config.role == "rank" else 0
        self.generation = 0
        self.step = 0
        self.placement: dict[int, str] = {}
        self.book = DirectiveBook()
        self.history: list[WorldChange] = []
        self.last_pause_s = 0.0
        self._ddp: DistributedDataParallel | None = None
        self._p = f"foreshock/{self.config.job_id}/"
        self._store = store
        self._own_source = source is None
        self._source: DirectiveSource | None = source
        self._client = None
        self._summed: list[float] | None = None
        self._summed_cand: Directive | None = None
        self._accepted: set[str] = set()
        self.agreement_counts = {"piggybacked": 0, "separate": 0}   # how each step's agreement travelled
        self._completing: tuple[Directive, float, dict] | None = None
        self._step_t = time.monotonic()
        self._times = StepClock()
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._closed = False
        self._spare_nodes_seen: set[str] = set()
        self.adopted = False          # generation 0 is the group the script made itself
        self.mesh_spec = None         # sharded: (mesh shape, dimension names), the same in every world
        self.last_change = WorldChange()
        self._healthy = True          # False once a collective of this world failed

    # --- public surface ----------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        """The model to call in the loop (DDP-wrapped in the current world); re-read it every step."""
        return self._ddp if self._ddp is not None else self.module

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    def start(self) -> bool:
        """Join the job: a rank joins generation 0; a spare waits in standby until it is given a
        rank (True) or the job ends (False)."""
        t0 = time.monotonic()
        self._connect_store()
        if self.config.role == "spare":
            if dist.is_initialized():
                raise RuntimeError("a spare (FORESHOCK_ROLE=spare) must not join the job's process group "
                                   "before start(): call foreshock.migrator.init_process_group, which "
                                   "skips it on a spare")
            return self._standby()
        t1 = time.monotonic()
        if dist.is_initialized():
            # the script made the group (torchrun's env://, c10d rendezvous): it is generation 0
            self.adopted = True
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.backend = dist.get_backend()
            self.seam = backend_seam(self.backend)
        else:
            self._init_world(self.generation, self.rank, self.world_size)
        if self.reshard is not None:
            from foreshock.migrator import sharded
            if not sharded.is_sharded(self.module):
                raise sharded.UnsupportedMeshError(
                    "model: with reshard= a rank's model must be sharded already (fully_shard on the job's "
                    "mesh, after the script's init_process_group), with its optimizer built on it")
            self.mesh_spec = sharded.check_layout(self.module)
        t2 = time.monotonic()
        self._store.set(f"{self._p}node/g0/{self.rank}", self.config.node)
        nodes = self._store.multi_get([f"{self._p}node/g0/{r}" for r in range(self.world_size)])
        self.placement = {r: n.decode() for r, n in enumerate(nodes)}
        self._open_source(watch=False)
        if self.is_lead and self._client is not None:
            self._client.register(self.placement, self.config.spare_nodes, current_step=self.step,
                                  fallback=self.config.fallback)
        dist.barrier()      # the job is registered before any rank watches its directives
        if self._client is not None:
            self._client.watch(self.rank)
        if self.is_lead:
            # under torchrun (--standalone) these two values are chosen at start: say them where people look
            say = log.warning if self.adopted else log.info
            say("job %s: spares join with FORESHOCK_ROLE=spare FORESHOCK_JOB_ID=%s FORESHOCK_STORE=%s "
                "FORESHOCK_NODE=<their node>", self.config.job_id, self.config.job_id, self.config.store)
        t3 = time.monotonic()
        self._start_heartbeat(f"{self._p}alive/g{self.generation}/{self.rank}")
        if self._adopted_ddp is not None:
            self._ddp = self._adopted_ddp
            self.ddp_kwargs = {**_ddp_options(self._ddp), **self.ddp_kwargs}
            self._ddp.register_comm_hook(self, _agreement_hook)
        else:
            self._wrap()
        self._step_t = time.monotonic()
        self._times.begin()
        log.info("rank %d of job %s joined generation 0: store %.3fs, group %.3fs, registration %.3fs, "
                 "DDP %.3fs", self.rank, self.config.job_id, t1 - t0, t2 - t1, t3 - t2, self._step_t - t3)
        return True

    def end_step(self) -> WorldChange:
        """Call once after every optimizer step, on every rank. Never raises for service trouble."""
        now = time.monotonic()
        step_s, self._step_t = now - self._step_t, now
        self._report_step_times()
        self.step += 1
        change = WorldChange(rank=self.rank, world_size=self.world_size, generation=self.generation)
        if self._completing is not None:
            self._finish_completion()
        if self.is_lead and self._client is not None:
            self._client.report_step(self.step, step_s)
        summed, cand = self._summed, self._summed_cand
        self._summed = self._summed_cand = None
        if summed is None:
            self._drain()
            ctrl, cand = self.book.control(self.step)
            t = torch.tensor(ctrl, dtype=torch.float64, device=self.seam.collective_device())
            dist.all_reduce(t)
            summed = t.tolist()
            self.agreement_counts["separate"] += 1
        else:
            self.agreement_counts["piggybacked"] += 1
        agreed, go = DirectiveBook.decide(summed, self.world_size, cand)
        if agreed is not None and agreed.directive_id not in self._accepted:
            self._accepted.add(agreed.directive_id)
            if self._is_switch_coordinator(agreed):
                seen = self.book.first_seen.get(agreed.directive_id, now)
                self._ack(agreed, AckPhase.ACCEPTED, phase_seconds=time.monotonic() - seen,
                          reason=f"all {self.world_size} ranks agree; switching at step "
                                 f"{max(agreed.at_step, self.step)}")
        if agreed is not None and go:
            change = self._switch(agreed)
            self.history.append(change)
        self._drain()
        self._step_t = time.monotonic()
        self._times.begin()
        self.last_change = change
        return change

    def _report_step_times(self) -> None:
        if self._client is None:
            return
        try:
            for step, total, compute, end_ns in self._times.end(self.step):
                self._client.record_step_time(self.rank, step, total, compute, end_ns)
        except Exception as exc:  # noqa: BLE001 - a CUDA event that cannot be read must not stop training
            log.debug("step times not measured: %r", exc)

    @contextlib.contextmanager
    def guard(self):
        """Wrap one training step (forward, backward, optimizer step, end_step). If a collective of the
        step fails because a rank died unannounced, the failure is absorbed: the survivors find the
        dead ranks, a healthy replica hands the full state to warm spares (DDP), and the world is
        re-formed; `last_change` says what happened and the loop runs the same step again (the
        failed step counted nowhere). Sharded state without a replica cannot be healed: every
        survivor gets a checkpoint_exit change with leave=True. Other exceptions pass through."""
        self.last_change = WorldChange(rank=self.rank, world_size=self.world_size, generation=self.generation)
        try:
            yield self
        except Exception as exc:  # noqa: BLE001 - only a failed collective is absorbed below
            if not _is_collective_failure(exc) or self.rank < 0:     # (a spare that took a rank heals too)
                raise
            log.warning("rank %d: a collective failed at step %d (%s); healing", self.rank, self.step,
                        str(exc).splitlines()[0][:200])
            self.last_change = self._heal()
            self.history.append(self.last_change)

    def close(self, *, finished: bool = True) -> None:
        """Leave the job. `finished`: training is over (the lead deregisters and releases the spares)."""
        if self._closed:
            return
        self._closed = True
        if finished and self.is_lead and self._store is not None:
            try:
                self._store.set(f"{self._p}released", "1")
                self._release_spares()
            except Exception as exc:  # noqa: BLE001
                log.warning("could not release spares: %s", exc)
        if self._client is not None:
            self._client.close(deregister=finished and self.is_lead)
        elif self._source is not None and self._own_source:
            self._source.close()
        self._heartbeat_stop.set()
        self._ddp = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _release_spares(self) -> None:
        """Wake every unclaimed standby spare of the job's spare nodes with a release assignment."""
        for node in dict.fromkeys(list(self.config.spare_nodes) + list(self._spare_nodes_seen)):
            for slot in range(self._store.add(f"{self._p}standby/{node}/count", 0)):
                if self._store.add(f"{self._p}standby/{node}/{slot}/claim", 1) == 1:
                    self._store.set(f"{self._p}assign/{node}/{slot}", json.dumps({"release": True}))

    def restore(self, checkpoint: str | os.PathLike) -> None:
        """Load a just-in-time checkpoint written by the checkpoint_exit fallback (this rank's files)."""
        base = Path(checkpoint)
        self._load_replicated(load_checkpoint(base))
        local = base.with_name(f"{base.name}.rank{self.rank}")
        if local.exists():
            self._load_local(load_checkpoint(local))

    # --- state ------------------------------------------------------------------------------
    def replicated_state(self) -> dict:
        """The state every rank holds the same copy of (sharded: everything but the model and optimizer)."""
        sharded = self.reshard is not None
        return {
            "model": None if sharded else self.module.state_dict(),
            "optimizer": None if sharded or self.optimizer is None else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "objects": {k: v.state_dict() for k, v in self.replicated.items()},
            "migrator": {"step": self.step, "generation": self.generation,
                         "done": sorted(self.book.done), "placement": {str(k): v for k, v in self.placement.items()},
                         "mesh": None if self.mesh_spec is None else
                         {"shape": list(self.mesh_spec[0]),
                          "names": None if self.mesh_spec[1] is None else list(self.mesh_spec[1])}},
        }

    def local_state(self) -> dict:
        """The state only this rank has: RNG, per_rank objects, and (sharded) its parameter and
        optimizer shards."""
        state = {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                 "objects": {k: v.state_dict() for k, v in self.per_rank.items()}}
        if self.reshard is not None:
            from foreshock.migrator import sharded
            state["shards"] = sharded.local_state(self.module, self.optimizer)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np
            name, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy_rng"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")),
                                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
        except ImportError:
            pass
        return state

    def _load_replicated(self, state: dict) -> None:
        if state["model"] is not None:
            self.module.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        for k, v in state["objects"].items():
            if k in self.replicated:
                self.replicated[k].load_state_dict(v)
        m = state["migrator"]
        self.step = int(m["step"])
        self.generation = int(m["generation"])
        self.book = DirectiveBook(done=m["done"])
        self.placement = {int(k): v for k, v in m["placement"].items()}
        if m.get("mesh") is not None:
            names = m["mesh"]["names"]
            self.mesh_spec = (tuple(m["mesh"]["shape"]), None if names is None else tuple(names))

    def _load_local(self, state: dict) -> None:
        # after an unannounced death only a survivor's per-rank objects come: the RNG stays this process's
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        if "python_rng" in state:
            random.setstate(state["python_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        if "numpy_rng" in state:
            import numpy as np
            n = state["numpy_rng"]
            np.random.set_state((n["name"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"],
                                 n["cached"]))
        for k, v in state["objects"].items():
            if k in self.per_rank:
                self.per_rank[k].load_state_dict(v)
        if "shards" in state:
            from foreshock.migrator import sharded
            sharded.apply_local(self.module, self.optimizer, state["shards"])

    # --- plumbing -------------------------------------------------------------------------
    def _connect_store(self) -> None:
        if self._store is None:
            self._store = dist.TCPStore(self.config.store_host, self.config.store_port,
                                        is_master=self.config.host_store,
                                        timeout=_td(self.config.transfer_timeout_s), wait_for_workers=False)

    def _open_source(self, watch: bool = True) -> None:
        if self._source is None:
            if self.config.service:
                from foreshock.migrator.client import ServiceClient
                self._client = ServiceClient(self.config)
                self._source = self._client
            else:
                # no control plane: directives may still be published in the job's own store
                self._source = StoreDirectiveSource(self._store, self.config.job_id)
        elif hasattr(self._source, "watch") and hasattr(self._source, "register"):
            self._client = self._source
        if self._client is not None and watch:
            self._client.watch(self.rank)

    def _drain(self) -> None:
        try:
            for d in self._source.poll():
                if d.directive_id in self.book.done and not d.cancelled:
                    log.info("directive %s delivered again; already acted on", d.directive_id)
                self.book.offer(d)
        except Exception as exc:  # noqa: BLE001 - a broken source must not stop training
            log.warning("directive source failed: %r", exc)
        # a directive not agreed by its deadline is stale (the node may have failed or recovered
        # since): dropped and reported failed, so that the service decides again
        for d in self.book.expire(time.time(), keep=self._accepted):
            log.warning("directive %s passed its deadline before every rank agreed; dropped", d.directive_id)
            if self._is_switch_coordinator(d):
                self._ack(d, AckPhase.FAILED, reason=f"deadline passed at step {self.step} before every "
                                                     f"rank agreed; not acted on")

    def _ack(self, d: Directive, phase: AckPhase, reason: str = "", phase_seconds: float = 0.0) -> None:
        if self._source is None:
            return
        try:
            self._source.ack(Ack(d.directive_id, self.rank, phase, reason, phase_seconds))
        except Exception as exc:  # noqa: BLE001
            log.warning("ack failed: %r", exc)

    def _init_world(self, generation: int, rank: int, world_size: int) -> None:
        prefix = dist.PrefixStore(f"{self._p}world/g{generation}/", self._store)
        self.seam.init_world(prefix, rank, world_size, _td(self.config.transfer_timeout_s))

    def _wrap(self, sync: bool = True) -> None:
        if not self.wrap_ddp:
            return
        self._ddp = DistributedDataParallel(self.module, init_sync=sync, **self.ddp_kwargs)
        self._ddp.register_comm_hook(self, _agreement_hook)

    def _control_for_hook(self) -> tuple[list[float], Directive | None]:
        # take in what arrived during this step's forward pass: it joins this step's agreement
        self._drain()
        return self.book.control(self.step + 1)

    def _is_switch_coordinator(self, d: Directive) -> bool:
        # with no rank off the leaving node, rank 0 plans (a checkpoint, or a rejection)
        c = self._coordinator_for(d)
        return self.rank == (0 if c is None else c)

    def _coordinator_for(self, d: Directive) -> int | None:
        for r in range(self.world_size):
            if r not in d.ranks and (not d.from_node or self.placement.get(r) != d.from_node):
                return r
        return None

    def _finish_completion(self) -> None:
        d, t0, phases, kind = self._completing
        self._completing = None
        phases["first_step"] = time.monotonic() - t0 - sum(phases.values())
        total = time.monotonic() - t0
        self._ack(d, AckPhase.COMPLETED, phase_seconds=total,
                  reason=" ".join(f"{k}={v:.4f}s" for k, v in phases.items()))
        if kind == "shrink" and self._client is not None:
            # the service drops the leaving ranks but keeps the old numbers; tell it the new ones
            self._client.register_later(self.placement, self.config.spare_nodes, current_step=self.step,
                                        fallback=self.config.fallback)
        if self.history:
            self.history[-1].phases["first_step"] = phases["first_step"]
            self.history[-1].phases["total_to_first_step"] = total

    # --- the switch ---------------------------------------------------------------------------
    def _switch(self, d: Directive) -> WorldChange:
        t0 = time.monotonic()
        phases: dict[str, float] = {"agreement": t0 - self.book.first_seen.get(d.directive_id, t0)}
        key = f"{self._p}plan/g{self.generation}/s{self.step}"
        me_coord = self._is_switch_coordinator(d)
        if me_coord and self._store.add(f"{key}/claim", 1) == 1:
            try:
                plan = self._make_plan(d)
            except Exception as exc:  # noqa: BLE001 - every rank waits for a plan: always publish one
                log.exception("planning the switch for %s failed", d.directive_id)
                plan = {"directive_id": d.directive_id, "kind": "rejected", "coordinator": self.rank,
                        "reason": f"planning failed: {exc!r}"[:500], "spares": []}
            plan["backend"] = self.backend
            for sp in plan.get("spares", []):
                self._store.set(f"{self._p}assign/{sp['node']}/{sp['slot']}", json.dumps(plan))
            self._store.set(key, json.dumps(plan))
        try:
            plan = json.loads(self._store.get(key))
        except Exception as exc:  # noqa: BLE001
            # no plan in time: the coordinator is gone; the old world is broken anyway
            log.error("no switch plan for %s: %r", d.directive_id, exc)
            self.book.finish(d.directive_id)
            return WorldChange("failed", d.directive_id, rank=self.rank, world_size=self.world_size,
                               generation=self.generation, reason=f"no plan: {exc!r}")
        phases["plan"] = time.monotonic() - t0
        did = plan["directive_id"]
        self.book.finish(did)
        if did != d.directive_id:
            self.book.finish(d.directive_id)
        coordinator = plan["coordinator"] == self.rank
        if plan["kind"] == "rejected":
            if coordinator:
                self._ack(d, AckPhase.FAILED, reason=plan["reason"])
            return WorldChange("rejected", did, rank=self.rank, world_size=self.world_size,
                               generation=self.generation, reason=plan["reason"], phases=phases)
        if plan["kind"] == "checkpoint_exit":
            return self._checkpoint_exit(d, plan, phases, t0)
        if plan["kind"] == "evacuate":
            outcome = self._transfer_as_member(plan, phases)
            if not outcome.startswith("commit"):
                reason = outcome.partition(":")[2].strip() or outcome
                if coordinator:
                    self._ack(d, AckPhase.FAILED, reason=f"transfer aborted: {reason}; "
                              f"rank(s) {plan['leaving']} stay", phase_seconds=time.monotonic() - t0)
                self.last_pause_s = time.monotonic() - t0
                return WorldChange("failed", did, rank=self.rank, world_size=self.world_size,
                                   generation=self.generation, reason=reason, phases=phases)
            if coordinator:
                self._ack(d, AckPhase.STATE_TRANSFERRED, phase_seconds=phases.get("transfer", 0.0),
                          reason=f"{plan.get('bytes', 0)} bytes to {[s['node'] for s in plan['spares']]}: "
                                 + ", ".join(f"{n} from {src}" for src, n in plan.get("bytes_from", {}).items()))
        leaving = self.rank in plan["leaving"]
        if leaving:
            self._ddp = None
            dist.destroy_process_group()
            self.last_pause_s = time.monotonic() - t0
            change = WorldChange(plan["kind"], did, leave=True, rank=self.rank, world_size=plan["world"],
                                 generation=plan["gen"], reason=plan["reason"], phases=phases)
            self.close(finished=False)
            return change
        t1 = time.monotonic()
        self._enter_world(plan, new_rank=int(plan["rank_map"][str(self.rank)]))
        phases["reform"] = time.monotonic() - t1
        self.last_pause_s = time.monotonic() - t0
        if coordinator:
            # COMPLETED goes after the first step of the new world
            self._completing = (d, t0 - phases["agreement"], dict(phases), plan["kind"])
        return WorldChange(plan["kind"], did, rank=self.rank, world_size=self.world_size,
                           generation=self.generation, reason=plan["reason"], phases=phases)

    def _handover_state(self) -> dict:
        """What a replica gives the spare that takes a dead rank's place: its per-rank objects (the
        dead rank's are gone; right for positions derived from the step) and, sharded, its shards,
        which are the dead rank's (HSDP replicas hold the same). Not its RNG: the spare keeps its own."""
        state = {"objects": {k: v.state_dict() for k, v in self.per_rank.items()}}
        if self.reshard is not None:
            from foreshock.migrator import sharded
            state["shards"] = sharded.local_state(self.module, self.optimizer)
        return state

    def _heal(self) -> WorldChange:
        """After a failed collective: find the dead ranks through the store (a survivor reports in, a
        rank whose heartbeat is stale is dead), let the first survivor that knows plan, and follow it."""
        t0 = time.monotonic()
        phases: dict[str, float] = {}
        gen, w = self.generation, self.world_size
        self._healthy = False
        self._ddp = None
        for p in self.module.parameters():
            p.grad = None          # the failed step's partial gradients
        self.seam.abandon()        # the survivors' pending operations on this world fail at once
        hk = f"{self._p}heal/g{gen}/"
        self._store.set(f"{hk}alive/{self.rank}", json.dumps({"step": self.step, "node": self.config.node}))
        # a survivor blocked on the dead rank reports only when its own operation times out (the
        # group's timeout, transfer_timeout_s for the worlds the migrator makes; gloo cannot wake it
        # sooner, abort() included), and under HSDP it may sit in two collectives of sub-groups
        deadline = t0 + HEAL_TIMEOUTS * self.config.transfer_timeout_s
        stale_after = 10 * self.config.spare_heartbeat_s + 1.0
        reported: set[int] = set()
        dead: set[int] = set()
        while len(reported) + len(dead) < w and not self._store.check([f"{hk}plan"]):
            if time.monotonic() > deadline:
                return self._leave_unhealed(f"could not tell the dead ranks from the slow ones within "
                                            f"{HEAL_TIMEOUTS * self.config.transfer_timeout_s}s", phases)
            time.sleep(0.05)
            reported = {r for r in range(w) if self._store.check([f"{hk}alive/{r}"])}
            dead = set()
            for r in set(range(w)) - reported:
                beat = f"{self._p}alive/g{gen}/{r}"
                if not self._store.check([beat]) or time.time() - float(self._store.get(beat)) > stale_after:
                    dead.add(r)
        phases["detect"] = time.monotonic() - t0
        if self._store.add(f"{hk}claim", 1) == 1:
            try:
                plan = self._heal_plan(gen, reported, dead)
            except Exception as exc:  # noqa: BLE001 - the others wait for a plan: always publish one
                log.exception("planning the heal failed")
                plan = {"kind": "checkpoint_exit", "survivors": sorted(reported), "checkpoint": False,
                        "reason": f"planning the heal failed: {exc!r}"[:500]}
            plan["backend"] = self.backend
            for sp in plan.get("spares", []):
                self._store.set(f"{self._p}assign/{sp['node']}/{sp['slot']}", json.dumps(plan))
            self._store.set(f"{hk}plan", json.dumps(plan))
        try:
            plan = json.loads(self._store.get(f"{hk}plan"))
        except Exception as exc:  # noqa: BLE001
            return self._leave_unhealed(f"no heal plan: {exc!r}", phases)
        phases["plan"] = time.monotonic() - t0 - phases["detect"]
        if self.rank not in plan["survivors"]:
            return self._leave_unhealed("this rank was counted dead by the survivors", phases)
        log.warning("heal of generation %d: %s", gen, plan["reason"])
        if plan["kind"] == "checkpoint_exit":
            path = ""
            if plan.get("checkpoint"):
                path = self._save_checkpoint(plan["coordinator"] == self.rank)
            if plan["coordinator"] == self.rank:
                # the job ends here: the spares have nothing to wait for
                self._store.set(f"{self._p}released", "1")
                self._release_spares()
            change = WorldChange("checkpoint_exit", "", leave=True, rank=self.rank, world_size=w,
                                 generation=gen, checkpoint=path, reason=plan["reason"], phases=phases)
            self.close(finished=False)
            return change
        if plan["kind"] == "heal":
            outcome = self._transfer_as_member(plan, phases)
            if not outcome.startswith("commit"):
                return self._leave_unhealed(f"state transfer to the spare failed: {outcome}", phases)
        t1 = time.monotonic()
        self._enter_world(plan, new_rank=int(plan["rank_map"][str(self.rank)]))
        phases["reform"] = time.monotonic() - t1
        self.last_pause_s = time.monotonic() - t0
        if plan["coordinator"] == self.rank and self._client is not None:
            self._client.register_later(self.placement, self.config.spare_nodes, current_step=self.step,
                                        fallback=self.config.fallback)
        return WorldChange(plan["kind"], plan["directive_id"], rank=self.rank, world_size=self.world_size,
                           generation=self.generation, reason=plan["reason"], phases=phases)

    def _heal_plan(self, gen: int, survivors: set[int], dead: set[int]) -> dict:
        steps = {r: json.loads(self._store.get(f"{self._p}heal/g{gen}/alive/{r}"))["step"] for r in survivors}
        base = {"directive_id": f"heal-g{gen}", "gen": gen + 1, "step": self.step, "coordinator": self.rank,
                "survivors": sorted(survivors), "dead": sorted(dead), "leaving": [], "spares": []}
        what = f"rank(s) {sorted(dead)} died unannounced at step {self.step}"
        if len(set(steps.values())) > 1:
            return {**base, "kind": "checkpoint_exit", "checkpoint": False,
                    "reason": f"{what}; the survivors stopped at different steps {steps}: no consistent "
                              "state to go on from; restart from the job's last checkpoint"}
        lost = sorted(dead)
        if self.reshard is not None:
            # a dead rank's shards survive only in its HSDP replicas (FSDP2's 1-D mesh has none)
            from foreshock.migrator import sharded
            sources = {}
            for r in lost:
                alive = [x for x in sharded.replicas(self.mesh_spec[0], r) if x in survivors]
                if not alive:
                    return {**base, "kind": "checkpoint_exit", "checkpoint": False,
                            "reason": f"{what}; their FSDP shards have no replica (and the survivors cannot "
                                      "write a complete checkpoint): restart from the job's last checkpoint"}
                sources[r] = alive[0]
        else:
            sources = {r: self.rank for r in lost}
        spares = self._claim_spares("", len(lost)) if lost else []
        if spares is None and (self.config.fallback == "checkpoint_exit" or self.reshard is not None):
            return {**base, "kind": "checkpoint_exit", "checkpoint": self.reshard is None,
                    "reason": f"{what}; no spare in standby: " + (
                        "a sharded job cannot shrink; restart from the job's last checkpoint"
                        if self.reshard is not None else "checkpoint (from a healthy replica) and exit")}
        if spares is None:
            stay = sorted(survivors)
            return {**base, "kind": "shrink", "world": len(stay),
                    "rank_map": {str(r): i for i, r in enumerate(stay)},
                    "placement": {str(i): self.placement[r] for i, r in enumerate(stay)},
                    "reason": f"{what}; no spare in standby: the survivors go on as a world of {len(stay)}"}
        senders = sorted({src for src in sources.values() if src != self.rank})
        transfer_rank = {self.rank: 0, **{src: 1 + i for i, src in enumerate(senders)}}
        base["sources"] = senders
        base["spares"] = [{**s, "replaces": r, "transfer_rank": 1 + len(senders) + j,
                           "local_src": transfer_rank[sources[r]]}
                          for j, (s, r) in enumerate(zip(spares, lost))]
        base["group_size"] = 1 + len(senders) + len(spares)
        placement = dict(self.placement)
        placement.update({s["replaces"]: s["node"] for s in base["spares"]})
        handover = ", ".join(f"rank {sources[s['replaces']]} -> {s['node']}" for s in base["spares"])
        return {**base, "kind": "heal", "world": self.world_size,
                "rank_map": {str(r): r for r in survivors},
                "placement": {str(r): placement[r] for r in range(self.world_size)},
                "reason": f"{what}; healthy replicas hand the state over ({handover}); step {self.step} "
                          "(0-based) runs again"}

    def _leave_unhealed(self, reason: str, phases: dict) -> WorldChange:
        log.error("rank %d leaves the job: %s", self.rank, reason)
        change = WorldChange("checkpoint_exit", "", leave=True, rank=self.rank, world_size=self.world_size,
                             generation=self.generation, reason=reason, phases=phases)
        self.close(finished=False)
        return change

    def _save_checkpoint(self, replicated: bool) -> str:
        directory = Path(self.config.checkpoint_dir or "foreshock-checkpoints")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.config.job_id}-step{self.step}.ckpt"
        if replicated:
            save_checkpoint(path, self.replicated_state())
        save_checkpoint(path.with_name(f"{path.name}.rank{self.rank}"), self.local_state())
        return str(path)

    def _make_plan(self, d: Directive) -> dict:
        w = self.world_size
        base = {"directive_id": d.directive_id, "gen": self.generation + 1, "step": self.step,
                "coordinator": self.rank, "leaving": [], "spares": [], "reason": d.reason}
        if self._coordinator_for(d) is None and d.kind != DirectiveKind.CHECKPOINT_EXIT:
            # (a checkpoint may be written by a rank on the node: it is still alive, that is the point)
            return {**base, "kind": "rejected",
                    "reason": f"no rank outside node {d.from_node!r} to act as the state source"}
        bad = [r for r in d.ranks if not 0 <= r < w]
        wrong_node = [r for r in d.ranks if d.from_node and self.placement.get(r) != d.from_node]
        if not d.ranks or bad or wrong_node:
            return {**base, "kind": "rejected",
                    "reason": f"directive ranks {list(d.ranks)} do not match placement "
                              f"{self.placement} (from_node {d.from_node!r})"}
        leaving = sorted(set(d.ranks))
        if d.from_node:
            # every rank of the leaving node leaves together
            leaving = sorted(set(leaving) | {r for r, n in self.placement.items() if n == d.from_node})
        base["leaving"] = leaving
        kind = {DirectiveKind.EVACUATE: "evacuate", DirectiveKind.SHRINK: "shrink",
                DirectiveKind.CHECKPOINT_EXIT: "checkpoint_exit"}[d.kind]
        if kind == "evacuate":
            spares = self._claim_spares(d.to_node, len(leaving))
            if spares is None:
                kind = self.config.fallback
                base["reason"] = (f"{d.reason}; no spare in standby on {d.to_node or 'any node'}: "
                                  f"fallback {kind}")
            else:
                base["spares"] = [{**s, "replaces": r, "transfer_rank": 1 + len(leaving) + j}
                                  for j, (s, r) in enumerate(zip(spares, leaving))]
        if kind == "shrink" and self.reshard is not None:
            # shards are laid out for w ranks; with every rank alive a checkpoint is complete
            kind = "checkpoint_exit"
            base["reason"] = (f"{base['reason']}; a sharded job cannot shrink (its shards are laid out "
                              f"for {w} ranks): checkpoint and exit")
        if kind == "shrink" and len(leaving) >= w:
            return {**base, "kind": "rejected", "reason": "shrink would leave no rank"}
        base["kind"] = kind
        if kind == "evacuate":
            base["rank_map"] = {str(r): r for r in range(w) if r not in leaving}
            base["world"] = w
            base["placement"] = {str(r): (self.placement[r] if r not in leaving else
                                          next(s["node"] for s in base["spares"] if s["replaces"] == r))
                                 for r in range(w)}
        else:
            stay = [r for r in range(w) if r not in leaving]
            base["rank_map"] = {str(r): i for i, r in enumerate(stay)}
            base["world"] = len(stay)
            base["placement"] = {str(i): self.placement[r] for i, r in enumerate(stay)}
        return base

    def _claim_spares(self, node: str, count: int) -> list[dict] | None:
        nodes = [node] if node else list(self.config.spare_nodes)
        self._spare_nodes_seen.update(nodes)
        found = []
        stale_after = 10 * self.config.spare_heartbeat_s + 1.0
        for n in nodes:
            total = self._store.add(f"{self._p}standby/{n}/count", 0)
            for slot in range(total):
                k = f"{self._p}standby/{n}/{slot}"
                if not self._store.check([f"{k}/beat"]):
                    continue
                beat = float(self._store.get(f"{k}/beat"))
                if time.time() - beat > stale_after:
                    continue
                if self._store.add(f"{k}/claim", 1) != 1:
                    continue
                info = json.loads(self._store.get(k))
                found.append({"node": n, "slot": slot, "pid": info.get("pid")})
                if len(found) == count:
                    return found
        for s in found:   # not enough: give back what was claimed
            self._store.add(f"{self._p}standby/{s['node']}/{s['slot']}/claim", -1)
        return None

    def _transfer_as_member(self, plan: dict, phases: dict) -> str:
        """Run this process's part of the state transfer; returns the published outcome."""
        did, gen = plan["directive_id"], plan["gen"]
        okey = f"{self._p}outcome/{did}"
        xkey = f"{self._p}xfer/g{gen}/{did}/"
        leaving = plan["leaving"]
        size = plan.get("group_size", 1 + 2 * len(leaving))
        t = time.monotonic()
        coordinator = plan["coordinator"] == self.rank
        if coordinator:
            outcome = "commit"
            try:
                pg = self._transfer_group(did, gen, 0, size)
                state = self.replicated_state()
                state["migrator"]["generation"] = gen
                state["migrator"]["placement"] = plan["placement"]
                total = 0
                for sp in plan["spares"]:
                    sent, dg = send_state(pg, state, sp["transfer_rank"], 0)
                    total += sent
                    self._store.set(f"{xkey}digest/0/{sp['transfer_rank']}", dg)
                    if sp.get("local_src") == 0:
                        sent, dg = send_state(pg, self._handover_state(), sp["transfer_rank"], LOCAL_TAG)
                        total += sent
                        self._store.set(f"{xkey}digest/0/{sp['transfer_rank']}/local", dg)
                plan["bytes_from"] = {f"rank {self.rank} (replicated)": total}
                self._await_spares(plan)
                for r in leaving + plan.get("sources", []):
                    k = f"{xkey}bytes/{r}"
                    if self._store.check([k]):
                        own = "own shards and state" if self.reshard is not None else "own rank-local state"
                        plan["bytes_from"][f"rank {r} ({own})"] = int(self._store.get(k))
                plan["bytes"] = sum(plan["bytes_from"].values())
            except Exception as exc:  # noqa: BLE001
                outcome = f"abort: {exc}".replace("\n", " ")[:500]
                log.warning("state transfer for %s aborted: %s", did, outcome)
            self._store.set(okey, outcome)
        elif self.rank in leaving:
            try:
                i = leaving.index(self.rank)
                pg = self._transfer_group(did, gen, 1 + i, size)
                sp = next(s for s in plan["spares"] if s["replaces"] == self.rank)
                _fault_point("leaving_dies_in_transfer")
                sent, dg = send_state(pg, self.local_state(), sp["transfer_rank"], LOCAL_TAG)
                self._store.set(f"{xkey}digest/{1 + i}/{sp['transfer_rank']}/local", dg)
                self._store.set(f"{xkey}bytes/{self.rank}", str(sent))
            except Exception as exc:  # noqa: BLE001
                log.warning("sending local state for %s failed: %r", did, exc)
        elif self.rank in plan.get("sources", []):
            # a heal's replica of a dead rank's shards (HSDP) sends them to the spare taking its place
            try:
                me = 1 + plan["sources"].index(self.rank)
                pg = self._transfer_group(did, gen, me, size)
                for sp in plan["spares"]:
                    if sp["local_src"] == me:
                        sent, dg = send_state(pg, self._handover_state(), sp["transfer_rank"], LOCAL_TAG)
                        self._store.set(f"{xkey}digest/{me}/{sp['transfer_rank']}/local", dg)
                        self._store.set(f"{xkey}bytes/{self.rank}", str(sent))
            except Exception as exc:  # noqa: BLE001
                log.warning("sending a replica's state for %s failed: %r", did, exc)
        try:
            outcome = self._store.get(okey).decode()
        except Exception as exc:  # noqa: BLE001
            outcome = f"abort: no outcome: {exc}"
        phases["transfer"] = time.monotonic() - t
        return outcome

    def _transfer_group(self, did: str, gen: int, rank: int, size: int):
        store = dist.PrefixStore(f"{self._p}xfer/g{gen}/{did}/", self._store)
        return dist.ProcessGroupGloo(store, rank, size, _td(self.config.transfer_timeout_s))

    def _await_spares(self, plan: dict) -> None:
        deadline = time.monotonic() + self.config.transfer_timeout_s
        stale_after = 10 * self.config.spare_heartbeat_s + 1.0
        for sp in plan["spares"]:
            k = f"{self._p}standby/{sp['node']}/{sp['slot']}"
            while True:
                # check-and-sleep, not wait(timeout): c10d logs every timed-out wait as a warning
                if self._store.check([f"{k}/received"]):
                    break
                time.sleep(0.002)
                if time.time() - float(self._store.get(f"{k}/beat")) > stale_after:
                    raise RuntimeError(f"spare {sp['node']} (pid {sp['pid']}) stopped during the transfer")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"spare {sp['node']} did not confirm within "
                                       f"{self.config.transfer_timeout_s}s")
            verdict = self._store.get(f"{k}/received").decode()
            if verdict != "ok":
                raise RuntimeError(f"spare {sp['node']} refused the state: {verdict}")

    def _enter_world(self, plan: dict, new_rank: int, shards: dict | None = None) -> None:
        """Leave the current group and join generation plan["gen"] as `new_rank`. Sharded: carry this
        rank's shards across (or put `shards`, received by a spare, in place) in a rebuilt module."""
        if self.reshard is not None and shards is None:
            from foreshock.migrator import sharded
            shards = sharded.local_state(self.module, self.optimizer)
        self._ddp = None
        if self._healthy:
            if dist.is_initialized():
                dist.destroy_process_group()
        else:
            self.seam.abandon()
        self._healthy = True
        self.generation = int(plan["gen"])
        self.rank, self.world_size = new_rank, int(plan["world"])
        self.placement = {int(k): v for k, v in plan["placement"].items()}
        self._init_world(self.generation, self.rank, self.world_size)
        self._hb_key = f"{self._p}alive/g{self.generation}/{self.rank}"
        self._store.set(self._hb_key, repr(time.time()))
        if self.reshard is not None:
            from foreshock.migrator import sharded
            devices = [torch.cuda.current_device()] if self.seam.device_type == "cuda" else []
            with torch.random.fork_rng(devices=devices):      # building the module must not move the RNG
                self.module = self.reshard(self.seam.mesh(*self.mesh_spec))
            sharded.check_layout(self.module)
            sharded.apply_local(self.module, self.optimizer, shards)
        self._wrap(sync=False)
        if self._client is not None:
            self._client.watch(self.rank)

    def _checkpoint_exit(self, d: Directive, plan: dict, phases: dict, t0: float) -> WorldChange:
        directory = Path(self.config.checkpoint_dir or "foreshock-checkpoints")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.config.job_id}-step{self.step}.ckpt"
        coordinator = plan["coordinator"] == self.rank
        error = ""
        try:
            if coordinator:
                save_checkpoint(path, self.replicated_state())
            save_checkpoint(path.with_name(f"{path.name}.rank{self.rank}"), self.local_state())
            dist.barrier()
        except Exception as exc:  # noqa: BLE001
            error = repr(exc)
        phases["checkpoint"] = time.monotonic() - t0 - sum(phases.values())
        if coordinator:
            if error:
                self._ack(d, AckPhase.FAILED, reason=f"checkpoint failed: {error}")
            else:
                self._ack(d, AckPhase.COMPLETED, phase_seconds=time.monotonic() - t0,
                          reason=f"{plan['reason']}; checkpoint {path} at step {self.step}; job exits")
        change = WorldChange("checkpoint_exit", plan["directive_id"], leave=True, rank=self.rank,
                             world_size=self.world_size, generation=self.generation, checkpoint=str(path),
                             reason=error or plan["reason"], phases=phases)
        self.close(finished=False)
        return change

    # --- standby (spares) -----------------------------------------------------------------
    def _standby(self) -> bool:
        node = self.config.node
        if self.warmup is not None:
            # everything it touches (parameters, optimizer state, RNG) is overwritten on joining
            try:
                self.warmup(self.module)
            except Exception as exc:  # noqa: BLE001 - a cold spare is still a spare
                log.warning("spare warm-up failed: %r", exc)
        self._start_heartbeat()
        while True:
            slot = self._store.add(f"{self._p}standby/{node}/count", 1) - 1
            k = f"{self._p}standby/{node}/{slot}"
            self._hb_key = f"{k}/beat"
            self._store.set(self._hb_key, repr(time.time()))
            self._store.set(k, json.dumps({"pid": os.getpid(), "node": node}))
            assign = f"{self._p}assign/{node}/{slot}"
            # block until assigned: the coordinator's plan (or the lead's release) wakes us at once;
            # a long timeout only to notice a job that ended without releasing its spares
            while True:
                try:
                    self._store.wait([assign], _td(self.config.standby_poll_s))
                    break
                except Exception:  # noqa: BLE001 - the poll interval passed
                    if self._store.check([f"{self._p}released"]):
                        self._heartbeat_stop.set()
                        return False
            plan = json.loads(self._store.get(assign))
            if plan.get("release"):
                self._heartbeat_stop.set()
                return False
            if self._join(plan, slot):
                return True
            log.info("switch %s aborted; back to standby", plan["directive_id"])

    def _start_heartbeat(self, key: str = "") -> None:
        """Beat `key` (a standby slot's, or this rank's in its generation) in the store every
        spare_heartbeat_s from a thread of its own, so a live but busy process never looks dead."""
        store = dist.TCPStore(self.config.store_host, self.config.store_port, is_master=False,
                              timeout=_td(self.config.transfer_timeout_s), wait_for_workers=False)
        self._hb_key = key
        if key:
            store.set(key, repr(time.time()))

        def beat() -> None:
            while not self._heartbeat_stop.wait(self.config.spare_heartbeat_s):
                if self._hb_key:
                    try:
                        store.set(self._hb_key, repr(time.time()))
                    except Exception:  # noqa: BLE001
                        pass

        self._heartbeat = threading.Thread(target=beat, name="foreshock-heartbeat", daemon=True)
        self._heartbeat.start()

    def _join(self, plan: dict, slot: int) -> bool:
        did = plan["directive_id"]
        me = next(s for s in plan["spares"] if s["node"] == self.config.node and s["slot"] == slot)
        k = f"{self._p}standby/{self.config.node}/{slot}"
        xkey = f"{self._p}xfer/g{plan['gen']}/{did}/"
        tr = me["transfer_rank"]
        try:
            pg = self._transfer_group(did, plan["gen"], tr, plan.get("group_size", 1 + 2 * len(plan["leaving"])))
            replicated = recv_state(pg, 0, 0, on_message=_transfer_fault_hook)
            src = me.get("local_src", 1 + plan["leaving"].index(me["replaces"]) if plan["leaving"] else 0)
            local = recv_state(pg, src, LOCAL_TAG)
            _check_digest("the local state", local, self._store.get(f"{xkey}digest/{src}/{tr}/local").decode())
            shards = local.pop("shards", None)
            self._load_replicated(replicated)
            self._load_local(local)
            for p in self.module.parameters():
                p.grad = None          # nothing of the warm-up may leak into the first real step
            # what this process now holds is what the source sent, before the new world steps
            _check_digest("the replicated state", self.replicated_state(),
                          self._store.get(f"{xkey}digest/0/{tr}").decode())
            self._store.set(f"{k}/received", "ok")
        except Exception as exc:  # noqa: BLE001
            log.warning("receiving state for %s failed: %r", did, exc)
            try:
                self._store.set(f"{k}/received", f"{exc!r}"[:300])
            except Exception:  # noqa: BLE001
                pass
            return False
        try:
            outcome = self._store.get(f"{self._p}outcome/{did}").decode()
        except Exception:  # noqa: BLE001
            return False
        if not outcome.startswith("commit"):
            return False
        self.book.finish(did)
        self._take_job_backend(plan)
        self._open_source_for(me["replaces"])
        self._enter_world(plan, new_rank=me["replaces"], shards=shards)
        if shards is not None:
            # the shards went in only now (the module is rebuilt on the new mesh): check them before
            # the first step; a mismatch stops this process loudly rather than train a diverged model
            _check_digest("the moved shards", {"shards": self.local_state()["shards"]},
                          digest({"shards": shards}))
        self._step_t = time.monotonic()
        self._times.begin()
        return True

    def _take_job_backend(self, plan: dict) -> None:
        """A joining spare forms the new world with the job's backend, which the plan carries, whatever
        it would have chosen alone: a spare on a CUDA machine defaults to NCCL, and in a gloo job it
        would wait for NCCL peers that never come (seen on a lent H200, docs/migrator.md "NCCL")."""
        job = plan.get("backend")
        if job and job != self.backend:
            log.info("spare %s: the job trains on %s, not %s; joining with %s",
                     self.config.node, job, self.backend, job)
            self.backend, self.seam = job, backend_seam(job)

    def _open_source_for(self, rank: int) -> None:
        self.rank = rank
        self._open_source(watch=False)     # _enter_world starts the watch in the new world


def _is_collective_failure(exc: BaseException) -> bool:
    """Whether an exception from a training step is a collective that failed because a peer is gone
    (gloo: its socket closed or timed out; NCCL: the communicator reported an error or was aborted)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Gloo", "gloo",
        "NCCL", "Timed out waiting", "ProcessGroup", "process group"))


def _check_digest(what: str, state: Any, expected: str) -> None:
    got = digest(state)
    if got != expected:
        raise RuntimeError(f"digest of {what} is {got}, the sender's {expected}: not taking a diverged state")


def _has_dtensor_params(module: torch.nn.Module) -> bool:
    from foreshock.migrator import sharded
    return sharded.is_sharded(module)


def _ddp_options(ddp: DistributedDataParallel) -> dict:
    """The options a script gave its own DDP wrapper, to wrap the module the same way in a new world."""
    options = {"find_unused_parameters": ddp.find_unused_parameters,
               "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
               "bucket_cap_mb": ddp.bucket_bytes_cap / (1 << 20)}
    if ddp.device_ids:
        options["device_ids"] = ddp.device_ids
    return options


def init_process_group(*args, **kwargs) -> None:
    """torch.distributed.init_process_group for a script that also runs as a warm spare: on a spare
    (FORESHOCK_ROLE=spare) it does nothing, since a spare joins a world only when it takes a rank."""
    if os.environ.get("FORESHOCK_ROLE", "rank") == "spare":
        return
    dist.init_process_group(*args, **kwargs)


def _fault_point(name: str) -> None:
    """Fault injection for the proof tests and the demo: FORESHOCK_MIGRATOR_FAULT=<name> makes this
    process kill itself here (SIGKILL, no clean-up). spare_dies_in_transfer: a spare, after the first
    message of the state arrives; leaving_dies_in_transfer: a leaving rank, in the transfer group,
    before it sends its own state."""
    if os.environ.get("FORESHOCK_MIGRATOR_FAULT") == name:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def _transfer_fault_hook(message: int, total: int) -> None:
    _fault_point("spare_dies_in_transfer")


def _agreement_hook(mig, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP communication hook: the default sum-then-average, with the agreement vector riding along in
    bucket 0 when its dtype keeps the control values exact."""
    buf = bucket.buffer()
    mig._times.mark_compute(buf)
    world = mig.world_size
    exact = buf.dtype == torch.float64 or (buf.dtype == torch.float32 and world <= MAX_EXACT_WORLD)
    if bucket.index() != 0 or not exact:
        fut = dist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(world))
    ctrl, cand = mig._control_for_hook()
    ext = torch.cat([buf, torch.tensor(ctrl, dtype=buf.dtype, device=buf.device)])
    n = buf.numel()
    fut = dist.all_reduce(ext, async_op=True).get_future()

    def done(f):
        out = f.value()[0]
        mig._summed = out[n:].tolist()
        mig._summed_cand = cand
        return buf.copy_(out[:n]).div_(world)

    return fut.then(done)


class StoreDirectiveSource:
    """Directives published in the job's own TCPStore (by a launcher, an operator tool, a benchmark):
    `publish_directive(store, job_id, directive)`; acknowledgements are kept in `acks` and mirrored to
    the store. A source for jobs without a control plane, and for measuring the switch without gRPC."""

    def __init__(self, store, job_id: str) -> None:
        self._store = store
        self._p = f"foreshock/{job_id}/directives/"
        self._seen = 0
        self.acks: list[Ack] = []

    def poll(self) -> list[Directive]:
        try:
            count = self._store.add(f"{self._p}count", 0)
            out = []
            while self._seen < count:
                raw = json.loads(self._store.get(f"{self._p}{self._seen}"))
                self._seen += 1
                raw["kind"] = DirectiveKind(raw["kind"])
                raw["ranks"] = tuple(raw["ranks"])
                out.append(Directive(**raw))
            return out
        except Exception as exc:  # noqa: BLE001
            log.warning("store directive source: %r", exc)
            return []

    def ack(self, ack: Ack) -> None:
        self.acks.append(ack)
        try:
            self._store.set(f"{self._p}ack/{ack.directive_id}/{ack.phase.value}",
                            json.dumps(dataclasses.asdict(ack), default=lambda v: v.value))
        except Exception as exc:  # noqa: BLE001
            log.warning("store directive source ack: %r", exc)

    def close(self) -> None:
        pass


def publish_directive(store, job_id: str, directive: Directive) -> None:
    p = f"foreshock/{job_id}/directives/"
    raw = dataclasses.asdict(directive)
    raw["kind"] = directive.kind.value
    index = store.add(f"{p}next", 1) - 1
    store.set(f"{p}{index}", json.dumps(raw))
    store.add(f"{p}count", 1)
