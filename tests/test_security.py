"""What the access controls documented in docs/SECURITY.md really do, on a real server."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from actors.engine import LocalEngine
from actors.scenario import parse_scenario
from bus.errors import StoreError
from store.connection import connect
from store.embedded import EmbeddedRedis
from store.keys import KeyLayout

SCENARIO = parse_scenario(
    {"name": "acl", "rounds": 2, "tools": ["echo", "counter_increment"], "payload_bytes": 50}
)


def acl_user(server: EmbeddedRedis, user: str, password: str, namespace: str) -> str:
    """The ACL pattern of docs/SECURITY.md: one user per namespace, its keys and nothing else."""
    admin = redis.Redis.from_url(server.url)
    admin.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=[f"{namespace}:*"],
        commands=["+@all", "-@dangerous", "+info"], reset=True,
    )  # fmt: skip
    admin.close()
    assert server.port is not None
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


async def test_an_acl_user_runs_turns_in_its_namespace_and_nowhere_else(tmp_path: Path) -> None:
    with EmbeddedRedis(data_dir=tmp_path) as server:
        url = acl_user(server, "team_a", "s3cret-a", "team_a")
        client = connect(url, retry_s=0)
        engine = LocalEngine(client, KeyLayout("team_a", shards=4), watchdog=None)
        stats = await engine.run_new(SCENARIO, ["a1", "a2"])
        assert stats.outcomes == {"answered": 2} and stats.all_final
        other = LocalEngine(client, KeyLayout("team_b", shards=4), watchdog=None)
        with pytest.raises(StoreError, match="No permissions to access a key"):
            await other.submit(SCENARIO, "b1")  # another namespace's keys: refused by Redis
        await client.aclose()
        admin = redis.Redis.from_url(server.url)
        assert not admin.keys("team_b:*")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url.replace("s3cret-a", "guess")).ping()
        admin.close()
