"""Network addresses as the components name them (HOST:PORT, [IPv6]:PORT, or a bare host), and the
client side of a gRPC channel to the control plane: TLS credentials, the rule that plaintext is for
loopback only, the bearer token. The collectors' uplink, the migrator's client and the demo all open
their channels through `Endpoint`; what differs between them (channel options, deadlines on calls)
stays with each caller."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT names this machine only (localhost or a loopback IP): the one case where the
    collectors, the migrator and the service allow a channel or a listener without TLS."""
    host = (address.rsplit(":", 1)[0] if ":" in address else address).strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PlaintextRefused(ValueError):
    """A channel without TLS to an address that is not this machine's."""


def client_credentials(tls) -> grpc.ChannelCredentials | None:
    """`tls` as the clients take it: None or "" (plaintext), a CA file, (ca, cert, key) files for mutual
    TLS (cert and key may be None), or grpc.ChannelCredentials as they are. The files are read now; one
    that cannot be read raises OSError, whose filename and strerror say which and why."""
    if tls is None or tls == "":
        return None
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    if isinstance(tls, (str, os.PathLike)):
        tls = (tls, None, None)
    ca, cert, key = tls

    def read(path):
        return Path(path).read_bytes() if path else None
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


@dataclass(frozen=True)
class Endpoint:
    """A control plane's address and how a client reaches it. Built once (a plaintext endpoint to
    another machine is refused here, before any channel exists); `open()` gives a new channel."""

    target: str                                         # HOST:PORT
    credentials: grpc.ChannelCredentials | None = None  # None: plaintext
    options: tuple = ()                                 # grpc channel arguments, (name, value) pairs
    token: str | None = field(default=None, repr=False)  # sent as `authorization: Bearer TOKEN`

    def __post_init__(self):
        if self.credentials is None and not is_loopback(self.target):
            raise PlaintextRefused(f"{self.target}: plaintext is allowed to loopback addresses only")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata every call to the endpoint carries."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def open(self) -> grpc.Channel:
        if self.credentials is not None:
            return grpc.secure_channel(self.target, self.credentials, options=list(self.options))
        return grpc.insecure_channel(self.target, options=list(self.options))
