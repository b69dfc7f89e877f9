"""The Ray cluster agl starts itself, when no cluster is named: reachable from this machine only.

A run that names no cluster (no ``address`` in ``ray_kwargs.ray_init``, no ``RAY_ADDRESS``) starts
Ray on this machine. Left to itself, Ray 2.60 binds its GCS, raylet, workers and agents to every
interface, and writes a token for its authentication to ``~/.ray/auth_token``, which the default
umask leaves readable by every user of the machine. Here:

- every process of the cluster listens on 127.0.0.1: Ray binds to loopback when the node's address
  is 127.0.0.1, which ``ray.init`` allows only where ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is off
  (Ray's macOS default; elsewhere it replaces 127.0.0.1 by the machine's address);
- its token is a fresh one in the process environment (``RAY_AUTH_TOKEN``, which only this user can
  read), never a file, so other users of the machine cannot use loopback to run code as this user.

Joining a cluster (``RAY_ADDRESS=<head>:6379``, or ``address=``) changes nothing: how that cluster
listens and authenticates is the choice made with ``ray start`` (docs/cluster.md). A head on
127.0.0.1 (nodes on one machine) is dialled there, not at the machine's own address.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Generator
from contextlib import contextmanager
from unittest import mock

LOOPBACK = "127.0.0.1"
CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Off, ``ray.init`` keeps a node address of 127.0.0.1 (on, it dials the machine's own address)."""
AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""Ray's own settings for token authentication; where the user set any, agl sets none."""


def cluster_address(address: str | None) -> str | None:
    """The cluster ``ray.init(address=address)`` joins: ``address``, else ``RAY_ADDRESS``; None
    where it starts one (no address, or ``"local"``)."""
    given = address or os.environ.get("RAY_ADDRESS") or None
    return None if given in (None, "local") else given


def on_loopback(address: str) -> bool:
    """Whether a cluster address (``host:port``, or ``ray://host:port``) names 127.0.0.1 or localhost."""
    host = address.removeprefix("ray://").rpartition(":")[0] or address
    return host in (LOOPBACK, "localhost")


@contextmanager
def loopback_only() -> Generator[None]:
    """Around ``ray.init`` of a cluster on loopback: 127.0.0.1 stays 127.0.0.1, as a node's address
    (``_node_ip_address``) or a head's. The switch reaches the Ray processes started meanwhile
    through the environment (each reads it when it imports Ray) and this process through Ray's
    constant, which it read at its import; both are restored afterwards, since a cluster joined
    later in this process must be dialled at its real address.
    """
    from ray._private import ray_constants

    before = os.environ.get(CLUSTER_SWITCH)
    os.environ[CLUSTER_SWITCH] = "0"
    try:
        with mock.patch.object(ray_constants, "ENABLE_RAY_CLUSTER", False):
            yield
    finally:
        if before is None:
            del os.environ[CLUSTER_SWITCH]
        else:
            os.environ[CLUSTER_SWITCH] = before


def use_run_token() -> None:
    """Give the cluster ``ray.init`` starts a fresh token, kept in this process's environment (and
    so in the environment of the Ray processes it starts), unless the user set any of
    :data:`AUTH_VARIABLES`. ``ray.init`` turns token authentication on for a cluster it starts,
    and finding a token, writes none to ``~/.ray``."""
    if any(name in os.environ for name in AUTH_VARIABLES):
        return
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


__all__ = (
    "AUTH_VARIABLES",
    "CLUSTER_SWITCH",
    "LOOPBACK",
    "cluster_address",
    "loopback_only",
    "on_loopback",
    "use_run_token",
)
