"""One deployment per namespace: who owns it, held as a lease in Redis.

Two deployments of one namespace (two Ray clusters on one Redis, or a second ``serve``) would
run the same turns side by side: fencing keeps that safe, but every turn's work is done twice
and each deployment's shutdown stops the other's turns. So a deployment claims the namespace
(``KeyLayout.owner``, a hash with a time to live) before it starts any actor::

    {ns}:{global}:owner   hash   cluster (Ray cluster id), owner (token of the process that
                                 may stop it), host, pid, command, since (ms), auth (how its
                                 Ray cluster authenticates: never the secret itself)

* :meth:`NamespaceOwner.claim` takes a free namespace, or tells who holds it. A process of the
  same Ray cluster finds the deployment running and attaches to it as a client; one of another
  cluster is refused (:class:`~bus.errors.NamespaceHeld`) until the holder's lease lapses.
* The deployment's Supervisor renews the lease (:meth:`NamespaceOwner.renew`) for as long as it
  runs, so the namespace stays held after the process that started it exits; a Supervisor that
  finds another cluster holding it stops its deployment.
* A client finds the deployment here (:meth:`Holder.ray_address`): ``submit``, ``status``,
  ``watch``, ``ui`` and ``cancel`` attach without being told where Ray is.
* Only the owner token's holder stops the actors and releases the lease
  (:meth:`NamespaceOwner.release`). The owner of a deployment whose owning process is gone (same
  host, pid not running) may be replaced by a new process of that cluster (a takeover).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum

from bus.errors import NamespaceHeld, PhaselineError, RecordError
from store.keys import KeyLayout
from store.lua import lua_script
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import answer, text

__all__ = [
    "ClaimOutcome",
    "ClaimResult",
    "Holder",
    "NamespaceOwner",
    "RayAuth",
    "holding",
    "pid_running",
]

log = logging.getLogger(__name__)

#: The cluster id prefix of a process that runs turns itself, without a Ray deployment.
IN_PROCESS = "in-process:"


class RayAuth(StrEnum):
    """How a deployment's Ray cluster authenticates a process that joins it."""

    TOKEN = "token"
    """Ray's token authentication (``ray start`` turns it on by default): a client needs the
    cluster's token (``$RAY_AUTH_TOKEN``, the file ``$RAY_AUTH_TOKEN_PATH`` names, or
    ``~/.ray/auth_token`` copied from the head node)."""
    NONE = "none"
    """None: anyone who reaches the cluster's address joins it."""
    IN_PROCESS = ""
    """No Ray cluster: the holder runs its turns in its own process."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a namespace."""

    cluster: str
    """Its Ray cluster (``<GCS address> <session>``), or ``in-process:<host>:<pid>``."""
    owner: str
    """The token of the process that may stop the deployment."""
    host: str
    """The owning process's host name."""
    pid: int
    """The owning process's pid."""
    command: str
    """What it runs (``phaseline serve``, a program's name)."""
    since_ms: int = 0
    """Unix milliseconds of the claim (the server's clock)."""
    auth: RayAuth = RayAuth.IN_PROCESS
    """How its Ray cluster authenticates a client."""

    @property
    def ray_address(self) -> str | None:
        """The GCS address a client joins the deployment's Ray cluster at (None: the holder
        runs its turns in its own process)."""
        if self.cluster.startswith(IN_PROCESS):
            return None
        return self.cluster.split(" ", 1)[0] or None

    @classmethod
    def me(cls, cluster: str, auth: RayAuth = RayAuth.IN_PROCESS) -> Holder:
        """This process, with a new owner token."""
        command = " ".join(
            ["phaseline", *sys.argv[1:2]] if sys.argv[0].endswith("phaseline") else sys.argv[:1]
        )
        return cls(
            cluster,
            uuid.uuid4().hex,
            socket.gethostname(),
            os.getpid(),
            command or "?",
            auth=auth,
        )

    def fields(self) -> list[str | int]:
        return [
            "cluster",
            self.cluster,
            "owner",
            self.owner,
            "host",
            self.host,
            "pid",
            self.pid,
            "command",
            self.command,
            "since",
            self.since_ms,
            "auth",
            self.auth.value,
        ]

    @classmethod
    def parse(cls, key: str, flat: Sequence[bytes | str]) -> Holder:
        """A holder from its fields, flat (field, value, ...) as Redis returns them or
        :meth:`wire` gives them; :class:`~bus.errors.RecordError` naming ``key`` if
        unreadable."""
        fields = {text(k): text(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}
        try:
            return cls(
                cluster=fields["cluster"],
                owner=fields["owner"],
                host=fields["host"],
                pid=int(fields["pid"]),
                command=fields["command"],
                since_ms=int(fields["since"]),
                auth=RayAuth(fields.get("auth", "")),
            )
        except (KeyError, ValueError) as exc:
            raise RecordError(key, f"unreadable namespace owner {fields}: {exc}") from None

    def wire(self) -> list[str]:
        """Its fields as text, flat, for :meth:`parse` in another process."""
        return [str(x) for x in self.fields()]

    def line(self) -> str:
        """The holder for a person."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since_ms / 1000))
        return (
            f"{self.command} (pid {self.pid} on {self.host}, Ray cluster {self.cluster}) "
            f"since {since}"
        )

    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()

    def is_gone(self) -> bool:
        """True if the owning process ran on this host and runs no more."""
        return self.host == socket.gethostname() and not pid_running(self.pid)


class ClaimOutcome(StrEnum):
    """What a claim found."""

    ACQUIRED = "acquired"
    """The claimer owns the namespace now."""
    SAME_CLUSTER = "same_cluster"
    """Its own Ray cluster's deployment holds it: attach as a client."""


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """The answer to a claim."""

    claim: ClaimOutcome
    """Acquired, or held by the claimer's own cluster."""
    holder: Holder
    """Who holds the namespace now."""


def pid_running(pid: int) -> bool:
    """True if a process with this pid runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it runs, as another user
    return True


class NamespaceOwner:
    """Claim, renew, read and release a namespace's ownership."""

    def __init__(self, client: StoreClient, keys: KeyLayout, *, ttl_s: float) -> None:
        self.client = client
        self.keys = keys
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self._claim = client.register_script(lua_script("owner_claim.lua"))
        self._renew = client.register_script(lua_script("owner_renew.lua"))
        self._release = client.register_script(lua_script("owner_release.lua"))

    async def claim(self, me: Holder, *, replacing: str = "") -> ClaimResult:
        """Take the namespace for ``me``, or (``replacing``: that owner token) take over the
        ownership of its own cluster's deployment. :class:`NamespaceHeld` if another Ray
        cluster holds it. A holder that ran turns in its own process on this host, and is
        gone (SIGKILLed), is taken over at once instead of after its lease lapses."""
        reply = await self._claim_script(me, replacing, cross=False)
        key = self.keys.owner()
        if answer(OwnerClaimAnswer, reply, "claim") is OwnerClaimAnswer.ACQUIRED:
            return ClaimResult(ClaimOutcome.ACQUIRED, await self.holder() or me)
        holder = Holder.parse(key, reply[1:])
        if holder.cluster.startswith(IN_PROCESS) and holder.is_gone() and not replacing:
            reply = await self._claim_script(me, holder.owner, cross=True)
            if answer(OwnerClaimAnswer, reply, "claim") is OwnerClaimAnswer.ACQUIRED:
                log.warning(
                    "namespace %r: took it over from %s, which is gone",
                    self.keys.namespace,
                    holder.line(),
                )
                return ClaimResult(ClaimOutcome.ACQUIRED, await self.holder() or me)
            holder = Holder.parse(key, reply[1:])
        if holder.cluster != me.cluster:
            raise self._held(holder)
        return ClaimResult(ClaimOutcome.SAME_CLUSTER, holder)

    async def refuse_if_held(self) -> None:
        """:class:`NamespaceHeld` if anyone but a gone in-process holder (whom a claim takes
        over) holds the namespace: what a claim from a new Ray cluster would answer."""
        holder = await self.holder()
        if holder is not None and not (holder.cluster.startswith(IN_PROCESS) and holder.is_gone()):
            raise self._held(holder)

    def _held(self, holder: Holder) -> NamespaceHeld:
        join = (
            "phaseline submit, status, ui and cancel attach to it by themselves (its Ray "
            "address is in this record)"
            if holder.ray_address
            else "wait for it to finish"
        )
        return NamespaceHeld(
            f"namespace {self.keys.namespace!r} is served by {holder.line()}; {join}, or use "
            "another --namespace",
            holder.line(),
        )

    async def _claim_script(self, me: Holder, replacing: str, *, cross: bool) -> list[bytes | str]:
        with translated(f"claim namespace {self.keys.namespace}"):
            reply = await self._claim(
                keys=[self.keys.owner()],
                args=[
                    me.cluster,
                    me.owner,
                    me.host,
                    me.pid,
                    me.command,
                    self.ttl_ms,
                    replacing,
                    "1" if cross else "0",
                    me.auth.value,
                ],
            )
        return list(reply)

    async def renew(self, cluster: str, last: Holder | None) -> bool:
        """Extend the lease of ``cluster``'s deployment (written back from ``last`` if it
        lapsed); False if another cluster holds the namespace."""
        args: list[str | int] = [cluster, self.ttl_ms, *(last.fields() if last else [])]
        with translated(f"renew namespace {self.keys.namespace}"):
            reply = await self._renew(keys=[self.keys.owner()], args=args)
        return answer(RenewAnswer, reply, "renew") is RenewAnswer.RENEWED

    async def release(self, owner: str) -> bool:
        """Give the namespace up, if ``owner`` holds it."""
        with translated(f"release namespace {self.keys.namespace}"):
            reply = await self._release(keys=[self.keys.owner()], args=[owner])
        return answer(ReleaseAnswer, reply, "release") is ReleaseAnswer.RELEASED

    async def holder(self) -> Holder | None:
        """Who holds the namespace (None: no one)."""
        key = self.keys.owner()
        with translated(f"read the owner of namespace {self.keys.namespace}"):
            raw = await self.client.hgetall(key)
        if not raw:
            return None
        return Holder.parse(key, [x for pair in raw.items() for x in pair])


@contextlib.asynccontextmanager
async def holding(owners: NamespaceOwner, command: str) -> AsyncIterator[Holder]:
    """Hold the namespace for this process while the block runs turns in it (a command that
    runs its turns in process, without a deployment): claimed on entry
    (:class:`NamespaceHeld` if a deployment or another process runs it), renewed every
    quarter of its time to live, released on the way out."""
    me = Holder.me(f"{IN_PROCESS}{socket.gethostname()}:{os.getpid()}")
    me = Holder(me.cluster, me.owner, me.host, me.pid, command)  # auth: in process
    result = await owners.claim(me)
    if result.claim is ClaimOutcome.SAME_CLUSTER:  # this very process holds it already
        yield result.holder
        return

    async def renew() -> None:
        while True:
            await asyncio.sleep(owners.ttl_ms / 4000)  # the renewal period
            try:
                if not await owners.renew(me.cluster, me):
                    log.error(
                        "namespace %r was taken over while this process ran turns in it",
                        owners.keys.namespace,
                    )
                    return
            except PhaselineError as exc:  # Redis away for a moment: the next period retries
                log.warning("cannot renew namespace %r: %s", owners.keys.namespace, exc)

    task = asyncio.ensure_future(renew())
    try:
        yield me
    finally:
        task.cancel()
        with contextlib.suppress(PhaselineError):
            await owners.release(me.owner)


class OwnerClaimAnswer(StrEnum):
    """The first word of what ``owner_claim.lua`` answers."""

    ACQUIRED = "acquired"
    """The claimer owns the namespace now."""
    HELD = "held"
    """Someone else holds it; the holder's fields follow, flat."""


class RenewAnswer(IntEnum):
    """What ``owner_renew.lua`` answers."""

    TAKEN = 0
    """Another cluster holds the namespace: the caller's deployment must stop."""
    RENEWED = 1
    """The lease was extended (or written back, if it had lapsed while no one claimed it)."""


class ReleaseAnswer(IntEnum):
    """What ``owner_release.lua`` answers."""

    NOT_OWNER = 0
    """Someone else holds the namespace; nothing changed."""
    RELEASED = 1
    """The lease was deleted."""
