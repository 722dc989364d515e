"""A rendezvous port for tests that start two launches (`--nnodes 2`) which must agree on
`--master-port` before either of them binds it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 20000  # below this, ports that well-known services tend to claim


def _ephemeral_low() -> int:
    """The start of the kernel's ephemeral range: bind(0) and connect() only take ports from it."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def rendezvous_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that no other process is handed by the kernel meanwhile.

    A port from bind(0) that is closed again is in the ephemeral range: between this check
    and the rendezvous binding it, the kernel may give it to any process that binds port 0 or
    connects out, a second test run beside this one included. Below that range a port is only
    taken by a process that names it; a random one makes two runs beside each other pick the same
    one only by a 1-in-thousands chance, and then the check below sees it taken."""
    rng = random.SystemRandom()
    high = max(_ephemeral_low(), _LOWEST + 1000)
    for _ in range(200):
        port = rng.randrange(_LOWEST, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in [{_LOWEST}, {high}) on {host}")
