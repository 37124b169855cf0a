"""`rayrl serve DIR`: the model behind vLLM's OpenAI server with the hermes tool parser (CPU build here). A tiny
random Qwen3 is first fine-tuned (a few seconds, plain torch) to answer one question with one hermes tool call, as an
SFT'd ReTool model does; served, it answers that question through the OpenAI client an agent uses, with
tool_choice auto, and the server hands back the parsed `tool_calls`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.integration

TOOL = {"type": "function", "function": {"name": "code_interpreter", "description": "Run Python code.",
                                         "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                        "required": ["code"]}}}


QUESTION = [{"role": "user", "content": "What is 6 * 7? Use Python."}]
CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}\n</tool_call><|im_end|>'


def _trained_to_call(base: str, out: str) -> str:
    """`base` fine-tuned until greedy decoding answers QUESTION (rendered with the tool, as served) with CALL."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    prompt = tok.apply_chat_template(QUESTION, tools=[TOOL], add_generation_prompt=True, tokenize=False)
    p_ids, a_ids = tok(prompt)["input_ids"], tok(CALL, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p_ids + a_ids])
    labels = ids.clone()
    labels[0, : len(p_ids)] = -100  # loss on the answer only
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(60):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.1, loss.item()  # greedy decoding then reproduces CALL
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_serve_answers_a_tool_call(tied_model, tmp_path):
    import httpx
    import openai

    model = _trained_to_call(tied_model, str(tmp_path / "model"))

    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # closed in finally
    proc = subprocess.Popen([sys.executable, "-m", "rayrl", "serve", model, "--port", str(port),
                             "--served-model-name", "policy", "--", "--max-model-len", "1024", "--dtype", "float32"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "not up in 300 s:\n" + (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        assert [m.id for m in client.models.list().data] == ["policy"]
        r = client.chat.completions.create(model="policy", messages=QUESTION, tools=[TOOL], tool_choice="auto",
                                           max_tokens=64, temperature=0)
        calls = r.choices[0].message.tool_calls
        assert calls, r.choices[0].message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("code_interpreter", {"code": "print(6 * 7)"})]
        out = (tmp_path / "serve.log").read_text()
        assert f"rayrl serve: {model} as 'policy' at http://127.0.0.1:{port}/v1" in out
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
