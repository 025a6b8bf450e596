"""``phaseline ui``: the web console (``actors.console``) served by uvicorn."""

from __future__ import annotations

import os

import click

from actors.cli.app import BadInput, _common, _redis, _settings, console, main
from actors.engine.settings.extras import Extra, needs

__all__ = ["ui"]


@main.command()
@_common
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on; any but a loopback one requires a token.",
)
@click.option("--port", type=click.IntRange(0, 65535), default=8321, show_default=True)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Read the token from this file (else $PHASELINE_UI_TOKEN, else one is made "
    "and printed when the address is not a loopback one).",
)
@click.option(
    "--ray-address",
    default=None,
    help="Attach to the deployment on this Ray cluster: its hosts and rates, a cancel "
    "that ends an in-flight model call at once.",
)
@click.option(
    "--allow-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="A host name the console answers to besides loopback ones (repeat it); "
    "a request naming any other is refused, as a page of another site "
    "rebinding its name to this address would. With a token and none given: "
    "any name.",
)
def ui(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    host: str,
    port: int,
    token_file: str | None,
    ray_address: str | None,
    allowed_hosts: tuple[str, ...],
) -> None:
    """Serve the web console: turns (filtered, paged), each turn live (transcript, tool
    ledger, timeline) with its actions (approve, deny, inject, cancel, resume), and the
    deployment."""
    with needs(Extra.CONSOLE, "phaseline ui"):
        import uvicorn

        from actors.console import ConsoleSettings, console_app
        from actors.console.access import host_name, is_loopback, new_token
    settings = _settings(config_path, redis_url, namespace)
    token = os.environ.get("PHASELINE_UI_TOKEN") or None
    source = "$PHASELINE_UI_TOKEN" if token else ""
    if token_file is not None:
        with open(token_file, encoding="utf-8") as f:
            token = f.read().strip() or None
        source = token_file
    made = token is None and not is_loopback(host)
    if made:
        token = new_token()
    if token is not None and len(token) < 16:
        raise BadInput("a console token is at least 16 characters")
    for name in allowed_hosts:
        if host_name(name) != name.lower().strip("[]"):
            raise BadInput(f"--allow-host {name!r}: give a host name alone, without a port")
    shown = "localhost" if host in ("127.0.0.1", "::1") else host
    with _redis(settings) as url:
        app = console_app(
            settings,
            ConsoleSettings(
                redis_url=url, token=token, ray_address=ray_address, allowed_hosts=allowed_hosts
            ),
        )
        # A token the operator gave stays where it is (a file, the environment): a banner is
        # copied into logs and screenshots. One made here must be shown, once.
        query = f"/?token={token}" if made else "/"
        note = f" (its token: the one in {source})" if token is not None and not made else ""
        console.print(f"phaseline console on http://{shown}:{port}{query}{note}", highlight=False)
        uvicorn.run(app, host=host, port=port, log_level="warning")
