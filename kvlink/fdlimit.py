"""The process's file-descriptor limit (RLIMIT_NOFILE) against what a server of many connections needs.

Below what its caps allow, a cap protects nothing: accepting or connecting fails for want of descriptors
first, for everyone in the process. Used by the bootstrap server (``max_connections``) and the transport
engine (``max_conns`` served, ``max_peers`` x ``streams`` connected).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def fd_room(need: int, *, raise_soft: bool = False) -> int | None:
    """None if this process may open ``need`` descriptors, else the soft limit it has. ``raise_soft``: first
    raise the soft limit as far as needed and the hard limit allows (a process that owns its limits; a
    library embedded in another leaves them alone, as a raised limit breaks select() on descriptors past
    1,024)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    if raise_soft:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError) as err:
                log.debug("cannot raise RLIMIT_NOFILE to %d: %s", target, err)
    return None if soft >= need else soft
