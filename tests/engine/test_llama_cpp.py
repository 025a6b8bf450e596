"""llama.cpp's own C++ server (``phaseline model-server --cpp``, built by
``scripts/build_llama_server``): started as a user starts it, it serves requests at once
through the real ``openai`` SDK, and its ``/v1/responses`` answers but keeps nothing (no
``background`` mode, no retrieval: what a durable generation on it cannot use), which
phaseline's Responses client meets by asking again, counted repaid."""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import redis.asyncio as aioredis

from actors.engine.models import local_model
from actors.engine.models.openai_responses import OpenAIResponses
from actors.turn.agent import ModelContext
from actors.turn.llm import LLMRequest
from bus.messages import Message
from store.domain.responses import RedisResponses
from store.keys import KeyLayout
from store.records import TurnInput
from tests.conftest import _free_port
from tests.support.polling import wait_until
from tests.support.processes import PHASELINE


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:  # refused while it starts, 503 while it loads the model
        return False


@pytest.fixture(scope="module")
def cpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    assert local_model.cpp_server() is not None, "not built: scripts/build_llama_server"
    port = _free_port()
    log = tmp_path_factory.mktemp("cpp") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [PHASELINE, "model-server", "--cpp", "--parallel", "4", "--port", str(port)],
            cwd=log.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: proc.poll() is not None or _healthy(base), timeout=120, what="llama-server"
        )
        assert proc.poll() is None, log.read_text()
        yield f"{base}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_it_serves_four_requests_at_once(cpp_server: str) -> None:
    client = openai.AsyncOpenAI(base_url=cpp_server, api_key="none", max_retries=0)

    async def one() -> tuple[float, float, str]:
        start = time.monotonic()
        reply = await client.chat.completions.create(
            model=local_model.MODEL_ALIAS,
            messages=[{"role": "user", "content": "Tell me a story about a lighthouse."}],
            max_tokens=48,
        )
        return start, time.monotonic(), reply.choices[0].message.content or ""

    alone = await one()
    together = await asyncio.gather(*(one() for _ in range(4)))
    await client.close()
    assert alone[2] and all(text for _, _, text in together)
    # Served at once, not one after another: four took less than four times one.
    assert max(end for _, end, _ in together) - min(s for s, _, _ in together) < 4 * (
        alone[1] - alone[0]
    )


def test_its_responses_endpoint_keeps_no_response(cpp_server: str) -> None:
    client = openai.OpenAI(base_url=cpp_server, api_key="none", max_retries=0)
    response = client.responses.create(
        model=local_model.MODEL_ALIAS, input="Say hi.", max_output_tokens=16, background=True
    )
    # Answered in full at once: background is not supported ...
    assert response.status == "completed" and response.output_text
    # ... and a response cannot be retrieved (what a resumed turn would need).
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    client.close()


async def test_the_responses_client_answers_there_and_asks_again_after_a_crash(
    cpp_server: str, real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """phaseline's Responses client (background asked for, ids noted) against the real server:
    it answers, streamed, its id noted; since the server keeps nothing, the same call made
    again (a resumed turn's) finds the id, meets the 404, and asks again, counted repaid."""
    ctx = ModelContext("lr", TurnInput(message="Say hi."), 1, responses=RedisResponses(
        real_client, keys))  # fmt: skip
    model = OpenAIResponses(
        model=local_model.MODEL_ALIAS, base_url=cpp_server, api_key_env=None, max_tokens=16
    )
    client = model(ctx)
    pieces: list[str] = []
    request = LLMRequest(
        turn_id="lr",
        messages=(Message(role="system", text="Be brief."), Message(role="user", text="Hi.")),
        tools_enabled=False,
        attempt=0,
        on_text=pieces.append,
    )
    reply = await client.complete(request)
    assert reply.message.text and reply.usage is not None and reply.usage.completion_tokens > 0
    assert "".join(pieces) == reply.message.text  # streamed as it came
    assert await real_client.get(keys.response("lr")) is not None
    assert client.take_repaid() == 0
    again = await client.complete(request)  # as a resumed turn would ask
    assert again.message.text and not again.adopted
    assert client.take_repaid() == 1
