"""Configuration of the in-job migrator: arguments, else FORESHOCK_* environment variables, else torchrun's.

The launcher passes the job's identity the way torchrun passes its own (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): FORESHOCK_SERVICE (host:port of the control plane's Jobs API), FORESHOCK_JOB_ID (falls
back to torchrun's TORCHELASTIC_RUN_ID, the --rdzv-id), FORESHOCK_RANK (falls back to RANK),
FORESHOCK_WORLD_SIZE (falls back to WORLD_SIZE), FORESHOCK_NODE (the node this process runs on; falls
back to the host name), FORESHOCK_ROLE (`rank` or `spare`), FORESHOCK_TOKEN (the job's bearer
credential), FORESHOCK_STORE (host:port of the job's rendezvous store; falls back to
MASTER_ADDR:MASTER_PORT, under torchrun a store of rank 0's agent on a port chosen at start), FORESHOCK_SPARE_NODES
(comma-separated) and FORESHOCK_FALLBACK (`shrink` or `checkpoint_exit`). An argument given explicitly
wins over the environment. A bad value raises MigratorConfigError naming the variable; this happens before training
starts, never inside the loop.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping

FALLBACKS = ("shrink", "checkpoint_exit")
ROLES = ("rank", "spare")


class MigratorConfigError(ValueError):
    """A migrator setting that cannot be used; the message names the setting and where it came from."""


@dataclasses.dataclass(frozen=True)
class MigratorConfig:
    job_id: str
    node: str
    store: str                       # host:port of the job's TCPStore (not on a node that may be evacuated)
    role: str = "rank"
    rank: int = -1                   # -1 for a spare until it is given a rank
    world_size: int = 0
    service: str = ""                # HOST:PORT[,HOST:PORT]; empty: no control plane (directives only from a
    #                                  local source)
    token: str = ""
    tls_ca: str = ""                 # PEM file of the CA; empty with a loopback address: insecure
    spare_nodes: tuple[str, ...] = ()
    fallback: str = "shrink"
    checkpoint_dir: str = ""
    host_store: bool = False         # this process hosts the store (tests and the demo host it in the launcher)
    rpc_timeout_s: float = 2.0       # deadline of every unary call to the service
    transfer_timeout_s: float = 60.0  # bound on group formation and state transfer during a switch
    standby_poll_s: float = 30.0      # a waiting spare checks this often whether the job ended unreleased
    report_interval_s: float = 5.0    # how often the coordinator reports its step to the service
    step_report_interval_s: float = 5.0   # longest a block of step times lasts before it is sent (fail-slow)
    spare_heartbeat_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.job_id:
            raise MigratorConfigError("job_id (FORESHOCK_JOB_ID, else torchrun's TORCHELASTIC_RUN_ID) "
                                      "is required")
        if self.role not in ROLES:
            raise MigratorConfigError(f"role (FORESHOCK_ROLE) must be one of {ROLES}, got {self.role!r}")
        if self.fallback not in FALLBACKS:
            raise MigratorConfigError(f"fallback (FORESHOCK_FALLBACK) must be one of {FALLBACKS}, "
                                      f"got {self.fallback!r}")
        if self.role == "rank" and not (0 <= self.rank < self.world_size):
            raise MigratorConfigError(f"rank {self.rank} (FORESHOCK_RANK/RANK) is not in "
                                      f"[0, world size {self.world_size}) (FORESHOCK_WORLD_SIZE/WORLD_SIZE)")
        _split_address("store (FORESHOCK_STORE or MASTER_ADDR:MASTER_PORT)", self.store)
        for address in self.services:
            _split_address("service (FORESHOCK_SERVICE)", address)
        for name in ("rpc_timeout_s", "transfer_timeout_s", "standby_poll_s", "report_interval_s",
                     "step_report_interval_s", "spare_heartbeat_s"):
            if not getattr(self, name) > 0:
                raise MigratorConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not self.step_report_interval_s <= 3600:
            raise MigratorConfigError(f"step_report_interval_s (FORESHOCK_STEP_REPORT_INTERVAL_S) must be "
                                      f"at most 3600 s, got {self.step_report_interval_s!r}")

    @property
    def services(self) -> tuple[str, ...]:
        """The control plane's addresses: HOST:PORT, or several, comma-separated (a jobs coordinator and
        its standby, tried in turn while one answers UNAVAILABLE)."""
        return tuple(a.strip() for a in self.service.split(",") if a.strip())

    @property
    def store_host(self) -> str:
        return _split_address("store", self.store)[0]

    @property
    def store_port(self) -> int:
        return _split_address("store", self.store)[1]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> MigratorConfig:
        """Settings from FORESHOCK_* (then torchrun's) environment variables; keyword arguments win."""
        env = os.environ if env is None else env

        def pick(key: str, *names: str, default=None):
            if overrides.get(key) is not None:
                return overrides[key], f"argument {key}"
            for name in names:
                if env.get(name, "") != "":
                    return env[name], f"environment variable {name}"
            return default, "default"

        def as_int(key: str, *names: str, default: int) -> int:
            value, origin = pick(key, *names, default=default)
            try:
                return int(value)
            except (TypeError, ValueError):
                raise MigratorConfigError(f"{key} from {origin}: expected an integer, got {value!r}") from None

        def as_float(key: str, name: str, default: float) -> float:
            value, origin = pick(key, name, default=default)
            try:
                return float(value)
            except (TypeError, ValueError):
                raise MigratorConfigError(f"{key} from {origin}: expected a number, got {value!r}") from None

        store, _ = pick("store", "FORESHOCK_STORE")
        if store is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            store = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        spares, _ = pick("spare_nodes", "FORESHOCK_SPARE_NODES", default=())
        if isinstance(spares, str):
            spares = tuple(s.strip() for s in spares.split(",") if s.strip())
        host_store, _ = pick("host_store", "FORESHOCK_HOST_STORE", default=False)
        if isinstance(host_store, str):
            host_store = host_store.strip().lower() in ("1", "true", "yes", "on")
        role = pick("role", "FORESHOCK_ROLE", default="rank")[0]
        return cls(
            job_id=pick("job_id", "FORESHOCK_JOB_ID", "TORCHELASTIC_RUN_ID", default="")[0],
            node=pick("node", "FORESHOCK_NODE", default=socket.gethostname())[0],
            store=store or "",
            role=role,
            rank=as_int("rank", "FORESHOCK_RANK", "RANK", default=-1),
            world_size=as_int("world_size", "FORESHOCK_WORLD_SIZE", "WORLD_SIZE", default=0),
            service=pick("service", "FORESHOCK_SERVICE", default="")[0],
            token=pick("token", "FORESHOCK_TOKEN", default="")[0],
            tls_ca=pick("tls_ca", "FORESHOCK_TLS_CA", default="")[0],
            spare_nodes=tuple(spares),
            fallback=pick("fallback", "FORESHOCK_FALLBACK", default="shrink")[0],
            checkpoint_dir=pick("checkpoint_dir", "FORESHOCK_CHECKPOINT_DIR", default="")[0],
            host_store=bool(host_store),
            rpc_timeout_s=as_float("rpc_timeout_s", "FORESHOCK_RPC_TIMEOUT_S", 2.0),
            transfer_timeout_s=as_float("transfer_timeout_s", "FORESHOCK_TRANSFER_TIMEOUT_S", 60.0),
            standby_poll_s=as_float("standby_poll_s", "FORESHOCK_STANDBY_POLL_S", 30.0),
            report_interval_s=as_float("report_interval_s", "FORESHOCK_REPORT_INTERVAL_S", 5.0),
            step_report_interval_s=as_float("step_report_interval_s", "FORESHOCK_STEP_REPORT_INTERVAL_S", 5.0),
            spare_heartbeat_s=as_float("spare_heartbeat_s", "FORESHOCK_SPARE_HEARTBEAT_S", 0.5),
        )


def _split_address(what: str, address: str) -> tuple[str, int]:
    host, sep, port = (address or "").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MigratorConfigError(f"{what}: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)
