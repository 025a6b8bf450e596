"""The web console served for real (uvicorn on a free port, in a thread of this process)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from actors.console import ConsoleSettings, console_app
from actors.engine.config import Settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # its own flag: set once it listens
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the console did not start")
        time.sleep(0.02)  # polling the server's started flag, with a deadline
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
