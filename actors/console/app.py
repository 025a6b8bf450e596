"""The console's ASGI app: routes, forms and the live stream of a turn's page.

Server-rendered (Jinja2 templates shipped in the package, one small script for the live page;
no build step). Every action is a call of the front desk the CLI uses
(``actors.engine.front_desk``): the deployment's when the console is attached to one (a cancel
then also ends an in-flight model call, a resumed turn is adopted at once), else Redis alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from actors.cluster.runtime import Runtime
from actors.console.access import Access, AccessMiddleware
from actors.console.timeline import row_of
from actors.console.views import deployment_view, list_view, turn_view
from actors.engine.cancel import Cancelled
from actors.engine.front_desk import FrontDesk
from actors.engine.settings.config import Settings
from bus.errors import ConfigError, PhaselineError, RecordError, RecordNotFound
from bus.events import Checkpointed, Finished, ToolReturned
from bus.phase import Transition, TurnPhase
from store.keys import TURN_ID_PATTERN, check_turn_id
from store.redis.connection import StoreClient
from store.redis.urls import redact_url
from store.views.summaries import MAX_LOOKBACK_S, Cursor, TurnFilter
from store.views.watch import watch_entries
from store.write.checkpoint import RedisCheckpointStore

__all__ = ["ConsoleSettings", "console_app"]

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
#: Longest message an operator may inject, and longest reason.
MAX_TEXT = 20_000
MAX_REASON = 500


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsoleSettings:
    """How ``phaseline ui`` serves."""

    redis_url: str
    """The Redis of the namespace (when not attached: attached, the deployment's)."""
    token: str | None = None
    """The token every request must carry (None: none, loopback only)."""
    ray_address: str | None = None
    """Attach to the deployment on this Ray cluster (the deployment page's live figures, a
    cancel that ends an in-flight model call, a resume picked up at once); None: the one the
    namespace's owner record names, if ``join`` (else Redis only)."""
    join: bool = True
    """Without ``ray_address``, attach to the deployment the owner record names, if any."""
    page_size: int = 50
    """Turns per page of the list."""
    scan: int = 1000
    """Index entries a filtered page reads at most before it offers the next page (what a
    narrow filter costs a page, whatever the store holds)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names the console answers to besides loopback ones (``--allow-host``)."""


def _ago(ms: int) -> str:
    if not ms:
        return "-"
    s = max(0.0, time.time() - ms / 1000)
    if s < 120:
        return f"{s:.0f} s ago"
    return f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _when(ms: int) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters["ago"] = _ago
    templates.env.filters["when"] = _when
    return templates


class _Console:
    """The app's state: one Redis client, the optional deployment, the templates."""

    def __init__(self, settings: Settings, console: ConsoleSettings) -> None:
        self.settings = settings
        self.console = console
        self.keys = settings.redis.key_layout()
        self.templates = _templates()
        self.client: StoreClient | None = None
        self.runtime: Runtime | None = None
        self.front: FrontDesk | None = None
        self.redis_url = ""

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        own: StoreClient | None = None
        if self.console.ray_address is not None:
            self.runtime = await Runtime.attach(self.settings, ray_address=self.console.ray_address)
        else:
            # Each open live page holds a connection in a blocking read: room for many.
            own = self.settings.redis.connect(self.console.redis_url, max_connections=512)
            if self.console.join:
                self.runtime = await Runtime.find(self.settings, own)
        if self.runtime is not None:
            self.client, self.front = self.runtime.client, self.runtime
            self.redis_url = self.runtime.dep.redis_url
            self.keys = self.runtime.dep.keys  # the deployment's layout (its shard count)
            log.warning("console attached to the deployment of namespace %r", self.keys.namespace)
        else:
            assert own is not None
            self.client, self.redis_url = own, self.console.redis_url
            self.front = FrontDesk(own, self.settings, keys=self.keys)
        try:
            yield
        finally:
            if own is not None:
                await own.aclose()
            if self.runtime is not None:
                await self.runtime.detach()

    @property
    def desk(self) -> FrontDesk:
        assert self.front is not None, "used outside the app's lifespan"
        return self.front

    @property
    def redis(self) -> StoreClient:
        assert self.client is not None, "used outside the app's lifespan"
        return self.client

    def page(self, request: Request, name: str, **context: Any) -> Response:
        context.update(
            namespace=self.keys.namespace,
            redis=redact_url(self.redis_url),
            attached=self.runtime is not None,
            flash=request.query_params.get("done", ""),
            problem=request.query_params.get("problem", ""),
        )
        return self.templates.TemplateResponse(request, name, context)

    # -- pages ----------------------------------------------------------------------------

    async def turns(self, request: Request) -> Response:
        q = request.query_params
        try:
            where = TurnFilter(
                session=q.get("session") or None,
                agent=q.get("agent") or None,
                outcome=q.get("outcome") or None,
                phase=TurnPhase(q["phase"]) if q.get("phase") else None,
                since_ms=_since(q.get("since")),
            )
            after = Cursor.parse(q["after"]) if q.get("after") else None
        except ValueError as exc:
            return PlainTextResponse(f"bad filter: {exc}", 400)
        view = await list_view(
            self.redis,
            self.keys,
            where,
            after,
            limit=self.console.page_size,
            scan=self.console.scan,
        )
        query = {k: v for k, v in q.items() if k not in ("after", "done", "problem") and v}
        older = None
        if view.page.next is not None:
            older = "/turns?" + urlencode({**query, "after": view.page.next.wire()})
        return self.page(
            request,
            "turns.html",
            view=view,
            query=query,
            older=older,
            phases=[p.value for p in TurnPhase],
        )

    async def turn(self, request: Request) -> Response:
        turn_id = _turn_id(request)
        try:
            view = await turn_view(self.redis, self.keys, turn_id)
        except RecordNotFound:
            return self.page(request, "missing.html", turn_id=turn_id, why="no such turn")
        except RecordError as exc:
            return self.page(request, "missing.html", turn_id=turn_id, why=str(exc))
        return self.page(request, "turn.html", view=view, turn_id=turn_id)

    async def parts(self, request: Request) -> Response:
        """The parts of a turn's page that change, rendered again (the live page swaps them
        in without a reload)."""
        turn_id = _turn_id(request)
        try:
            view = await turn_view(self.redis, self.keys, turn_id)
        except (RecordNotFound, RecordError) as exc:
            return PlainTextResponse(str(exc), 404)
        env = self.templates.env
        context = {"view": view, "turn_id": turn_id}
        return JSONResponse(
            {
                name: env.get_template(f"parts/{name}.html").render(context)
                for name in ("summary", "approvals", "transcript", "ledger")
            }
        )

    async def live(self, request: Request) -> Response:
        """Server-sent events: the turn's timeline rows from just after ``after``."""
        turn_id = _turn_id(request)
        after = request.query_params.get("after") or request.headers.get("last-event-id")
        try:
            await RedisCheckpointStore(self.redis, self.keys).load(turn_id)
        except (RecordNotFound, RecordError) as exc:
            return PlainTextResponse(str(exc), 404)
        return StreamingResponse(
            self._events(turn_id, after or None),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def _events(self, turn_id: str, after: str | None) -> AsyncIterator[str]:
        yield ": live\n\n"
        try:
            async for entry_id, event in watch_entries(self.redis, self.keys, turn_id, after):
                row = row_of(event)
                if row is None:
                    continue
                refresh = isinstance(event, Transition | Checkpointed | ToolReturned | Finished)
                data = {"row": row.wire(), "refresh": refresh}
                if isinstance(event, Transition):
                    data["phase"] = event.dst.value
                yield f"id: {entry_id}\nevent: row\ndata: {json.dumps(data)}\n\n"
            yield "event: end\ndata: {}\n\n"
        except PhaselineError as exc:  # Redis away: the page reconnects from its last id
            log.warning("console live %s: %s", turn_id, exc)
            yield f"event: problem\ndata: {json.dumps({'problem': str(exc)})}\n\n"

    async def deployment(self, request: Request) -> Response:
        view = await deployment_view(self.redis, self.keys, self.runtime)
        return self.page(request, "deployment.html", view=view)

    # -- actions --------------------------------------------------------------------------

    async def act(self, request: Request) -> Response:
        turn_id = _turn_id(request)
        verb = request.path_params["verb"]
        form = await request.form()
        by = f"console@{request.client.host if request.client else '?'}"
        try:
            done = await self._do(verb, turn_id, {k: str(v) for k, v in form.items()}, by)
        except (ConfigError, RecordNotFound, ValueError) as exc:  # TurnNotRunning among them
            return _back(turn_id, problem=str(exc))
        return _back(turn_id, done=done)

    async def _do(self, verb: str, turn_id: str, form: dict[str, str], by: str) -> str:
        reason = form.get("reason", "")[:MAX_REASON]
        if verb in ("approve", "deny"):
            key = form.get("call_key", "")
            if not key:
                raise ValueError("which call? (no call key)")
            key = await self.desk.decide(turn_id, key, verb == "approve", by=by, reason=reason)
            return f"{'approved' if verb == 'approve' else 'denied'} {key}"
        if verb == "inject":
            message = form.get("text", "").strip()
            if not message or len(message) > MAX_TEXT:
                raise ValueError(f"a message is 1 to {MAX_TEXT:,} characters")
            item = await self.desk.inject(turn_id, message, by=by)
            return f"message {item.message_id} queued: it enters at the turn's next boundary"
        if verb == "cancel":
            ended = await self.desk.cancel(turn_id, reason, by=by)
            return "cancelled" if ended is Cancelled.ENDED else "cancel requested"
        if verb == "resume":
            (record,) = await self.desk.reopen([turn_id])
            if not record.in_progress:
                raise ValueError(f"the turn ended already ({record.counters.outcome})")
            if self.runtime is not None:
                return "resumed"
            return "back in progress: the deployment's next adopt runs it"
        raise ValueError(f"no action {verb!r}")


def _since(raw: str | None) -> int:
    """``since`` minutes ago as unix ms (0: no bound)."""
    if not raw:
        return 0
    minutes = float(raw)
    if not 0 < minutes * 60 <= MAX_LOOKBACK_S:  # NaN and inf fail it too
        raise ValueError(f"since is a number of minutes from 0 to {MAX_LOOKBACK_S // 60:,}")
    return int((time.time() - minutes * 60) * 1000)


def _turn_id(request: Request) -> str:
    return check_turn_id(request.path_params["turn_id"])


def _back(turn_id: str, **note: str) -> Response:
    return RedirectResponse(f"/turns/{turn_id}?{urlencode(note)}", 303)


async def _bad_turn_id(_request: Request, exc: Exception) -> Response:
    return PlainTextResponse(str(exc), 404)


class TurnIdConvertor(Convertor[str]):
    """A turn id in a URL, ``/<n>`` of a session's turn included: ``/turns/s7/1`` is turn
    ``s7/1``'s page (a plain ``{turn_id}`` stopped at the slash, and the POST route took it)."""

    regex = TURN_ID_PATTERN

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("turn", TurnIdConvertor())


def console_app(settings: Settings, console: ConsoleSettings) -> Starlette:
    """The console over the namespace of ``settings``."""
    c = _Console(settings, console)
    routes = [
        Route("/", lambda _r: RedirectResponse("/turns", 307)),
        Route("/turns", c.turns),
        Route("/turns/{turn_id:turn}", c.turn),
        Route("/turns/{turn_id:turn}/parts", c.parts),
        Route("/turns/{turn_id:turn}/live", c.live),
        Route("/turns/{turn_id:turn}/{verb}", c.act, methods=["POST"]),
        Route("/deployment", c.deployment),
        Route("/healthz", lambda _r: PlainTextResponse("ok")),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(
                AccessMiddleware,
                access=Access(console.token, frozenset(h.lower() for h in console.allowed_hosts)),
            )
        ],
        lifespan=c.lifespan,
        exception_handlers={ConfigError: _bad_turn_id},
    )
