"""`rayrl serve` on a CPU hands vLLM the settings of rayrl's CPU engines (rayrl.engine.cpu_env), and a variable the
user set wins over them."""
import json
import os

import pytest
import torch

from rayrl import serve
from rayrl.config import EngineConfig
from rayrl.engine import cpu_env

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build's settings; a GPU serve has none")]


def _exec_env(tmp_path, monkeypatch) -> dict:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    seen = {}

    def fake_exec(path, args, env):  # the process would become vLLM's server here
        seen.update(env=env, args=args)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execvpe", fake_exec)
    with pytest.raises(SystemExit):
        serve.main([str(tmp_path)])
    return seen["env"]


def test_cpu_serve_gets_the_engines_settings(tmp_path, monkeypatch):
    for k in cpu_env(4):
        monkeypatch.delenv(k, raising=False)
    env = _exec_env(tmp_path, monkeypatch)
    assert {k: env[k] for k in cpu_env(4)} == cpu_env(EngineConfig().kv_cache_gb)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_a_set_variable_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "9")
    env = _exec_env(tmp_path, monkeypatch)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "9"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
