"""rayrl.recovery.Watch on a local Ray: a SIGKILLed actor that Ray restarts is reported once as restarted; one that
does not come back stops the run (RoleLost) after trainer.recover_timeout."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from rayrl.recovery import RoleLost, Watch

pytestmark = pytest.mark.chaos


@ray.remote(num_cpus=0)
class Stateless:
    def ping(self) -> int:
        return os.getpid()


def test_a_restart_is_reported_once_and_a_lost_role_raises(ray_cluster):
    back = Stateless.options(max_restarts=-1).remote()
    gone = Stateless.options(max_restarts=0).remote()
    w = Watch({"back": back, "gone": gone}, timeout=8.0)
    assert w.poll(wait=60) == [] and set(w.pids) == {"back", "gone"}
    first = dict(w.pids)
    os.kill(first["back"], signal.SIGKILL)
    os.kill(first["gone"], signal.SIGKILL)
    restarted, t0 = [], time.monotonic()
    with pytest.raises(RoleLost, match="gone died and did not come back within trainer.recover_timeout=8s"):
        while time.monotonic() - t0 < 60:
            restarted += w.poll(wait=0.5)
    assert restarted == ["back"] and w.pids["back"] != first["back"]
    assert ray.get(back.ping.remote(), timeout=30) == w.pids["back"]


def test_settle_waits_for_answers_asked_after_it_and_keeps_other_restarts_for_poll(ray_cluster):
    """`settle` (the weight sync's check after a failure) sees a restart even when the answer to the call asked
    before the death is still unread; a restart of a role it was not asked about is left for the next `poll`."""
    a = Stateless.options(max_restarts=-1).remote()
    b = Stateless.options(max_restarts=-1).remote()
    c = Stateless.options(max_restarts=-1).remote()
    w = Watch({"a": a, "b": b, "c": c}, timeout=60.0)
    assert w.poll(wait=60) == []
    w.poll(wait=5)  # the answers asked now are read by the next poll: a's predates its death below
    first = dict(w.pids)
    os.kill(first["a"], signal.SIGKILL)
    os.kill(first["b"], signal.SIGKILL)
    assert w.settle(["a", "c"]) == ["a"]
    assert w.pids["a"] != first["a"] and w.pids["c"] == first["c"]
    restarted, t0 = [], time.monotonic()
    while "b" not in restarted and time.monotonic() - t0 < 60:
        restarted += w.poll(wait=0.5)
    assert restarted == ["b"]
    assert w.settle(["a", "b", "c"]) == []  # nothing died since
