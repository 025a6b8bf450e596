"""The web console served for real (uvicorn on a free port, in a thread of this process)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from actors.console import ConsoleSettings, console_app
from actors.console.probes import served
from actors.engine.settings.config import Settings


@contextmanager
def serving(
    redis_url: str,
    namespace: str,
    *,
    token: str | None = None,
    shards: int = 16,
    ray_address: str | None = None,
    allowed_hosts: tuple[str, ...] = (),
) -> Iterator[str]:
    """The console of ``namespace`` on ``redis_url`` (attached to the deployment on the Ray
    cluster at ``ray_address``, if given); yields its base URL."""
    settings = Settings.model_validate({"redis": {"namespace": namespace, "shards": shards}})
    app = console_app(
        settings,
        ConsoleSettings(
            redis_url=redis_url, token=token, ray_address=ray_address, allowed_hosts=allowed_hosts
        ),
    )
    with served(app) as url:
        yield url
