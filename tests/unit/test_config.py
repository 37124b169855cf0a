"""rayrl.config: every bad config is a ConfigError naming the field and the value; good ones load typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rayrl.config import Config, ConfigError, check_cluster, load_config, staleness_warning

AGENTS_MODULE = "rayrl_test_agents"


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A real importable agent module (and one that fails on import); returns the 'module:function' override."""
    (tmp_path / f"{AGENTS_MODULE}.py").write_text("async def agent(ctx, config):\n    return {'reward': 1.0}\n")
    (tmp_path / "rayrl_test_broken_agent.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return f"rollout.agent={AGENTS_MODULE}:agent"


def _error(agent: str, overrides: list[str], yaml_text: str | None = None) -> str:
    path = None
    if yaml_text is not None:
        path = "job.yaml"
        Path(path).write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        load_config(path, [agent, *overrides])
    return str(e.value)


# --- bad configs -------------------------------------------------------------------------------

BAD = [
    # (id, yaml file text or None, overrides, fragments the message must hold)
    ("unknown-section", "optimizer:\n  lr: 0.1\n", [], ["unknown config key optimizer"]),
    ("unknown-key", None, ["rollout.nn=4"], ["unknown config key rollout.nn (did you mean rollout.n?)"]),
    ("unknown-keys-all", "model:\n  dtpe: float32\ntrainer:\n  total_step: 3\n", [],
     ["unknown config keys: model.dtpe (did you mean model.dtype?); trainer.total_step (did you mean "
      "trainer.total_steps?)"]),
    ("wrong-type", None, ["rollout.n=four"], ["rollout.n must be int", "'four'"]),
    ("bool-for-int", None, ["rollout.n=true"], ["rollout.n must be int", "True"]),
    ("float-not-number", None, ["learner.lr=fast"], ["learner.lr must be float", "'fast'"]),
    ("section-not-mapping", "trainer: 5\n", [], ["trainer must be a mapping", "5"]),
    ("negative-kv-cache", None, ["engine.gpu_kv_cache_gb=-1"], ["engine.gpu_kv_cache_gb must be >= 0", "-1"]),
    ("gpu-kv-cache-on-cpu", None, ["engine.gpu_kv_cache_gb=3"],
     ["engine.gpu_kv_cache_gb=3.0 is for vLLM engines on a GPU", "engine.kv_cache_gb"]),
    ("batch-not-divisible", None, ["trainer.batch_size=8", "learner.mini_batch_size=3"],
     ["trainer.batch_size (8)", "learner.mini_batch_size (3)"]),
    ("negative-mini-batch", None, ["learner.mini_batch_size=-4"], ["learner.mini_batch_size", "-4"]),
    ("ranks-not-dividing", None, ["learner.num_workers=3"], ["learner.num_workers (3)", "8 x 4 = 32"]),
    ("grpo-n-1", None, ["rollout.n=1"], ["rollout.n=1", "GRPO"]),
    ("no-gateway", None, ["gateway.num_gateways=0"], ["gateway.num_gateways must be >= 1, got 0"]),
    ("gateway-without-worker", None, ["gateway.num_gateways=3", "rollout.num_workers=2"],
     ["gateway.num_gateways=3 > rollout.num_workers=2"]),
    ("gateways-for-a-fixed-url-service", None, ["gateway.num_gateways=2", "rollout.num_workers=2",
                                                "rollout.agent=rayrl.agents.http_service:agent"],
     ["gateway.num_gateways=2", "fixed URL", "keep one Gateway"]),
    ("bypass-with-is", None, ["algo.rollout_correction.bypass_mode=true", "algo.rollout_correction.rollout_is=token"],
     ["algo.rollout_correction.bypass_mode=true", "rollout_is=token", "set both to null"]),
    ("too-long", None, ["data.max_prompt_length=900"],
     ["data.max_prompt_length (900)", "rollout.max_response_length (128)", "engine.max_model_len (1024)"]),
    ("missing-dataset", None, ["data.source=/nonexistent/train.parquet"],
     ["data.source", "'/nonexistent/train.parquet'", "does not exist"]),
    ("dataset-wrong-kind", None, ["data.val_source=val.csv"], ["data.val_source='val.csv'"]),
    ("unknown-gym-task", None, ["data.source=reasoning_gym:no_such_task"],
     ["data.source", "unknown reasoning-gym task 'no_such_task'"]),
    ("agent-no-import", None, ["rollout.agent=no_such_module_xyz:agent"],
     ["rollout.agent='no_such_module_xyz:agent'", "cannot import module"]),
    ("agent-raises-on-import", None, ["rollout.agent=rayrl_test_broken_agent:agent"],
     ["rollout.agent='rayrl_test_broken_agent:agent'", "boom at import"]),
    ("agent-empty-module", None, ["rollout.agent=:agent"], ["rollout.agent=':agent'"]),
    ("agent-no-function", None, [f"rollout.agent={AGENTS_MODULE}:nope"],
     [f"rollout.agent='{AGENTS_MODULE}:nope'", "no function 'nope'"]),
    ("agent-no-colon", None, ["rollout.agent=just_a_name"], ["rollout.agent='just_a_name'", "module:function"]),
    ("reward-fn-missing", None, ["reward.fn=no_such_module_xyz:score"], ["reward.fn='no_such_module_xyz:score'"]),
    ("bad-logger", None, ["trainer.logger=[console,slack]"], ["trainer.logger=['console', 'slack']"]),
    ("override-no-equals", None, ["trainer.total_steps"], ["override 'trainer.total_steps'", "section.field=value"]),
    ("override-bad-yaml", None, ["trainer.logger=[console"], ["override 'trainer.logger=[console'", "not valid YAML"]),
    ("override-into-scalar", "trainer:\n  total_steps: 3\n", ["trainer.total_steps.x=1"],
     ["'total_steps' is not a section"]),
    ("yaml-not-parsing", "trainer: [unclosed\n", [], ["job.yaml", "not valid YAML"]),
    ("yaml-line-column", "model:\n  path: smollm2\n trainer: [\n", [], ["not valid YAML at line 3, column 2"]),
    ("yaml-not-mapping", "- a\n- b\n", [], ["job.yaml", "mapping", "list"]),
    ("resume-nowhere", None, ["trainer.resume=/nonexistent/ckpt"], ["trainer.resume='/nonexistent/ckpt'"]),
    ("bad-loss-agg", None, ["algo.loss_agg_mode=mean"], ["algo.loss_agg_mode='mean'"]),
    ("dual-clip-below-1", None, ["algo.clip_ratio_c=1.0"], ["algo.clip_ratio_c", "1.0"]),
    ("temperature", None, ["rollout.temperature=0"], ["rollout.temperature", "0.0"]),
    ("val-top-p", None, ["trainer.val_top_p=1.5"], ["trainer.val_top_p", "1.5"]),
    ("val-temperature-type", None, ["trainer.val_temperature=hot"], ["trainer.val_temperature", "'hot'"]),
    ("token-budget", None, ["learner.max_tokens_per_micro_batch=-1"], ["learner.max_tokens_per_micro_batch", "-1"]),
    ("bucket-size", None, ["engine.sync_bucket_mb=0"], ["engine.sync_bucket_mb", "0"]),
    ("bad-backend", None, ["engine.backend=tgi"], ["engine.backend='tgi'"]),
    ("model-path", None, ["model.path=/nonexistent/model"], ["model.path", "'/nonexistent/model'"]),
]


@pytest.mark.parametrize("yaml_text,overrides,fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_names_field_and_value(agent: str, yaml_text: str | None, overrides: list[str],
                                          fragments: list[str]) -> None:
    msg = _error(agent, overrides, yaml_text)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    assert "\n" not in msg  # one line: the CLI prints it after "rayrl: config error: "


def test_missing_job_file() -> None:
    with pytest.raises(ConfigError, match=r"job file '/nonexistent/job.yaml' does not exist"):
        load_config("/nonexistent/job.yaml")


def test_loading_and_validating_import_no_ray_torch_verl() -> None:
    """What makes `rayrl train BAD.yaml` answer in well under a second: a bad config and the default one are loaded
    and validated (agent, reward and gym checks included) in a fresh interpreter that never imports them."""
    code = ("import sys\n"
            "from rayrl.config import ConfigError, load_config\n"
            "try:\n"
            "    load_config(None, ['trainer.batch_size=6', 'learner.mini_batch_size=4'])\n"
            "except ConfigError as e:\n"
            "    print(e)\n"
            "load_config()\n"
            "print(sorted(m for m in ('ray', 'torch', 'verl', 'vllm') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["trainer.batch_size (6) must be divisible by learner.mini_batch_size (4)", "[]"]


def test_check_cluster_too_many_gpus(agent: str) -> None:
    cfg = load_config(None, [agent, "engine.num_engines=2", "engine.gpus_per_engine=1", "learner.num_workers=2",
                             "learner.gpus_per_worker=1"])
    with pytest.raises(ConfigError) as e:
        check_cluster(cfg, {"CPU": 16.0, "GPU": 2.0})
    assert "engine.num_engines x engine.gpus_per_engine" in str(e.value)
    assert "= 4 GPUs, but the cluster has 2" in str(e.value)
    check_cluster(cfg, {"GPU": 4.0})  # enough: no error
    check_cluster(load_config(None, [agent]), {})  # a CPU-only run needs no GPU key at all


# --- good configs ------------------------------------------------------------------------------


def test_defaults_load(agent: str) -> None:
    cfg = load_config(None, [agent])
    want = Config()
    want.rollout.agent = f"{AGENTS_MODULE}:agent"
    assert cfg == want
    assert cfg.to_dict()["trainer"]["logger"] == ["console"]


@pytest.mark.parametrize(("overrides", "warned"), [
    ([], False),                                                                         # synchronous
    (["algo.max_staleness=2"], True),                                                    # stale, uncorrected
    (["algo.max_staleness=1", "algo.rollout_correction.rollout_is=token"], False),       # truncated IS
    (["algo.max_staleness=1", "algo.rollout_correction.rollout_rs=token_k1",
      "algo.rollout_correction.rollout_rs_threshold=2.0"], False),                       # rejection
    (["algo.max_staleness=1", "algo.rollout_correction.bypass_mode=true"], False)])      # PPO clip against the engine
def test_async_without_a_rollout_correction_is_warned(agent: str, overrides: list[str], warned: bool) -> None:
    line = staleness_warning(load_config(None, [agent, *overrides]))
    assert (line is not None) == warned
    if warned:
        assert "algo.max_staleness=2" in line and "algo.rollout_correction.rollout_is=token" in line


def test_default_agent_exists() -> None:
    pytest.importorskip("rayrl.agents.single_turn", reason="rayrl/agents/single_turn.py not written yet")
    assert load_config().rollout.agent == "rayrl.agents.single_turn:agent"


def test_yaml_file_plus_overrides_are_coerced(agent: str) -> None:
    Path("job.yaml").write_text(
        "trainer:\n  total_steps: 10\n  batch_size: 4\n"
        "learner:\n  lr: 1e-6\n"  # PyYAML reads 1e-6 as a string; a float field takes it anyway
        "algo:\n  clip_ratio_c: 4\n"  # int in a float field
        "rollout:\n  agent_config: {max_turns: 3}\n")
    cfg = load_config("job.yaml", [agent, "trainer.total_steps=3", "algo.kl_loss_coef=1", "learner.betas=[0.9, 0.95]",
                                   "data.val_source=null", "rollout.agent_config.tool=python"])
    assert cfg.trainer.total_steps == 3 and type(cfg.trainer.total_steps) is int  # override beats the file
    assert cfg.trainer.batch_size == 4  # from the file
    assert cfg.learner.lr == 1e-6 and type(cfg.learner.lr) is float
    assert cfg.algo.clip_ratio_c == 4.0 and type(cfg.algo.clip_ratio_c) is float
    assert cfg.algo.kl_loss_coef == 1.0 and type(cfg.algo.kl_loss_coef) is float
    assert cfg.learner.betas == (0.9, 0.95)
    assert cfg.data.val_source is None
    assert cfg.rollout.agent_config == {"max_turns": 3, "tool": "python"}
    assert cfg.rollout.n == 4  # untouched default


def test_logger_override_list_or_single(agent: str) -> None:
    cfg = load_config(None, [agent, "trainer.logger=[console,tensorboard]"])
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert load_config(None, [agent, "trainer.logger=tensorboard"]).trainer.logger == ["tensorboard"]


def test_existing_files_are_accepted(agent: str, tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "ckpt").mkdir()
    cfg = load_config(None, [agent, f"data.source={tmp_path / 'train.jsonl'}", f"trainer.resume={tmp_path / 'ckpt'}",
                             "learner.mini_batch_size=4"])
    assert cfg.data.source.endswith("train.jsonl") and cfg.trainer.resume.endswith("ckpt")
    # check_files=False skips the file and gym checks (e.g. on a driver whose data lives on the workers)
    load_config(None, [agent, "data.source=/on/the/workers/train.parquet"], check_files=False)


def test_e2b_sandbox_without_its_package(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", None)  # what an environment without it looks like
    with pytest.raises(ConfigError, match=r"sandbox.backend='e2b' needs the e2b-code-interpreter"):
        load_config(None, ["sandbox.backend=e2b"])


def test_the_agents_old_sandbox_section_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"rollout.agent_config.sandbox is no longer read: move it to the top-level"):
        load_config(None, ["rollout.agent_config={sandbox: {backend: e2b}}"])


@pytest.mark.parametrize("agent, agent_config, message", [
    ("builtins:len", {}, r"must take \(ctx, config\)"),
    ("os.path:join", {}, "must be an async function"),
    ("rayrl.agents.tool_agent:agent", {"max_turn": 3}, "rollout.agent_config.max_turn is not a setting"),
    ("rayrl.agents.tool_agent:agent", {"max_turns": 0}, "max_turns must be an integer >= 1"),
    ("rayrl.agents.tool_agent:agent", {"tools": [{"builtin": "web"}]}, "the only built-in tool is code_interpreter"),
])
def test_agent_checked_before_start(agent, agent_config, message):
    import json

    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"rollout.agent={agent}", f"rollout.agent_config={json.dumps(agent_config)}"],
                    check_files=False)


def test_model_path_must_be_a_model_folder(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError, match="has no config.json: not a Hugging Face model folder"):
        load_config(None, [f"model.path={tmp_path}"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"has no weights \(\*.safetensors or \*.bin\)"):
        load_config(None, [f"model.path={tmp_path}"])
