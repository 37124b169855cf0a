"""The rollout worker's HTTP transport to the Gateway (`rayrl.rollout.ShardedTransport`): a connection pool per few
episodes in flight, each session's calls through one pool. Against a real local HTTP server (uvicorn) that answers
with the client's address, so the test sees which connections served which session."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import uvicorn

from rayrl.rollout import SESSIONS_PER_POOL, ShardedTransport

pytestmark = pytest.mark.unit


async def peer(scope, receive, send) -> None:
    """ASGI app: the body is the client's (host, port), i.e. the connection the request came on."""
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": f"{scope['client'][0]}:{scope['client'][1]}".encode()})


def test_pool_count_follows_the_episodes_in_flight() -> None:
    assert len(ShardedTransport(1).pools) == 1
    assert len(ShardedTransport(SESSIONS_PER_POOL).pools) == 1
    assert len(ShardedTransport(SESSIONS_PER_POOL + 1).pools) == 2
    assert len(ShardedTransport(64, sessions_per_pool=8).pools) == 8


def test_each_session_keeps_to_one_pool_and_sessions_spread_over_all() -> None:
    async def main() -> tuple[dict[str, set[str]], dict[str, int], int]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(peer, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        port = sock.getsockname()[1]
        transport = ShardedTransport(32, sessions_per_pool=8)
        conns: dict[str, set[str]] = {}
        pools: dict[str, int] = {}
        async with httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{port}") as client:
            async def session(sid: str) -> None:
                for turn in range(3):
                    r = await client.post(f"/sessions/{sid}/v1/chat/completions", json={"turn": turn})
                    assert r.status_code == 200
                    conns.setdefault(sid, set()).add(r.text)
                    pools[sid] = transport.pools.index(transport.pool(r.request))
            await asyncio.gather(*[session(f"s{i:02d}") for i in range(32)])
            other = await client.get("/health")  # not a session's call: any pool serves it
        server.should_exit = True
        await serving
        return conns, pools, other.status_code

    conns, pools, other = asyncio.run(main())
    assert other == 200 and len(conns) == 32
    by_pool: dict[int, set[str]] = {}
    for sid, p in pools.items():
        by_pool.setdefault(p, set()).update(conns[sid])
    assert len(by_pool) == 4  # 32 sessions over 4 pools by a stable hash of their ids: all used
    # connections are per pool: no connection served sessions of two pools
    seen = [c for cs in by_pool.values() for c in cs]
    assert len(seen) == len(set(seen))
