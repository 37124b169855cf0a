"""Gateway sessions expire (rollout.session_ttl): a worker that died never closes its sessions."""

from __future__ import annotations

import time

import pytest

from rayrl.chat import ApiError
from rayrl.config import ConfigError, load_config
from rayrl.gateway import Gateway
from tests.helpers import tiny_overrides


def gateway(tiny_model, **extra) -> Gateway:
    return Gateway(load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **extra)), tiny_model, engines=[])


def test_sessions_older_than_the_ttl_are_closed_by_the_next_open(tiny_model):
    gw = gateway(tiny_model, **{"rollout.agent_timeout": 0.2, "rollout.session_ttl": 0.5})
    dead, dead_key, _ = gw.open_session("t0")  # a worker that died mid-episode: never closed
    time.sleep(0.3)
    young, _, _ = gw.open_session("t1")
    assert gw.stats()["open_sessions"] == 2 and gw.stats()["expired_sessions"] == 0
    time.sleep(0.3)
    gw.open_session("t2")  # t0 is 0.6 s old, t1 0.3 s
    assert gw.stats()["open_sessions"] == 2 and gw.stats()["expired_sessions"] == 1
    with pytest.raises(ApiError) as e:
        gw.sessions.get(dead)
    assert e.value.status == 410  # a late request of the dead episode is told it is closed
    assert gw.sessions.bind(None, dead_key, None) is None  # its key no longer binds
    assert gw.sessions.get(young).record.task_id == "t1"
    assert gw.close_session(young).task_id == "t1"  # a live episode's session closes as usual


def test_default_ttl_is_twice_the_agent_timeout_and_must_exceed_it(tiny_model):
    assert gateway(tiny_model, **{"rollout.agent_timeout": 30}).sessions.ttl == 60
    with pytest.raises(ConfigError, match=r"rollout.session_ttl=10.0 must be > rollout.agent_timeout=30"):
        gateway(tiny_model, **{"rollout.agent_timeout": 30, "rollout.session_ttl": 10})
