"""A Ray cluster made as users and KubeRay make it: ``ray start --head`` and ``ray start
--address`` in processes of their own, with Ray's token authentication on (``ray start`` turns
it on when the machine has a token). ``phaseline serve`` joins it by address alone; clients
(``submit``, ``status``, ``cancel``) find it from the namespace's owner record, with no
``--ray-address``; a client without the token, a stale address and a second serve are refused
at once, saying what to do. The multi-node tests' ``ray.cluster_utils.Cluster`` shares the test
process's token, so none of them could see this."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from tests.support.processes import (
    PHASELINE,
    ROOT,
    free_port,
    phaseline,
    ray_start,
    stop,
    token_home,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def token_env(tmp_path: Path) -> dict[str, str]:
    return token_home(tmp_path / "home")


async def test_serve_and_its_clients_on_a_cluster_made_by_ray_start(
    redis_url: str, namespace: str, token_env: dict[str, str], tmp_path: Path
) -> None:
    env = token_env
    port = free_port()
    head = ray_start(
        "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
        f"--ray-client-server-port={free_port()}", env=env, log=tmp_path / "head.log",
    )  # fmt: skip
    procs = [head]
    try:
        assert "Token authentication is enabled" in (tmp_path / "head.log").read_text()
        # Ray's own worker node needs the mode said (what docs/CLUSTER.md tells users)
        procs.append(ray_start(f"--address=127.0.0.1:{port}", "--num-cpus=1",
                               env={**env, "RAY_AUTH_MODE": "token"},
                               log=tmp_path / "worker.log"))  # fmt: skip
        where = ["--redis-url", redis_url, "--namespace", namespace]
        serve = await asyncio.create_subprocess_exec(
            PHASELINE, "serve", *where, "--ray-address", f"127.0.0.1:{port}", "--hosts", "2",
            cwd=ROOT, env={**env, "COLUMNS": "200"}, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        assert serve.stdout is not None
        seen: list[str] = []
        async with asyncio.timeout(180):
            while "serving" not in (line := (await serve.stdout.readline()).decode()):
                assert line, "".join(seen)  # it used to die here: InvalidAuthToken
                seen.append(line)

        # a client finds the deployment from the owner record: no --ray-address
        code, out = await phaseline(
            "submit", *where, "--agent", "tests.support.agents:recall", "--input", "hi there",
            "--watch", env=env,
        )  # fmt: skip
        assert code == 0, out
        assert "attached to the deployment" in out and "heard: hi there" in out, out
        code, out = await phaseline("status", *where, "--json", env=env)
        assert code == 0, out
        status = json.loads(out[out.index("{") :])
        assert {h["label"] for h in status["hosts"]} >= {"host0", "host1"}, status
        code, out = await phaseline(
            "submit", *where, "--agent", "tests.support.agents:recall", "--input",
            "#sleep 60", "--turn-id", "long", env=env,
        )  # fmt: skip
        assert code == 0, out
        code, out = await phaseline("cancel", *where, "long", env=env)
        assert code == 0 and "attached to the deployment" in out, out
        code, out = await phaseline("watch", *where, "long", env=env)
        assert "cancelled" in out, out

        # refused at once, saying what to do
        tokenless = {**env, "HOME": str(tmp_path / "elsewhere")}
        code, out = await phaseline("status", *where, env=tokenless)
        assert code == 2 and "wants its token" in out and "auth_token" in out, out
        code, out = await phaseline("status", *where, "--ray-address",
                                    f"127.0.0.1:{free_port()}", env=env)  # fmt: skip
        assert code == 2 and "no Ray cluster answers" in out, out
        code, out = await phaseline("serve", *where, env=env)
        assert code == 2 and "is served by" in out and "attach to it" in out, out
        assert "Token authentication is enabled" not in out  # no private Ray was started

        serve.send_signal(signal.SIGTERM)
        async with asyncio.timeout(120):
            rest = (await serve.stdout.read()).decode()
            assert await serve.wait() == 0, rest
    finally:
        for proc in reversed(procs):
            stop(proc)
