"""Who may use the console: anyone on this machine when it listens on loopback; with a token
anywhere else. And no page or form may be driven from another site.

A request must name the console by a host it answers to (its ``Host`` header): a loopback name
(``localhost``, ``127.0.0.1``, ``[::1]``) or one the operator allowed (``phaseline ui
--allow-host``); with a token and no such list, any. Without that check a page of another site
could drive a loopback console through DNS rebinding: its name, resolved again to 127.0.0.1,
would reach the console as a same-origin request of that site.

The token is compared in constant time and, once given (``?token=`` in the first URL, or an
``Authorization: Bearer`` header), kept in an HttpOnly, SameSite=Strict cookie, so links
inside the console carry no secret. Every form post must come from the console's own origin
(its ``Origin`` or ``Referer`` header names the host it was served from), whatever the
address: a page of another site open in the operator's browser cannot approve a tool call
on localhost.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import URL
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp

__all__ = ["COOKIE", "Access", "AccessMiddleware", "host_name", "is_loopback", "new_token"]

#: The cookie that holds the token once given.
COOKIE = "phaseline_console"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    """A fresh random token (for a console started on a non-loopback address without one)."""
    return secrets.token_urlsafe(24)


@dataclass(frozen=True, slots=True)
class Access:
    """The console's access rule."""

    token: str | None
    """The token every request must carry; None: no token (loopback only)."""
    allowed_hosts: frozenset[str] = frozenset()
    """Host names (lower case, no port) the console answers to besides loopback ones; empty:
    loopback names only without a token, any name with one."""

    def admits(self, given: str | None) -> bool:
        if self.token is None:
            return True
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def serves(self, host_header: str) -> bool:
        """Whether a request naming ``host_header`` (``name[:port]``) is meant for this
        console, not for a name another site rebound to its address."""
        name = host_name(host_header)
        if name is None:
            return False
        if name in self.allowed_hosts or is_loopback(name):
            return True
        return self.token is not None and not self.allowed_hosts


def host_name(host_header: str) -> str | None:
    """The host name of a ``Host`` header, lower case, without an IPv6 address's brackets
    (None: malformed)."""
    try:
        name = urlsplit(f"//{host_header}").hostname
    except ValueError:  # an unclosed bracket, a port that is not a number
        return None
    return name or None


def _given_token(request: Request) -> tuple[str | None, bool]:
    """The token a request carries, and whether it came in the URL (then it is moved into the
    cookie and the URL cleaned)."""
    query = request.query_params.get("token")
    if query is not None:
        return query, True
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip(), False
    return request.cookies.get(COOKIE), False


def _same_origin(request: Request) -> bool:
    source = request.headers.get("origin") or request.headers.get("referer")
    if not source:
        return False
    return urlsplit(source).netloc == request.headers.get("host", "")


class AccessMiddleware(BaseHTTPMiddleware):
    """Enforces :class:`Access` and the same-origin rule for posts."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        super().__init__(app)
        self.access = access

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if not self.access.serves(request.headers.get("host", "")):
            return PlainTextResponse(
                "this console does not answer to that host name (phaseline ui --allow-host)", 421
            )
        if request.url.path.startswith("/static/"):
            return await call_next(request)
        given, in_url = _given_token(request)
        if not self.access.admits(given):
            return PlainTextResponse(
                "this console needs its token: open the URL phaseline ui printed", 401
            )
        if request.method == "POST" and not _same_origin(request):
            return PlainTextResponse("a form of another site may not act here", 403)
        if in_url and self.access.token is not None:
            clean = URL(str(request.url)).remove_query_params("token")
            response: Response = RedirectResponse(str(clean), 303)
            response.set_cookie(COOKIE, given or "", httponly=True, samesite="strict")
            return response
        return await call_next(request)
