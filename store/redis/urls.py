"""Redis URLs: the schemes taken, a cluster's seed list, and a URL fit to print (no password)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

_SCHEMES = ("redis", "rediss", "unix")


def seed_urls(url: str) -> list[str]:
    """The nodes a URL names. A Redis Cluster URL may name several seeds, as in
    ``redis://:pw@h1:7000,h2:7001``: a client starting while one of them is down (a failed
    primary) reaches the cluster through another. Each seed gets the shared user, password,
    path and query; a URL of one host is returned as it is."""
    scheme, sep, rest = url.partition("://")
    ends = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    end = min(ends, default=len(rest))
    user, at, hosts = rest[:end].rpartition("@")
    if not sep or "," not in hosts:
        return [url]
    return [f"{scheme}://{user}{at}{host}{rest[end:]}" for host in hosts.split(",")]


def _join_seeds(urls: list[str]) -> str:
    """The inverse of :func:`seed_urls` for URLs that differ only in host and port."""
    first = urlsplit(urls[0])
    hosts = [urlsplit(u).netloc.rpartition("@")[2] for u in urls]
    user = first.netloc.rpartition("@")[0]
    netloc = ",".join(hosts) if not user else f"{user}@{','.join(hosts)}"
    return urlunsplit(first._replace(netloc=netloc))


def redact_url(url: str) -> str:
    """``url`` with its password (and a lone username-as-password) replaced by ``***``: what
    every message, log line and report prints instead of the URL itself."""
    seeds = seed_urls(url)
    if len(seeds) > 1:
        return _join_seeds([redact_url(seed) for seed in seeds])
    try:
        parts = urlsplit(url)
        if parts.password is None and not (parts.username and parts.scheme in _SCHEMES):
            return url
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        user = (parts.username or "") if parts.password is not None else ""
        netloc = f"{user}:***@{host}"
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparseable Redis URL>"


def check_redis_url(url: str) -> str:
    """Refuse a URL redis-py would misread (``redis://h/abc`` silently meant db 0); the
    error names the problem, never the password. Every seed of a cluster URL is checked."""
    seeds = seed_urls(url)
    if len(seeds) > 1:
        for seed in seeds:
            check_redis_url(seed)
        return url
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {shown}: {exc}") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"invalid Redis URL {shown}: scheme must be one of {list(_SCHEMES)}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"invalid Redis URL {shown}: unix:// needs a socket path")
        return url
    if not parts.hostname:
        raise ValueError(f"invalid Redis URL {shown}: no host")
    if port == 0:
        raise ValueError(f"invalid Redis URL {shown}: port 0")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"invalid Redis URL {shown}: database {db!r} is not a number")
    return url
