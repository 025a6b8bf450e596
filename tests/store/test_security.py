"""What the access controls documented in docs/SECURITY.md really do, on a real server."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from bus.errors import StoreError
from store.keys import KeyLayout
from store.redis.connection import connect
from store.redis.embedded import SERVER_ENV, EmbeddedRedis, free_port

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
        engine = TurnEngine(client, KeyLayout("team_a", shards=4), EngineSettings(watchdog=None))
        stats = await engine.run_new(*scripted_turn(SCENARIO), ["a1", "a2"])
        assert stats.outcomes == {"answered": 2} and stats.all_final
        other = TurnEngine(client, KeyLayout("team_b", shards=4), EngineSettings(watchdog=None))
        with pytest.raises(StoreError, match="No permissions to access a key"):
            await other.submit(
                *scripted_turn(SCENARIO), "b1"
            )  # another namespace's keys: refused by Redis
        await client.aclose()
        admin = redis.Redis.from_url(server.url)
        assert not admin.keys("team_b:*")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url.replace("s3cret-a", "guess")).ping()
        admin.close()


SYSTEM_REDIS = Path("/usr/bin/redis-server")  # Debian's build has TLS; scripts/test installs it


@pytest.mark.skipif(not SYSTEM_REDIS.exists(), reason="needs a TLS-capable redis-server")
async def test_turns_over_tls_with_a_client_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rediss:// example of docs/SECURITY.md: CA file, client certificate, password."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("phaseline-client")
    files = {
        "ca.pem": ca.cert_pem, "server.pem": server_cert.cert_chain_pems[0],
        "server.key": server_cert.private_key_pem, "client.pem": client_cert.cert_chain_pems[0],
        "client.key": client_cert.private_key_pem,
    }  # fmt: skip
    for name, blob in files.items():
        blob.write_to_path(str(tmp_path / name))
    tls_port = free_port()
    monkeypatch.setenv(SERVER_ENV, str(SYSTEM_REDIS))
    tls = [
        f"tls-port {tls_port}", f"tls-cert-file {tmp_path / 'server.pem'}",
        f"tls-key-file {tmp_path / 'server.key'}", f"tls-ca-cert-file {tmp_path / 'ca.pem'}",
        "tls-auth-clients yes",
    ]  # fmt: skip
    with EmbeddedRedis(data_dir=tmp_path / "data", extra_config=tls) as server:
        base = f"rediss://:{server.password}@127.0.0.1:{tls_port}/0?ssl_ca_certs={tmp_path}/ca.pem"
        url = f"{base}&ssl_certfile={tmp_path}/client.pem&ssl_keyfile={tmp_path}/client.key"
        client = connect(url, retry_s=0)
        engine = TurnEngine(client, KeyLayout("tls", shards=2), EngineSettings(watchdog=None))
        stats = await engine.run_new(*scripted_turn(SCENARIO), ["over-tls"])
        assert stats.outcomes == {"answered": 1}
        await client.aclose()
        no_cert = connect(base, retry_s=0)  # the server wants a client certificate
        with pytest.raises(StoreError):
            await TurnEngine(no_cert, KeyLayout("tls", shards=2)).store.load("over-tls")
        await no_cert.aclose()
