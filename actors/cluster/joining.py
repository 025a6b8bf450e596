"""How a process joins Ray: a private local cluster, or an existing one as clusters are made.

Ray (2.5x on) turns token authentication on by default for a cluster that ``ray start`` or a
local ``ray.init()`` makes, and writes the token to ``~/.ray/auth_token``. A process that
*joins* such a cluster by address sends the token only when ``RAY_AUTH_MODE=token`` is set, so
``ray.init(address=...)`` from a plain shell failed after ~20 s with ``InvalidAuthToken``. A
joining process here sets that mode itself when a token is at hand (a token sent to a cluster
without authentication is ignored there), refuses an address where nothing answers at once
instead of after Ray's 60 s of retries, and turns Ray's connection failure into a
:class:`~bus.errors.ConfigError` that says what to do.

The token is never written to Redis: the namespace's owner record says only *that* the
deployment's cluster wants one (:class:`~store.domain.ownership.RayAuth`).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import ray

from actors.cluster.refs import RAY_NAMESPACE
from bus.errors import ConfigError
from store.domain.ownership import RayAuth

__all__ = ["ensure_ray", "gcs_address", "ray_auth", "ray_cluster_id", "token_at_hand"]

#: Ray's own variables: the mode, the token itself, and a file holding it.
AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
#: Seconds a joining process waits for a TCP answer at the cluster's address.
PROBE_S = 3.0
#: Where to read about a cluster that wants a token.
TOKEN_HELP = (
    "copy ~/.ray/auth_token from the cluster's head node to this machine, or set "
    f"${AUTH_TOKEN} (or ${AUTH_TOKEN_PATH}); see https://docs.ray.io/en/latest/ray-security/"
    "token-auth.html"
)


def token_at_hand() -> bool:
    """Whether this process has a Ray token to send: the variable, the file it names, or
    Ray's default file."""
    if os.environ.get(AUTH_TOKEN, "").strip():
        return True
    named = os.environ.get(AUTH_TOKEN_PATH)
    path = Path(named).expanduser() if named else Path.home() / ".ray" / "auth_token"
    try:
        return bool(path.read_text(encoding="utf-8").strip())
    except OSError:
        return False


def ensure_ray(address: str | None = None, *, auth: RayAuth | None = None) -> bool:
    """Start a private local Ray (or join ``address``) unless one is up; True if this started
    it. Without an address Ray is started, never joined: ``ray.init()`` alone would join any
    cluster ``ray start`` left on the machine, and leave this deployment (its Redis password
    included) in someone else's cluster. ``auth`` is what the deployment's owner record says
    its cluster wants (None: unknown)."""
    if ray.is_initialized():
        return False
    if address is not None:
        _prepare_join(address, auth)
    try:
        ray.init(
            address=address or "local",
            namespace=RAY_NAMESPACE,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    except ConnectionError as exc:
        raise ConfigError(
            f"cannot join the Ray cluster at {address}: {exc}. If it uses token "
            f"authentication (ray start does by default): {TOKEN_HELP}"
        ) from None
    return address is None


def _prepare_join(address: str, auth: RayAuth | None) -> None:
    """Send the token when there is one (Ray's mode left as the user set it), refuse at once
    an address where nothing answers, or a token cluster without a token at hand."""
    if os.environ.get(AUTH_MODE) is None and token_at_hand():
        os.environ[AUTH_MODE] = "token"
        # Ray's native config read the variable when ray was imported: read it again (what
        # Ray's own ``ray start --head`` does when it turns token mode on).
        ray._raylet.Config.initialize("")  # type: ignore[attr-defined]
    if auth is RayAuth.TOKEN and not token_at_hand():
        raise ConfigError(
            f"the Ray cluster at {address} wants its token and none is here: {TOKEN_HELP}"
        )
    if address == "auto":
        return  # Ray's own lookup of the machine's current cluster
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=PROBE_S):
            pass
    except (OSError, ValueError):
        raise ConfigError(
            f"no Ray cluster answers at {address}: it stopped, or the address is stale (a "
            "private Ray of phaseline serve changes port at each start); run phaseline serve, "
            "or give the address it prints with --ray-address"
        ) from None


def gcs_address() -> str:
    """The address others join this process's Ray cluster at."""
    return str(ray.get_runtime_context().gcs_address)


def ray_cluster_id() -> str:
    """This process's Ray cluster: its GCS address and session name (a new session each time a
    cluster starts, so two clusters at one address differ)."""
    return f"{gcs_address()} {ray.get_runtime_context().get_session_name()}"


def ray_auth() -> RayAuth:
    """How the Ray cluster this process is connected to authenticates (the mode Ray runs
    with: a cluster that wants a token made this process send one)."""
    return RayAuth.TOKEN if os.environ.get(AUTH_MODE, "").lower() == "token" else RayAuth.NONE
