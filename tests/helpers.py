"""What the tests share: job overrides for the tiny model, agents and scorers that configs name by dotted path
("tests.helpers:slow_agent"), a canned `ctx.llm`, the trace-format check, and throwaway `ray start` clusters.

Ray workers and the reward pool's subprocesses import this module by those paths (the test cluster puts the repo
on PYTHONPATH), so it imports nothing heavy at module load: openai and psutil only inside the helpers using them.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any

from rayrl.agent import TaskContext
from rayrl.types import Task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_overrides(model: str, out: str, **extra) -> list[str]:
    """A job sized for the tiny model on 2 cores: seconds per step."""
    base = {"model.path": model, "trainer.output_dir": out, "trainer.batch_size": 4, "rollout.n": 4,
            "rollout.max_response_length": 24, "engine.kv_cache_gb": 1, "engine.max_model_len": 512,
            "data.size": 200, "data.max_prompt_length": 128, "learner.lr": 1e-3, "trainer.total_steps": 2,
            # the random model never solves arithmetic: a reward its samples differ on gives GRPO real gradients
            "reward.fn": "tests.helpers:digit_count", "rollout.temperature": 1.0,
            "gateway.port": 0}  # any free port: tests may run next to a job holding 8001
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, interval: float = 0.5):
    """Polls `pred` until it returns something truthy or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


# --- agents (rollout.agent: "tests.helpers:<name>") ---------------------------------------------------------

async def slow_agent(ctx: TaskContext, config: dict) -> dict:
    """Sleeps first, so a test can kill the worker while it holds leases."""
    await asyncio.sleep(config.get("sleep", 3.0))
    reply = await ctx.llm.chat.completions.create(messages=ctx.messages, max_tokens=4)
    return {"reward": float(len(reply.choices[0].message.content) % 2), "answer": None, "metadata": {}}


async def flaky_agent(ctx: TaskContext, config: dict) -> dict:
    """Raises on every third sample, after one LLM call: a failed trajectory, and the run goes on."""
    reply = await ctx.llm.chat.completions.create(messages=ctx.messages)
    if ctx.task.task_id.endswith("/2"):
        raise RuntimeError("tool crashed")
    return {"reward": None, "answer": reply.choices[0].message.content, "metadata": {}}


TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]


async def gateway_tool_agent(ctx: TaskContext, config: dict) -> dict:
    """`turns` model turns with a tool call + tool result between them, the history fed back as an OpenAI agent
    does. The random test model cannot be relied on to emit tool calls, so the assistant messages carry made-up
    tool_calls next to the content the Gateway returned. Records what each response said, for the test."""
    messages, seen = ctx.messages, []
    turns = config.get("turns", 3)
    for k in range(turns):
        max_tokens = config.get("max_tokens", 8)
        r = await ctx.llm.chat.completions.create(messages=messages, tools=TOOLS, max_tokens=max_tokens,
                                                  temperature=0.0, logprobs=True)
        c = r.choices[0]
        seen.append({"content": c.message.content, "logprobs": [t.logprob for t in c.logprobs.content],
                     "completion_tokens": r.usage.completion_tokens, "finish_reason": c.finish_reason})
        if k == turns - 1:
            break
        args = json.dumps({"a": k, "b": 1})
        call = {"id": f"call_{k}", "type": "function", "function": {"name": "add", "arguments": args}}
        messages = messages + [{"role": "assistant", "content": c.message.content, "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": f"call_{k}", "content": str(k + 1)}]
    return {"reward": 1.0, "answer": seen[-1]["content"], "metadata": {"seen": seen}}


async def plain_agent(ctx: TaskContext, config: dict) -> dict:
    """One call with no sampling arguments: temperature and top_p come from the session (task.sampling)."""
    t0 = time.time()
    r = await ctx.llm.chat.completions.create(messages=ctx.messages, max_tokens=config.get("max_tokens", 16))
    t1 = time.time()
    events = [{"name": "llm", "start": t0, "end": t1},
              {"name": "tool:lookup", "start": t1, "end": time.time(), "cat": "tool"}]
    return {"reward": 0.0, "answer": r.choices[0].message.content, "metadata": {"events": events}}


# --- scorers (reward.fn: "tests.helpers:<name>"; top-level so the reward pool's subprocesses import them) -----

def exact(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """1.0 when the answer equals the ground truth (after strip), else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def slow_or_exact(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """Sleeps extra_info["sleep"] seconds first (to run past the pool's timeout), then scores like `exact`."""
    time.sleep(float(extra_info.get("sleep", 0)))
    return exact(data_source, solution_str, ground_truth, extra_info)


def raising(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    raise ValueError(f"cannot score {solution_str!r}")


def dict_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> dict:
    """verl-style dict result."""
    return {"score": 0.5, "acc": True}


def not_a_number(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> Any:
    return "high"


def crash(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """Kills its own process, as a segfaulting native library would."""
    os._exit(3)


def digit_count(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """A reward a random tiny model's samples differ on (digits in the reply, mod 3): GRPO groups get signal."""
    return float(sum(ch.isdigit() for ch in solution_str) % 3)


def reward_request(task_id: str, answer: str, truth: str = "5", sleep: float = 0.0):
    """A RewardRequest for the scorers above; `sleep` makes `slow_or_exact` take that long."""
    from rayrl.scoring import RewardRequest

    return RewardRequest(task_id=task_id, data_source="test", solution_str=answer, ground_truth=truth,
                         extra_info={"sleep": sleep})


# --- a canned ctx.llm for agents run without an engine -------------------------------------------------------

def completion(content: str | None = None, tool_calls: list[tuple[str, dict]] = (), finish: str | None = None):
    """A ChatCompletion with `content` and the given (name, arguments) tool calls."""
    from openai.types.chat import ChatCompletion

    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
             for i, (name, args) in enumerate(tool_calls)]
    message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    return ChatCompletion.model_validate({
        "id": "cmpl", "object": "chat.completion", "created": 0, "model": "policy",
        "choices": [{"index": 0, "message": message,
                     "finish_reason": finish or ("tool_calls" if calls else "stop")}]})


class FakeLLM:
    """`ctx.llm` stand-in: chat.completions.create returns the canned replies in order and records each request."""

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)
        self.requests: list[dict] = []
        self.chat = self
        self.completions = self

    async def create(self, **kw):
        self.requests.append(json.loads(json.dumps(kw)))  # a snapshot: the agent keeps appending to its list
        return self.replies.pop(0)


def make_ctx(llm: FakeLLM, sandbox=None) -> TaskContext:
    task = Task(task_id="g/0", group_id="g", step=0, ground_truth="34", data_source="math_dapo",
                messages=[{"role": "user", "content": "What is 2 ** 5 + 2?"}])
    return TaskContext(task=task, llm=llm, sandbox=sandbox)


# --- trace.json ----------------------------------------------------------------------------------------------

TRACE_PHASES = {"X", "M"}
TRACE_METADATA = {"process_name", "process_sort_index", "thread_name"}


def check_trace_format(doc: dict) -> list[dict]:
    """The trace-event format as Perfetto / chrome://tracing read it (JSON object form). Returns the X events."""
    assert set(doc) >= {"traceEvents"} and isinstance(doc["traceEvents"], list)
    xs = []
    for e in doc["traceEvents"]:
        assert e["ph"] in TRACE_PHASES, e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in TRACE_METADATA and isinstance(e["args"], dict), e
            continue
        assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0, e
        assert isinstance(e.get("cat", ""), str) and isinstance(e.get("args", {}), dict), e
        json.dumps(e["args"])  # plain JSON values only
        xs.append(e)
    # Complete events on one thread must nest properly (no partial overlap), or viewers mis-draw them.
    by_thread: dict[tuple[int, int], list[dict]] = {}
    for e in xs:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs in by_thread.values():
        stack: list[int] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1], f"{e['name']} overlaps its parent partly"
            stack.append(e["ts"] + e["dur"])
    return xs


# --- a throwaway Ray cluster of `ray start` nodes on this machine, for e2e tests -----------------------------

class LocalCluster:
    """Has its own temp dir and free ports, so it never touches another test's cluster, and `stop()` kills only
    the processes it started (found by its temp dir), never `ray stop` (which stops every Ray on the machine)."""

    def __init__(self, env: dict[str, str] | None = None):
        # Short: Ray puts unix sockets under it (108-byte path limit).
        self.temp_dir = tempfile.mkdtemp(prefix="rr", dir="/tmp")
        # Token auth (Ray's default) with this cluster's own token: every `ray` command and driver gets this env.
        token = os.path.join(self.temp_dir, "auth_token")
        with open(token, "w") as f:
            f.write(secrets.token_hex(32))
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token, **(env or {})}
        for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
            self.env.pop(k, None)
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.metrics_ports: list[int] = []
        self.workers: list[list] = []  # per worker node, the processes its `ray start` left (psutil)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, args: list[str], num_cpus: int, resources: dict | None) -> None:
        metrics = free_port()
        self.metrics_ports.append(metrics)
        cmd = ["ray", "start", f"--num-cpus={num_cpus}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
               f"--metrics-export-port={metrics}", f"--dashboard-agent-listen-port={free_port()}",
               f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
               f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
               "--node-ip-address=127.0.0.1", *args]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")

    def start_head(self, num_cpus: int = 8, resources: dict | None = None) -> LocalCluster:
        self._start(["--head", f"--port={self.gcs_port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                     f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={free_port()}"],
                    num_cpus, resources)
        return self

    def add_worker(self, num_cpus: int = 4, resources: dict | None = None) -> LocalCluster:
        before = {p.pid for p in self.processes()}
        self._start([f"--address={self.address}"], num_cpus, resources)
        self.workers.append([p for p in self.processes() if p.pid not in before])  # its raylet, agents, monitor
        return self

    def kill_worker(self, i: int = 0) -> int:
        """SIGKILL every process of the i-th worker node (as a lost machine): the ones `ray start` left and the
        workers its raylet has forked since. Returns how many were killed."""
        import psutil

        procs = {p.pid: p for p in self.workers[i]}
        for p in self.workers[i]:
            try:
                procs.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
        for p in procs.values():
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(list(procs.values()), timeout=10)
        return len(procs)

    def processes(self) -> list:
        """This cluster's Ray processes (found by the temp dir or, for the head's `ray.util.client.server`, the GCS
        port in their command line) and all their descendants."""
        import psutil

        def ours(a: str) -> bool:  # the client server's --address is the node's IP with this cluster's GCS port
            return self.temp_dir in a or a.startswith("--address=") and a.endswith(f":{self.gcs_port}")

        roots = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(ours(a) for a in p.info["cmdline"] or []):
                    roots.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        found = {p.pid: p for p in roots}
        for p in roots:
            try:
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
        return list(found.values())

    def stop(self) -> None:
        import psutil

        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


INFRA = ("ray::IDLE", "ray::JobSupervisor", "ray::DashboardAgent", "ray::RuntimeEnvAgent")  # the node's, not the run's


def run_processes(cluster: LocalCluster) -> dict[int, tuple[float, str]]:
    """pid -> (create time, title) of every process the run owns: actor workers and everything below them."""
    import psutil

    out = {}
    for p in cluster.processes():
        try:
            title = " ".join(p.cmdline())
            if title.startswith("ray::") and not title.startswith(INFRA) or "EngineCore" in title:
                for q in [p, *p.children(recursive=True)]:
                    out[q.pid] = (q.create_time(), " ".join(q.cmdline())[:80])
        except psutil.NoSuchProcess:
            pass
    return out


def alive(pids: dict[int, tuple[float, str]]) -> dict[int, str]:
    """Those of `pids` (from `run_processes`) still running: pid -> title."""
    import psutil

    left = {}
    for pid, (created, title) in pids.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left[pid] = title
        except psutil.NoSuchProcess:
            pass
    return left
