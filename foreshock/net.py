"""Network addresses as the components name them (HOST:PORT, [IPv6]:PORT, or a bare host)."""

from __future__ import annotations

import ipaddress


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
