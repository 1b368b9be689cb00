"""Free loopback ports for suites whose services each take one metrics port (base + index)."""

from __future__ import annotations

import socket


def free_port_range(n: int = 4) -> int:
    """A port N with N..N+n-1 all free on loopback (bound and released together, so none is taken)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + n >= 65536:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")
