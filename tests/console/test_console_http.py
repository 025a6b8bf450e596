"""The console over HTTP, served for real against the real Redis, with turns run in this
process: pages, filters, actions through the CLI's API, the live stream, the token and the
same-origin rule, and bad input answered with a clear status."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from click.testing import CliRunner

from actors.cli import main
from actors.cli.harness import console_probes
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings
from actors.engine.turn_engine import TurnEngine
from bus.errors import NotAwaitingApproval
from store.domain.approvals import Approvals
from store.keys import KeyLayout
from store.records import TurnInput
from tests.support.console_server import serving
from tests.support.polling import eventually


def engine_of(client: aioredis.Redis, namespace: str, *, threads: int = 0) -> TurnEngine:
    """An in-process engine that publishes its live events, as ``phaseline run`` does."""
    settings = Settings.model_validate({
        "redis": {"namespace": namespace}, "loop": {"strict": True},
        "checkpoint": {"min_interval_s": 0}, "approvals": {"poll_s": 0.01},
        "tools": {"threads": threads},
    })  # fmt: skip
    return TurnEngine.from_settings(client, settings, watchdog=None)


@pytest.fixture
def keys(namespace: str) -> KeyLayout:
    return KeyLayout(namespace)  # the console's layout: 16 shards


@pytest.fixture
def base(redis_url: str, namespace: str) -> Iterator[str]:
    with serving(redis_url, namespace) as url:
        yield url


def scenario(**kw: Any) -> Any:
    return scripted_turn(parse_scenario({"name": "ui", "rounds": 2, "tools_per_round": 1, **kw}))


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_args: Any, **_kw: Any) -> None:
        return None


def post(
    url: str, form: dict[str, str], origin: str | None, host: str | None = None
) -> tuple[int, str]:
    """A form post; the answer's status and its Location (the console redirects back).
    ``host``: the Host header, as a page of another site rebinding its name would send it."""
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if origin is not None:
        headers["Origin"] = origin
    if host is not None:
        headers["Host"] = host
    data = urllib.parse.urlencode(form).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=30) as r:
            return r.status, r.headers.get("Location", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Location", "") or exc.read().decode()


async def aget(url: str) -> tuple[int, str, dict[str, str]]:
    return await asyncio.to_thread(get, url)


async def apost(url: str, form: dict[str, str], origin: str | None) -> tuple[int, str]:
    return await asyncio.to_thread(post, url, form, origin)


async def test_the_list_shows_a_runs_turns_with_counts_and_filters(
    real_client: aioredis.Redis, keys: KeyLayout, base: str
) -> None:
    engine = engine_of(real_client, keys.namespace)
    await engine.run_new(*scenario(), ["ui-a", "ui-b"])
    status, page, _ = await aget(f"{base}/turns")
    assert status == 200
    assert "ui-a" in page and "ui-b" in page and 'id="indexed">2<' in page
    assert "answered <b>2</b>" in page  # the outcome counts at the top
    status, page, _ = await aget(f"{base}/turns?outcome=aborted")
    assert status == 200 and "no turn matches" in page
    status, page, _ = await aget(f"{base}/turns?outcome=exploded")
    assert status == 400 and "unknown outcome" in page
    status, page, _ = await aget(f"{base}/turns?after=garbage")
    assert status == 400 and "not a cursor" in page


async def test_a_turns_page_shows_transcript_ledger_and_timeline(
    real_client: aioredis.Redis, keys: KeyLayout, base: str
) -> None:
    engine = engine_of(real_client, keys.namespace)
    await engine.run_new(*scenario(tools=["counter_increment"]), ["ui-t"])
    status, page, _ = await aget(f"{base}/turns/ui-t")
    assert status == 200
    assert "answered" in page and "counter_increment" in page
    assert "runs at most once" in page  # the timeline's tool row names the ledger rule
    assert "checkpoint 1 (tool_batch)" in page and "committed" in page
    assert 'id="inject"' not in page and 'id="cancel"' not in page  # it ended: nothing to do
    status, parts, _ = await aget(f"{base}/turns/ui-t/parts")
    assert status == 200 and set(json.loads(parts)) == {"summary", "approvals", "transcript",
                                                         "ledger"}  # fmt: skip
    assert (await aget(f"{base}/turns/nope"))[0] == 200  # a page that says so
    assert "no such turn" in (await aget(f"{base}/turns/nope"))[1]
    assert (await aget(f"{base}/turns/bad%20id"))[0] == 404


async def test_a_call_that_waited_for_a_thread_shows_on_the_timeline(
    real_client: aioredis.Redis, keys: KeyLayout, base: str
) -> None:
    engine = engine_of(real_client, keys.namespace, threads=2)
    await engine.run_new("tests.support.agents:crowd", TurnInput(message="go"), ["ui-crowd"])
    status, page, _ = await aget(f"{base}/turns/ui-crowd")
    assert status == 200
    assert "crowds waits: every thread for sync tools is busy" in page
    assert "crowds runs now (it waited" in page


async def test_an_approval_on_the_page_lets_the_turn_go_on(
    real_client: aioredis.Redis, keys: KeyLayout, base: str
) -> None:
    engine = engine_of(real_client, keys.namespace)
    agent, turn_input = scenario(rounds=1, require_approval=["echo"])
    record = (await engine.submit_many(agent, turn_input, ["ui-gate"]))[0][1]
    task = asyncio.ensure_future(engine.start(record, await engine.store.load_spec("ui-gate")))

    async def asked() -> str | None:
        return engine.pending_approval("ui-gate")

    key = await eventually(asked, timeout=10, what="the approval request")
    _, page, _ = await aget(f"{base}/turns/ui-gate")
    assert "Waiting for a decision" in page and key in page
    url = f"{base}/turns/ui-gate/approve"
    assert (await apost(url, {"call_key": key}, origin="http://evil.example"))[0] == 403
    assert (await apost(url, {"call_key": key}, origin=None))[0] == 403
    status, where = await apost(url, {"call_key": key, "reason": "fine"}, origin=base)
    assert status == 303 and "approved" in urllib.parse.unquote_plus(where)
    await asyncio.wait_for(task, 30)
    final = await engine.store.load("ui-gate")
    (result,) = [m.tool_result for m in final.messages if m.tool_result]
    assert result.status == "ok"
    status, where = await apost(url, {"call_key": key}, origin=base)  # decided already
    assert status == 303 and "decided already" in urllib.parse.unquote_plus(where)


async def test_inject_and_cancel_from_the_page(
    real_client: aioredis.Redis, keys: KeyLayout, base: str
) -> None:
    engine = engine_of(real_client, keys.namespace)
    agent, turn_input = scenario(rounds=40, llm_latency_ms=100)
    record = (await engine.submit_many(agent, turn_input, ["ui-long"]))[0][1]
    task = asyncio.ensure_future(engine.start(record, await engine.store.load_spec("ui-long")))
    status, where = await apost(f"{base}/turns/ui-long/inject", {"text": "  "}, origin=base)
    assert status == 303 and "problem=" in where  # empty: refused, said why
    status, where = await apost(f"{base}/turns/ui-long/inject", {"text": "hi"}, origin=base)
    assert status == 303 and "queued" in urllib.parse.unquote_plus(where)
    status, where = await apost(f"{base}/turns/ui-long/cancel", {"reason": "enough"}, origin=base)
    assert status == 303 and "cancel" in where
    await asyncio.wait_for(task, 30)
    final = await engine.store.load("ui-long")
    assert final.counters.outcome == "cancelled"
    assert final.counters.cancel_reason == "enough (by console@127.0.0.1)"
    assert any(m.role == "user" and m.text == "hi" for m in final.messages)
    status, where = await apost(f"{base}/turns/ui-long/cancel", {}, origin=base)
    assert status == 303 and "problem=" in where  # ended: nothing to cancel
    status, where = await apost(f"{base}/turns/ui-long/explode", {}, origin=base)
    assert status == 303 and "no action" in urllib.parse.unquote_plus(where)


async def test_the_live_stream_sends_a_turns_rows_until_it_ends(
    real_client: aioredis.Redis, keys: KeyLayout, base: str
) -> None:
    engine = engine_of(real_client, keys.namespace)
    agent, turn_input = scenario(rounds=3, llm_latency_ms=50)
    record = (await engine.submit_many(agent, turn_input, ["ui-live"]))[0][1]
    task = asyncio.ensure_future(engine.start(record, await engine.store.load_spec("ui-live")))
    status, body, headers = await aget(f"{base}/turns/ui-live/live?after=0-0")
    await task
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [block for block in body.split("\n\n") if block.startswith("id: ")]
    rows = [json.loads(b.split("data: ", 1)[1])["row"] for b in events]
    kinds = [r["kind"] for r in rows]
    assert kinds[-1] == "end" and "checkpoint" in kinds and "model" in kinds
    assert body.rstrip().endswith("event: end\ndata: {}")


def test_a_console_with_a_token_refuses_requests_without_it(redis_url: str, namespace: str) -> None:
    token = "s3cret-token-for-the-test"
    with serving(redis_url, namespace, token=token) as url:
        assert get(f"{url}/turns")[0] == 401
        assert get(f"{url}/turns", {"Authorization": "Bearer wrong-token-wrong"})[0] == 401
        status, page, _ = get(f"{url}/turns", {"Authorization": f"Bearer {token}"})
        assert status == 200 and token not in page
        opener = urllib.request.build_opener(_NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as moved:  # the token goes into a cookie
            opener.open(f"{url}/turns?token={token}", timeout=30)
        assert moved.value.code == 303 and moved.value.headers["Location"] == f"{url}/turns"
        cookie = moved.value.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        status, page, _ = get(f"{url}/turns", {"Cookie": cookie.split(";")[0]})
        assert status == 200 and token not in page
        assert get(f"{url}/static/console.css")[0] == 200


def test_a_page_of_another_site_cannot_reach_a_loopback_console_by_rebinding(
    redis_url: str, namespace: str
) -> None:
    """DNS rebinding: evil.example resolved again to 127.0.0.1 reaches the console with its own
    name in Host (and Origin, for a post): refused, whatever the route."""
    with serving(redis_url, namespace) as url:
        port = url.rsplit(":", 1)[1]
        evil = f"evil.example:{port}"
        assert get(f"{url}/turns", {"Host": evil})[0] == 421
        assert get(f"{url}/static/console.css", {"Host": evil})[0] == 421
        status, _ = post(f"{url}/turns/t1/inject", {"text": "hi"}, f"http://{evil}", host=evil)
        assert status == 421
        for name in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
            assert get(f"{url}/turns", {"Host": name})[0] == 200, name
        assert get(f"{url}/turns", {"Host": "[::1"})[0] == 421  # malformed
    with serving(redis_url, namespace, allowed_hosts=("console.lan",)) as url:
        port = url.rsplit(":", 1)[1]
        assert get(f"{url}/turns", {"Host": f"console.lan:{port}"})[0] == 200
        assert get(f"{url}/turns", {"Host": f"evil.example:{port}"})[0] == 421


def test_a_console_with_a_token_answers_any_name_but_only_with_it(
    redis_url: str, namespace: str
) -> None:
    token = "s3cret-token-for-the-test"
    with serving(redis_url, namespace, token=token) as url:
        assert get(f"{url}/turns", {"Host": "box.example"})[0] == 401
        auth = {"Host": "box.example", "Authorization": f"Bearer {token}"}
        assert get(f"{url}/turns", auth)[0] == 200


async def test_no_call_is_approved_before_its_question(
    base: str, real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """Call keys can be computed: a decision on a call that asked nothing is refused, and
    nothing is written for it."""
    url = f"{base}/turns/nosuch-t000009/approve"
    status, where = await apost(url, {"call_key": "0.0.abc"}, origin=base)
    assert status == 303 and "problem=" in where and "is+waiting+as" in where
    assert await real_client.exists(keys.approval("nosuch-t000009")) == 0
    with pytest.raises(NotAwaitingApproval):
        await Approvals(real_client, keys).decide("nosuch-t000009", "0.0.abc", True)


@pytest.mark.parametrize("since", ["1e400", "inf", "nan", "-1", "0", "1e12", "soon"])
def test_a_filter_out_of_range_is_a_400_not_a_500(base: str, since: str) -> None:
    status, body, _ = get(f"{base}/turns?since={since}")
    assert status == 400 and body.startswith("bad filter"), (status, body[:200])


async def test_the_cli_refuses_a_lookback_past_its_range(redis_url: str, keys: KeyLayout) -> None:
    for verb, flag in (("turns", "--since"), ("purge", "--older-than")):
        result = await asyncio.to_thread(
            CliRunner().invoke, main,
            [verb, "--redis-url", redis_url, "--namespace", keys.namespace, flag, "inf"],
        )  # fmt: skip
        assert result.exit_code == 2 and "inf" in result.output, (verb, result.output)


def test_the_chaos_runs_console_probes_find_nothing_let_through(
    redis_url: str, namespace: str
) -> None:
    """The probes ``phaseline chaos --targets bad_input`` sends (a rebound Host, a cross-site
    form, no or a wrong token, an approval before its question) are all refused."""
    settings = Settings.model_validate({"redis": {"namespace": namespace}})
    assert console_probes(settings, redis_url, "chaos1-t000000") == []


def test_ui_never_prints_a_token_it_was_given(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """A banner is copied into logs and screenshots: a token from a file (or the environment)
    stays there; one ``ui`` made itself is shown, once, since nobody else has it."""
    token_file = tmp_path / "token"
    token_file.write_text("a-token-from-a-file-0123456789\n")
    for extra, shown in (
        (["--token-file", str(token_file), "--host", "127.0.0.1"], False),
        (["--host", "0.0.0.0"], True),
    ):
        proc = subprocess.Popen(
            [sys.executable, "-m", "actors.cli", "ui", "--redis-url", redis_url,
             "--namespace", namespace, "--port", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "COLUMNS": "300"},
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            banner = ""
            while "phaseline console on" not in banner:
                line = proc.stdout.readline()
                assert line, banner
                banner += line
        finally:
            proc.kill()
            proc.wait(timeout=30)
        assert ("a-token-from-a-file" in banner) is False
        assert ("?token=" in banner) is shown, banner
        if not shown:
            assert f"the one in {token_file}" in banner, banner


async def test_a_sessions_turn_has_its_page_and_its_actions(
    base: str, real_client: aioredis.Redis, namespace: str
) -> None:
    """A session's turn id holds a slash (``s7/1``): its page, parts and actions answer (the
    page used to be a 405, caught by the POST route of a verb)."""
    engine = engine_of(real_client, namespace)
    agent, turn_input = scenario()
    spec, record = await engine.open_in_session(agent, turn_input, "s7")
    assert record.turn_id == "s7/1"
    status, page, _ = await aget(f"{base}/turns/s7/1")
    assert status == 200 and "s7/1" in page
    assert 'id="inject"' in page and 'id="cancel"' in page  # in progress: it may be told
    assert (await aget(f"{base}/turns/s7/1/parts"))[0] == 200
    assert (await aget(f"{base}/turns/{urllib.parse.quote('s7/1', safe='')}"))[0] == 200
    status, where = await apost(f"{base}/turns/s7/1/inject", {"text": "hi"}, origin=base)
    assert status == 303 and where.startswith("/turns/s7/1?done=message")
    await engine.start(record, spec)  # the message enters at its first boundary
    final = await engine.store.load("s7/1")
    assert any(m.text == "hi" for m in final.messages)
