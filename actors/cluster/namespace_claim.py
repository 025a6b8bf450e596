"""Claiming a namespace for a deployment on Ray (``store.domain.ownership`` holds the lease): who
owns it, who attaches as a client, who may stop it."""

from __future__ import annotations

from actors.cluster.deployment import Deployment
from actors.cluster.joining import ray_auth, ray_cluster_id
from actors.cluster.refs import named
from store.domain.ownership import ClaimOutcome, Holder, NamespaceOwner
from store.redis.connection import StoreClient

__all__ = ["claim_namespace", "may_stop"]


async def claim_namespace(client: StoreClient, dep: Deployment) -> Holder | None:
    """Claim ``dep``'s namespace for this process: its claim when it owns the deployment now,
    None when this Ray cluster's deployment runs it under a live owner (attach as a client).
    A deployment whose supervisor is gone, or whose owner process is gone, is taken over."""
    owners = NamespaceOwner(client, dep.keys, ttl_s=dep.settings.supervisor.owner_ttl_s)
    me = Holder.me(ray_cluster_id(), ray_auth())
    result = await owners.claim(me)
    if result.claim is ClaimOutcome.ACQUIRED:
        return me
    running = named(dep.name("supervisor")) is not None
    if running and not result.holder.is_gone():
        return None
    again = await owners.claim(me, replacing=result.holder.owner)
    return me if again.claim is ClaimOutcome.ACQUIRED else None


def may_stop(owner: Holder | None, holder: Holder | None) -> bool:
    """Whether a runtime holding ``owner`` (its claim, None for a client) may stop the
    deployment whose namespace ``holder`` holds now: it holds the owner token, or runs in the
    owning process (a runtime that attached in the process that started it), or started it
    and the lease lapsed with no one else claiming it."""
    if holder is None:
        return owner is not None
    mine = owner is not None and holder.owner == owner.owner
    return mine or holder.is_this_process()
