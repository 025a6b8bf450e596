"""Shared fixtures: one real redis-server per session, a fresh namespace per test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import fakeredis
import pytest
import redis.asyncio as aioredis

from store.keys import KeyLayout
from store.redis.connection import StoreClient, connect
from store.redis.embedded import EmbeddedRedis
from store.redis.embedded_cluster import EmbeddedCluster

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

#: The API key the Ray workers' HTTP agents send to the test endpoint.
RAY_TEST_KEY = "sk-ray-test-key"

# Where the tests' MCP server logs each run of a tool: one file for this test session, set
# before anything imports the test agents or starts Ray (its workers inherit it).
os.environ.setdefault(
    "PHASELINE_MCP_LOG", os.path.join(tempfile.mkdtemp(prefix="phaseline-mcp-"), "runs.log")
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The port of the tests' MCP server over streamable HTTP (the ``mcp_http_server`` fixture).
os.environ.setdefault("PHASELINE_MCP_HTTP_PORT", str(_free_port()))
#: Commands run without --redis-url use an embedded server of this session, not the user's.
os.environ.setdefault("PHASELINE_DATA_DIR", tempfile.mkdtemp(prefix="phaseline-tests-redis-"))
# Where the real model server (the ``llama_server`` fixture) listens: chosen now, so the Ray
# workers of the session cluster inherit it and the llama agents of the tests reach it.
os.environ.setdefault("PHASELINE_LLAMA_URL", f"http://127.0.0.1:{_free_port()}/v1")


def _wait_until_listening(proc: subprocess.Popen[bytes], url: str, what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answers (with an error for a GET it does not serve): it listens
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.05)  # polling its port until it listens


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(data_dir=tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def keys(namespace: str) -> KeyLayout:
    return KeyLayout(namespace, shards=4)


@pytest.fixture
async def real_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    """A real local Redis Cluster for the session: three primaries with a replica each."""
    cluster = EmbeddedCluster(data_dir=tmp_path_factory.mktemp("cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["fakeredis", "real", "cluster"])
async def any_client(request: pytest.FixtureRequest) -> AsyncIterator[StoreClient]:
    """The same assertions on fakeredis, on the real server and on a real Redis Cluster (the
    store contract)."""
    client: StoreClient
    if request.param == "fakeredis":
        client = fakeredis.FakeAsyncRedis()
    elif request.param == "real":
        client = connect(request.getfixturevalue("redis_url"))
    else:
        client = connect(request.getfixturevalue("redis_cluster").url, cluster=True)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def ray_cluster(openai_server: str) -> Iterator[Cluster]:
    """One real local Ray cluster for the whole session, of two nodes (Ray's own
    ``ray.cluster_utils.Cluster``: a head and a worker node, each its own raylet), reached by
    its address as a real cluster is. Its workers inherit this process's environment as it is
    now: the test OpenAI endpoint and its key are set first."""
    import ray
    from ray.cluster_utils import Cluster

    from actors.cluster.refs import RAY_NAMESPACE
    from tests.support.agents import TEST_KEY_ENV

    os.environ["OPENAI_BASE_URL"] = openai_server
    os.environ[TEST_KEY_ENV] = RAY_TEST_KEY
    os.environ["OPENAI_API_KEY"] = RAY_TEST_KEY  # what the example agent reads

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": False,
            "object_store_memory": 512 * 1024 * 1024,
        },
    )
    cluster.add_node(num_cpus=1, include_dashboard=False)
    ray.init(
        address=cluster.address,
        namespace=RAY_NAMESPACE,
        log_to_driver=False,
        configure_logging=False,
    )
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def openai_server() -> Iterator[str]:
    """The local OpenAI-compatible server (``actors/harness/model_endpoint.py``) in its own
    process; its base URL (``http://127.0.0.1:PORT/v1``)."""
    port = _free_port()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "actors.harness.model_endpoint", str(port)], cwd=root
    )
    base = f"http://127.0.0.1:{port}"
    _wait_until_listening(proc, f"{base}/_stats", "the test OpenAI server")
    yield f"{base}/v1"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def mcp_http_server() -> Iterator[str]:
    """The tests' MCP server over streamable HTTP in its own process; its endpoint URL."""
    port = os.environ["PHASELINE_MCP_HTTP_PORT"]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.mcp_counter_server", "http", port], cwd=root
    )
    url = f"http://127.0.0.1:{port}/mcp"
    _wait_until_listening(proc, url, "the test MCP server")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real llama.cpp server (``tests/support/llama_server.py``) with a real model, in its own
    process; its base URL. Skipped where it is not installed, except in CI, where that fails."""
    from tests.support import llama_server

    missing = llama_server.available()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the real model server is part of CI: {missing}")
        pytest.skip(missing)
    url = os.environ["PHASELINE_LLAMA_URL"]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    log = tmp_path_factory.mktemp("llama") / "server.log"
    proc = llama_server.start(port, log)
    try:
        _wait_until_listening(proc, url.removesuffix("/v1") + "/v1/models", "llama.cpp's server")
    except BaseException:
        print(log.read_text(errors="replace")[-4000:])
        raise
    yield url
    proc.terminate()
    proc.wait(timeout=20)
