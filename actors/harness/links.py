"""The links between a chaos run's hosts and the world outside, with proxies a fault can cut.

For the target ``provider``, one :class:`~actors.harness.provider_proxy.ProviderProxy` stands
in front of the model endpoint that ``OPENAI_BASE_URL`` names, and every process of the run
(the hosts, and this one for the fault-free reference) is pointed at it instead. For the
target ``partition``, each host slot gets a :class:`~actors.harness.tcp_proxy.TcpProxy` of
its own to Redis and, when the turns call a model over HTTP, one to the model endpoint (the
provider proxy, when there is one): a fault cuts one of them, and one host loses that link
while the rest of the deployment keeps it (``actors.cluster.deployment.HostRoute``). Each slot
has the links of :data:`MACHINES` machines, taken in turn by its generations: a host replaced
while cut off has its successor on another machine, as a supervisor places it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from actors.cluster.deployment import HostRoute
from actors.harness.provider_proxy import Latency, ProviderProxy
from actors.harness.targets import ChaosTarget
from actors.harness.tcp_proxy import ProxyLoop, TcpProxy
from bus.errors import ConfigError

__all__ = ["MACHINES", "PROVIDER_LATENCY", "HostLinks", "Links", "outside_links", "via_port"]

#: The machines (each with its own links) a host slot's generations take in turn.
MACHINES = 2

#: The model endpoint's answer time while the target ``provider`` stands in front of it: a
#: median of 200 ms, one call in twenty past 2.7 times that.
PROVIDER_LATENCY = Latency(median_ms=200.0, sigma=0.6)

#: The variable an HTTP agent's model reads its endpoint from
#: (``actors.engine.models.openai_chat``).
BASE_URL_ENV = "OPENAI_BASE_URL"


@dataclass(frozen=True, slots=True)
class HostLinks:
    """The links of one machine a host slot's generations run on."""

    redis: TcpProxy
    """To Redis."""
    model: TcpProxy | None
    """To the model endpoint; None when the turns call none over HTTP."""


@dataclass(slots=True)
class Links:
    """The proxies of one run."""

    loop: ProxyLoop
    """Where they relay."""
    provider: ProviderProxy | None = None
    """In front of the model endpoint (target ``provider``)."""
    hosts: list[tuple[HostLinks, ...]] = field(default_factory=list)
    """Per host slot, the isolation slot last, its machines' links (target ``partition``)."""
    redis_url: str = ""
    """The Redis the hosts' links lead to."""
    model_path: str = ""
    """The model endpoint's base path (``/v1``)."""

    def of(self, slot: int, generation: int) -> HostLinks:
        """The links generation ``generation`` of host ``slot`` runs behind."""
        machines = self.hosts[slot]
        return machines[generation % len(machines)]

    def routes(self, slots: int) -> list[tuple[HostRoute, ...]]:
        """How each of ``slots`` host slots' generations reach Redis and the model: through
        their machine's links, else through the provider proxy (named in each host's own
        environment: a Ray node started before this run's links lacks it)."""
        return [
            tuple(self._route(m) for m in self.hosts[slot])
            if slot < len(self.hosts)
            else (self._route(None),)
            for slot in range(slots)
        ]

    def model_route(self) -> HostRoute:
        """How the model workers reach the model: through the provider proxy, if any (a
        partition cuts hosts, not the workers that make their model calls)."""
        return self._route(None)

    def _route(self, host: HostLinks | None) -> HostRoute:
        env = {}
        if host is not None and host.model is not None:
            env[BASE_URL_ENV] = f"http://{host.model.address}{self.model_path}"
        elif self.provider is not None:
            env[BASE_URL_ENV] = self.provider.base_url
        redis = None if host is None else via_port(self.redis_url, host.redis.port)
        return HostRoute(redis_url=redis, env=env)

    def close(self) -> None:
        for host in (m for machines in self.hosts for m in machines):
            host.redis.close()
            if host.model is not None:
                host.model.close()
        if self.provider is not None:
            self.provider.close()
        self.loop.close()


@contextlib.contextmanager
def outside_links(
    targets: Sequence[ChaosTarget], *, redis_url: str, slots: int, http: bool, seed: int
) -> Iterator[Links | None]:
    """The links ``targets`` need (None: none), for ``slots`` host slots reaching
    ``redis_url``; ``http``: the turns call the model endpoint ``OPENAI_BASE_URL`` names.
    While they exist, ``OPENAI_BASE_URL`` names the provider proxy."""
    provider, partition = ChaosTarget.PROVIDER in targets, ChaosTarget.PARTITION in targets
    if not (provider or partition):
        yield None
        return
    upstream = os.environ.get(BASE_URL_ENV, "")
    if provider and not upstream:
        raise ConfigError(
            f"the provider target stands in front of the model endpoint ${BASE_URL_ENV} names; "
            "it is not set"
        )
    links = Links(ProxyLoop(), redis_url=redis_url)
    try:
        if provider:
            links.provider = ProviderProxy(
                links.loop, upstream, latency=PROVIDER_LATENCY, seed=seed
            )
            upstream = links.provider.base_url
        model = urlsplit(upstream) if http and upstream else None
        if model is not None:
            links.model_path = model.path.rstrip("/")
        if partition:
            redis_at = urlsplit(redis_url)
            if not redis_at.hostname or not redis_at.port:
                raise ConfigError("the partition target needs Redis on a TCP port, not a socket")
            for _ in range(slots):
                machines = []
                for _ in range(MACHINES):
                    to_model = None
                    if model is not None and model.hostname:
                        to_model = TcpProxy(links.loop, (model.hostname, model.port or 80))
                    to_redis = TcpProxy(links.loop, (redis_at.hostname, redis_at.port))
                    machines.append(HostLinks(to_redis, to_model))
                links.hosts.append(tuple(machines))
        with _env(BASE_URL_ENV, links.provider.base_url if links.provider else None):
            yield links
    finally:
        links.close()


def via_port(url: str, port: int) -> str:
    """``url`` with its host and port replaced by the loopback proxy's (its user, password,
    database and query kept)."""
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    netloc = f"{user}@127.0.0.1:{port}" if user else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """``name`` set to ``value`` (None: left as it is) until the block ends."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
