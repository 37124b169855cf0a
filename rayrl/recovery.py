"""Recovery: work lost to a dead actor is re-run, and the roles that die come back.

- In the rollout worker, an episode that failed because an actor it needs died or did not answer (`infra_role`) is
  not a failed trajectory: the task goes back to the queue (`TaskQueue.retry`, `rollout.infra_retries` times at
  most, after a back-off of `rollout.infra_retry_delay` s, doubling). Only the agent's and the reward's own errors
  are failed trajectories.
- On the driver, `Watch` follows the process id of every restartable actor (Ray restarts them: `max_restarts` in
  rayrl.cluster). A new pid is a restart, which `recover` finishes: an engine is started and gets the current
  weights, the Gateway listens again on its port, the TaskQueue is refilled with every task not yet collected (the
  driver's ledger, rayrl.train.Feeder). A role that gives no pid for `trainer.recover_timeout` s raises `RoleLost`.
- In the weight sync (`sync`), an engine that died is restarted the same way and every engine gets the weights
  (with `engine.weight_sync: broadcast`, after the process group is formed again with the new process in it).
- A learner rank is not restarted: it holds the only copy of its FSDP shard of the model and optimizer state. One
  that died in the update, the sync or a save stops the run with `LearnerLost` (one line naming it and the
  checkpoint a rerun resumes from: `trainer.save_freq` / `trainer.save_interval_s` bound what is lost).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import ray

from rayrl import checkpoint, logs, stop
from rayrl.sandbox.result import SandboxUnavailable

# Actor class -> role, for a RayActorError raised inside an agent (its message names the class).
_CLASSES = {"SandboxActor": "sandbox", "Gateway": "gateway", "Engine": "engine", "Reward": "reward",
            "TaskQueue": "queue"}


class InfraError(Exception):
    """An episode failed because `role`, an actor it needs, died or did not answer: the task is re-run."""

    def __init__(self, role: str, text: str):
        super().__init__(f"{role}: {text}")
        self.role = role


class RoleLost(ConnectionError):
    """A role died and did not come back within trainer.recover_timeout (printed as `rayrl: <this>`)."""

    def __init__(self, role: str, timeout: float):
        super().__init__(f"{role} died and did not come back within trainer.recover_timeout={timeout:g}s")
        self.role = role
        self.names = [role]  # as LearnerLost's: the console line names their logs


class LearnerLost(ConnectionError):
    """Learner ranks died (printed as `rayrl: <this>`): their FSDP shards went with them, so the run cannot go on."""

    def __init__(self, names: list[str], during: str, ckpt: str | None):
        super().__init__(f"{', '.join(names)} died during {during}; a learner rank holds the only copy of its shard "
                         f"and is not restarted: run again to resume from "
                         f"{ckpt or 'the start (no checkpoint yet)'}")
        self.names = names


def infra_role(e: BaseException) -> str | None:
    """The role whose death or silence `e` (raised in an agent) comes from, or None for the agent's own failure.
    Infrastructure: a dead or unreachable actor (RayActorError), the sandbox service down (SandboxUnavailable), the
    Gateway unreachable (a transport error, no HTTP answer), or its 5xx (the engine behind it failed or did not
    answer in time)."""
    import openai

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, InfraError):
            return e.role
        if isinstance(e, SandboxUnavailable):  # the sandbox service (E2B) failed, its retries did not help
            return "sandbox"
        if isinstance(e, ray.exceptions.RayActorError):
            return next((role for cls, role in _CLASSES.items() if cls in str(e)), "actor")
        if isinstance(e, (httpx.TransportError, openai.APIConnectionError)):
            return "gateway"
        if isinstance(e, openai.APIStatusError) and e.status_code >= 500:
            return "engine"
        e = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else (
            e.__cause__ or e.__context__)
    return None


def _pid(_actor) -> int:
    return os.getpid()


class Watch:
    """The process id of each named actor handle, polled: a new pid is a restart (`poll` returns the names); an actor
    that has not answered for `timeout` s is a lost role (`poll` raises RoleLost)."""

    def __init__(self, handles: dict[str, object], timeout: float, clock=time.monotonic):
        self.handles, self.timeout, self._clock = handles, timeout, clock
        self.pids: dict[str, int] = {}
        self._calls: dict[str, tuple[object, float]] = {}  # name -> its pid call in flight, when it was asked
        self._last_ok = dict.fromkeys(handles, clock())  # name -> when it last answered
        self._asked = dict.fromkeys(handles, float("-inf"))  # name -> when its last answered call was asked
        self._held: list[str] = []  # restarts `settle` saw that are not its own: the next poll returns them

    def poll(self, wait: float = 0.0) -> list[str]:
        """Take the answers that came since the last poll (waiting up to `wait` s for them) and ask again; returns the
        names that restarted since they last answered."""
        self._ask()
        refs = [ref for ref, _ in self._calls.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait, fetch_local=True)
        ready, restarted, self._held = set(ready), self._held, []
        for name, (ref, asked) in list(self._calls.items()):
            if ref not in ready:
                continue
            del self._calls[name]
            try:
                pid = ray.get(ref, timeout=10)
            except ray.exceptions.RayError:  # died (a restart may follow: asked again below) or gone for good
                continue
            if self.pids.get(name, pid) != pid:
                restarted.append(name)
            self.pids[name] = pid
            self._last_ok[name], self._asked[name] = self._clock(), asked
        self._ask()  # answered by the next poll
        now = self._clock()
        for name, t in self._last_ok.items():
            if now - t > self.timeout:
                raise RoleLost(name, self.timeout)
        return restarted

    def settle(self, names: list[str]) -> list[str]:
        """Poll until each of `names` has answered a call asked from now on (the answer of one asked earlier can
        predate a death); returns those of `names` that restarted. RoleLost as in `poll`."""
        t0, seen = self._clock(), []
        while any(self._asked[n] < t0 for n in names):
            seen += self.poll(wait=1.0)
        self._held += [n for n in seen if n not in names]
        return [n for n in seen if n in names]

    def _ask(self) -> None:
        for name, h in self.handles.items():
            if name not in self._calls:
                self._calls[name] = (h.__ray_call__.remote(_pid), self._clock())


def dead(handles: dict[str, object], wait: float = 10.0) -> list[str]:
    """The names of the actors in `handles` that are dead (an actor busy for `wait` s counts as alive, as does one
    whose answer could not be read: this check never raises)."""
    refs = {name: h.__ray_call__.remote(_pid) for name, h in handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait)
    out = []
    for name, ref in refs.items():
        try:
            if ref in ready:
                ray.get(ref, timeout=10)
        except ray.exceptions.RayActorError:
            out.append(name)
        except ray.exceptions.RayError:
            pass
    return out


def died_in(e: BaseException, handles: dict[str, object]) -> list[str]:
    """The names of the actors in `handles` whose death `e` reports (an ActorDiedError anywhere in its chain)."""
    ids = {err.actor_id for err in logs.chain(e) if isinstance(err, ray.exceptions.ActorDiedError)}
    return [name for name, h in handles.items() if h._actor_id.hex() in ids]


@contextlib.contextmanager
def learners_kept(learners: list, during: str, output_dir: str) -> Iterator[None]:
    """A failure in the block behind which a learner rank is dead becomes LearnerLost (one line, naming the rank and
    the checkpoint a rerun resumes from); other failures pass as they are. A rank is dead when the failure says so
    (its ActorDiedError) or when it no longer answers a call (`dead`: another rank that died meanwhile)."""
    try:
        yield
    except LearnerLost:  # said by a block within
        raise
    except Exception as e:
        if stop.found(e) is None:
            ranks = {f"learner/{r}": ln for r, ln in enumerate(learners)}
            said = died_in(e, ranks)
            silent = dead({n: h for n, h in ranks.items() if n not in said})
            if gone := [n for n in ranks if n in said or n in silent]:
                raise LearnerLost(gone, during, checkpoint.latest(output_dir)) from None
        raise


def sync(cfg, actors, version: int, before_lost: Callable[[], object] | None = None) -> None:
    """The learners' weights at `version` -> every engine (weight_sync.push). An engine that died on the way is
    restarted by Ray: it is started and given the weights (`recover`), then the others get them again. A dead learner
    raises LearnerLost; an engine that does not come back within trainer.recover_timeout raises RoleLost after
    `before_lost()` (the driver's checkpoint of this step); a failure with every engine alive as it was is raised."""
    engines = {f"engine/{i}": eng for i, eng in enumerate(actors.engines)}
    with learners_kept(actors.learners, f"the weight sync of policy version {version}", cfg.trainer.output_dir):
        try:
            push(actors.weight_sync, actors.learners, actors.engines, version, cfg.engine.sync_timeout)
            return
        except Exception as e:
            if stop.found(e) is not None:
                raise
            try:
                restarted = actors.watch.settle(list(engines))
            except RoleLost:
                if before_lost is not None:
                    before_lost()
                raise
            if not restarted:
                raise
        recover(cfg, actors, restarted, [], version)
        others = [eng for name, eng in engines.items() if name not in restarted]
        if others and actors.weight_sync != "broadcast":  # broadcast: recover gave every engine the weights
            push(actors.weight_sync, actors.learners, others, version, cfg.engine.sync_timeout)


def recover(cfg, actors, restarted: list[str], tasks: list, version: int) -> None:
    """Finish the restart of each role in `restarted` (Watch names): an engine starts and gets the learners' weights
    at `version`, the Gateway listens again on its port, the queue gets `tasks` (every task not yet collected) back.
    The RewardActor and the sandboxes are stateless: nothing to do. With `broadcast` a restarted engine is a new
    process outside the process group: every member forms a new one, and every engine gets the weights."""
    engines = [actors.engines[int(n.partition("/")[2])] for n in restarted if n.startswith("engine/")]
    for eng in engines:
        ray.get(eng.start.remote(), timeout=cfg.engine.sync_timeout + 600)
    if engines and actors.weight_sync == "broadcast":
        from rayrl import weight_sync

        weight_sync.connect(cfg, actors.learners, actors.engines, mode="broadcast")
        engines = actors.engines
    if engines and version:
        push(actors.weight_sync, actors.learners, engines, version, cfg.engine.sync_timeout)
    for name in restarted:
        role = name.partition("/")[0]
        if role == "gateway":
            i = int(name.partition("/")[2])
            ray.get(actors.gateways[i].start.remote(port=actors.gateway_ports[i]), timeout=120)
        elif role == "queue" and tasks:
            ray.get(actors.queue.put.remote(tasks), timeout=60)
        what = {"engine": f"started, weights of policy version {version} pushed", "gateway": "listening again",
                "queue": f"{len(tasks)} uncollected tasks put back"}.get(role, "stateless, nothing to restore")
        log = logs.where(logs.log_dir(cfg.trainer.output_dir, cfg.trainer.verbose), f"rayrl/{name}")
        print(f"rayrl: {name} died and was restarted ({what}){log}", file=sys.stderr)  # noqa: T201


def push(strategy: str, learners: list, engines: list, version: int, timeout: float) -> None:
    """`rayrl.weight_sync.push`, imported here: every rollout worker imports this module and needs no torch."""
    from rayrl import weight_sync

    weight_sync.push(strategy, learners, engines, version, timeout)
