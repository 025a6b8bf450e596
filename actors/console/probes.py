"""A console probed as an attacker would (``phaseline chaos --targets bad_input``): a page of
another site that rebinds its name to the console's address, a form posted from another site,
a request without the token, a decision on a call that asked none. Each must be refused; what
was let through is reported. Also what serves a console for a while in a thread of this
process (the probes' console, and the tests')."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette

__all__ = ["probe_loopback", "probe_token", "served"]


@contextmanager
def served(app: Starlette) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port, in a daemon thread, until the block
    ends; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="console", daemon=True)
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


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_args: object, **_kw: object) -> None:
        return None


def _send(url: str, headers: dict[str, str], form: dict[str, str] | None = None) -> tuple[int, str]:
    """The status and Location (or body) of one request, redirects not followed."""
    data = None if form is None else urllib.parse.urlencode(form).encode()
    if form is not None:
        headers = {**headers, "Content-Type": "application/x-www-form-urlencoded"}
    request = urllib.request.Request(url, data=data, headers=headers)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=30) as r:
            return r.status, r.headers.get("Location", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Location", "") or exc.read().decode()[:200]


def probe_loopback(base: str, turn_id: str) -> list[str]:
    """Probes of a console without a token on loopback; each one it let through."""
    port = base.rsplit(":", 1)[1]
    evil, home = f"evil.example:{port}", f"127.0.0.1:{port}"
    turn = f"{base}/turns/{turn_id}"
    let_through = []
    status, _ = _send(f"{base}/turns", {"Host": evil})
    if status != 421:
        let_through.append(f"a rebound Host read the turn list ({status})")
    status, _ = _send(f"{turn}/inject", {"Host": evil, "Origin": f"http://{evil}"}, {"text": "x"})
    if status != 421:
        let_through.append(f"a rebound Host with its own Origin posted a message ({status})")
    status, _ = _send(
        f"{turn}/inject", {"Host": home, "Origin": "http://evil.example"}, {"text": "x"}
    )
    if status != 403:
        let_through.append(f"a form of another site posted a message ({status})")
    key = f"0.0.{'ab' * 12}"  # call keys can be computed: this one asked nothing
    status, where = _send(
        f"{turn}/approve", {"Host": home, "Origin": f"http://{home}"}, {"call_key": key}
    )
    if status != 303 or "problem=" not in where:
        let_through.append(f"a call that asked nothing was approved ({status} {where})")
    return let_through


def probe_token(base: str) -> list[str]:
    """Probes of a console that has a token; each one it let through."""
    let_through = []
    for headers in ({}, {"Authorization": "Bearer not-the-token-at-all"}):
        status, _ = _send(f"{base}/turns", headers)
        if status != 401:
            let_through.append(f"a request with {headers or 'no token'} was answered ({status})")
    return let_through
