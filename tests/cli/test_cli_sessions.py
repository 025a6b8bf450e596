"""``phaseline submit``, ``watch``, ``chat`` and ``serve``: bad input exits 2 with a message;
submit + watch in Redis alone; a chat with the example agent on Ray against the test server."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

from actors.cli import main
from actors.cluster.runtime import Runtime
from actors.engine.settings.config import Settings
from store.keys import KeyLayout
from store.redis.connection import connect
from store.write.checkpoint import RedisCheckpointStore

RECALL = "tests.support.agents:recall"
EXAMPLE = "actors.examples.assistant:agent"


def invoke(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), input=stdin)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["submit", "--agent", RECALL, "--input", "hi", "--session", "s", "--turn-id", "t"],
         "give --session"),
        (["submit", "--agent", RECALL, "--input", "hi", "--session", "a/b"], "invalid session id"),
        (["submit", "--agent", RECALL, "--input", "hi", "--turn-id", "a b"], "invalid turn id"),
        (["submit", "--agent", RECALL, "--input", "  "], "--input is empty"),
        (["submit", "--agent", "tests.nope:x", "--input", "hi"], "cannot import"),
        (["submit", "--agent", RECALL], "Missing option '--input'"),
        (["watch", "bad id"], "invalid turn id"),
        (["watch", "nosuch"], "no turn nosuch"),
        (["chat", "--agent", "tests.support.agents:not_an_agent"], "not an Agent"),
        (["chat", "--agent", RECALL, "--session", "x/1"], "invalid session id"),
        (["serve", "--agent", "nocolon"], "not an import path"),
        (["serve", "--hosts", "0"], "0 is not in the range"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_a_message(
    redis_url: str, namespace: str, args: list[str], message: str
) -> None:
    code, _out, err = invoke(*args, "--redis-url", redis_url, "--namespace", namespace)
    assert code == 2, err
    assert message in err


def test_submit_then_resume_then_watch(redis_url: str, namespace: str) -> None:
    common = ["--redis-url", redis_url, "--namespace", namespace]
    code, out, err = invoke("submit", "--agent", RECALL, "--input", "hello", "--session", "s1",
                            *common)  # fmt: skip
    assert (code, out.strip()) == (0, "s1/1"), err
    assert "phaseline resume s1/1 runs it" in err
    # The session's turn is not final: the next one is refused, and nothing is written.
    code, _, err = invoke("submit", "--agent", RECALL, "--input", "again", "--session", "s1",
                          *common)  # fmt: skip
    assert code == 1 and "SessionBusy" in err and "s1/1 in progress" in err
    code, _, err = invoke("resume", "--in-process", "s1/1", *common)
    assert code == 0, err
    code, out, err = invoke("watch", "s1/1", *common)
    assert code == 0, err
    assert "heard: hello" in out and "answered" in out
    code, out, err = invoke("submit", "--agent", RECALL, "--input", "again", "--session", "s1",
                            *common)  # fmt: skip
    assert (code, out.strip()) == (0, "s1/2"), err
    code, out, err = invoke("submit", "--agent", RECALL, "--input", "x", "--turn-id", "solo",
                            *common)  # fmt: skip
    assert (code, out.strip()) == (0, "solo"), err
    code, _, err = invoke("submit", "--agent", RECALL, "--input", "x", "--turn-id", "solo",
                          *common)  # fmt: skip
    assert code == 2 and "already exists" in err


@pytest.mark.usefixtures("ray_cluster")
def test_chat_with_the_example_agent_on_ray(redis_url: str, namespace: str) -> None:
    lines = [
        '#script {"rounds": 1, "tool": "calculate", "args": {"expression": "(2 + 3) * 7"}}',
        "",
        '#script {"rounds": 1, "tool": "read_file", "args": {"path": "../../etc/passwd"}}',
    ]
    code, out, err = invoke("chat", "--agent", EXAMPLE, "--session", "c1",
                            "--redis-url", redis_url, "--namespace", namespace,
                            stdin="\n".join(lines) + "\n")  # fmt: skip
    assert code == 0, err
    assert "⚙ calculate" in out and "↳ ok: 35" in out and "results: 35" in out
    assert "⚙ read_file" in out and "↳ error" in out and "outside the sandbox" in out
    assert "continue it with phaseline chat --agent" in err

    async def records() -> list[str]:
        client = connect(redis_url)
        store = RedisCheckpointStore(client, KeyLayout(namespace))
        try:
            one, two = await store.load("c1/1"), await store.load("c1/2")
        finally:
            await client.aclose()
        assert two.messages[: len(one.messages)] == one.messages  # the session goes on
        return [one.answer, two.answer]

    answers = asyncio.run(records())
    assert answers[0] == "results: 35" and "outside the sandbox" in answers[1]


@pytest.mark.usefixtures("ray_cluster")
def test_submit_hands_a_turn_to_a_running_deployment(redis_url: str, namespace: str) -> None:
    settings = Settings.model_validate({"redis": {"namespace": namespace}})

    async def serve() -> None:  # what phaseline serve leaves running
        rt = await Runtime.start(settings, redis_url=redis_url, hosts=1)
        await rt.detach()

    async def stop() -> None:
        rt = await Runtime.attach(settings, ray_address=None)
        await rt.shutdown()

    asyncio.run(serve())
    try:
        code, out, err = invoke(
            "submit", "--agent", RECALL, "--input", "over the wire", "--ray-address", "auto",
            "--redis-url", redis_url, "--namespace", namespace, "--watch",
        )  # fmt: skip
    finally:
        asyncio.run(stop())
    assert code == 0, err
    assert out.splitlines()[1:] == ["heard: over the wire", "· answered"]
