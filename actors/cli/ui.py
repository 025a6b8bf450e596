"""``phaseline ui``: the web console (``actors.console``) served by uvicorn."""

from __future__ import annotations

import os

import click
import uvicorn

from actors.cli.app import BadInput, _common, _redis, _settings, console, main
from actors.console import ConsoleSettings, console_app
from actors.console.access import is_loopback, new_token

__all__ = ["ui"]


@main.command()
@_common
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; any but a loopback one requires a token.")  # fmt: skip
@click.option("--port", type=click.IntRange(0, 65535), default=8321, show_default=True)
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Read the token from this file (else $PHASELINE_UI_TOKEN, else one is made "
                   "and printed when the address is not a loopback one).")  # fmt: skip
@click.option("--ray-address", default=None,
              help="Attach to the deployment on this Ray cluster: its hosts and rates, a cancel "
                   "that ends an in-flight model call at once.")  # fmt: skip
def ui(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    host: str, port: int, token_file: str | None, ray_address: str | None,
) -> None:  # fmt: skip
    """Serve the web console: turns (filtered, paged), each turn live (transcript, tool
    ledger, timeline) with its actions (approve, deny, inject, cancel, resume), and the
    deployment."""
    settings = _settings(config_path, redis_url, namespace)
    token = os.environ.get("PHASELINE_UI_TOKEN") or None
    if token_file is not None:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip() or None
    if token is None and not is_loopback(host):
        token = new_token()
    if token is not None and len(token) < 16:
        raise BadInput("a console token is at least 16 characters")
    shown = "localhost" if host in ("127.0.0.1", "::1") else host
    with _redis(settings) as url:
        app = console_app(settings, ConsoleSettings(redis_url=url, token=token,
                                                    ray_address=ray_address))  # fmt: skip
        query = f"/?token={token}" if token is not None else "/"
        console.print(f"phaseline console on http://{shown}:{port}{query}", highlight=False)
        uvicorn.run(app, host=host, port=port, log_level="warning")
