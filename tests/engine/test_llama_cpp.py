"""llama.cpp's own C++ server (``phaseline model-server --cpp``, built by
``scripts/build_llama_server``): started as a user starts it, it serves requests at once
through the real ``openai`` SDK, and its ``/v1/responses`` answers but keeps nothing (no
``background`` mode, no retrieval: what a durable generation on it cannot use)."""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from actors.engine.models import local_model
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
