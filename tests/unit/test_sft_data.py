"""SFT rows (rayrl.sft_data) and the chat template choice (model.chat_template, rayrl.templates): row checks name the
file and the row, the loss mask covers the assistant's tokens only, and the SFT tokens of a tool conversation equal
what the Gateway records when an engine samples the same replies."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from rayrl import templates
from rayrl.config import ConfigError, load_config
from rayrl.gateway import Gateway
from rayrl.sft_data import RowError, load_examples, tokenize
from rayrl.types import Generation
from tests.helpers import tiny_overrides

TOOLS = [{"type": "function", "function": {
    "name": "code_interpreter", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
CALL = {"type": "function", "function": {"name": "code_interpreter", "arguments": json.dumps({"code": "print(12+35)"})}}
CONVERSATION = [{"role": "system", "content": "Solve it with the tool."},
                {"role": "user", "content": "What is 12 + 35?"},
                {"role": "assistant", "content": "Let me compute.", "tool_calls": [CALL]},
                {"role": "tool", "content": "47"},
                {"role": "assistant", "content": "The answer is 47."}]
# what a model that learned these rows writes after each generation prompt (hermes tool-call format)
REPLIES = ['Let me compute.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(12+35)"}}\n'
           "</tool_call>", "The answer is 47."]


@pytest.fixture(scope="module")
def hermes_tok(tiny_model):
    return templates.tokenizer(tiny_model, "hermes")


def _segments(tok, ex) -> list[tuple[int, str]]:
    """The conversation's text in runs of equal loss mask (the prompt has mask 0)."""
    ids, mask = ex.prompt_ids + ex.response_ids, [0] * len(ex.prompt_ids) + ex.loss_mask
    runs: list[tuple[int, list[int]]] = []
    for i, m in zip(ids, mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(i)
        else:
            runs.append((m, [i]))
    return [(m, tok.decode(r)) for m, r in runs]


def test_loss_mask_is_the_assistant_tokens_only(hermes_tok):
    """Trained: each reply after `<|im_start|>assistant\\n` through its <|im_end|>. Not trained: system, tools, user,
    the assistant header, the template's newline after <|im_end|>, the tool response."""
    ex = tokenize(CONVERSATION, TOOLS, hermes_tok)
    segs = _segments(hermes_tok, ex)
    assert [m for m, _ in segs] == [0, 1, 0, 1]
    assert segs[0][1].startswith("<|im_start|>system\nSolve it with the tool.\n\n# Tools")
    assert '"name": "code_interpreter"' in segs[0][1] and segs[0][1].endswith(
        "<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n<|im_start|>assistant\n")
    assert segs[1][1] == REPLIES[0] + "<|im_end|>"
    assert segs[2][1] == "\n<|im_start|>user\n<tool_response>\n47\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert segs[3][1] == REPLIES[1] + "<|im_end|>"


class ScriptedEngine:
    """Stands in for an EngineActor handle: `generate.remote(prompt, sampling, rid)` samples the next scripted reply
    (its tokens as the tokenizer encodes the text, then the end-of-turn token)."""

    def __init__(self, tok, replies: list[str]):
        self.replies = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in replies]
        self.generate = SimpleNamespace(remote=self._generate)

    async def _generate(self, prompt, sampling, rid) -> Generation:
        ids = self.replies.pop(0)
        return Generation(list(prompt), ids, [-0.5] * len(ids), "stop", 0)


def test_sft_tokens_equal_the_gateways_recorded_tokens(tiny_model, hermes_tok):
    """An agent holds the same conversation through the Gateway (model.chat_template=hermes, as the SFT job) while the
    engine samples the rows' replies: the session's record is token for token the SFT example, loss mask included."""
    cfg = load_config(None, tiny_overrides(tiny_model, "/tmp/unused", **{
        "model.chat_template": "hermes", "engine.max_model_len": 4096}),
                      check_files=False)
    gw = Gateway(cfg, tiny_model, engines=[ScriptedEngine(hermes_tok, REPLIES)])

    async def episode():
        sid, _, _ = gw.open_session("t")
        msgs = CONVERSATION[:2]
        first = (await gw.chat({"messages": msgs, "tools": TOOLS}, sid, None))["choices"][0]
        assert first["finish_reason"] == "tool_calls"  # the Gateway's hermes parser reads the call back
        call = first["message"]["tool_calls"][0]
        assert json.loads(call["function"]["arguments"]) == {"code": "print(12+35)"}
        msgs = msgs + [first["message"], {"role": "tool", "tool_call_id": call["id"], "content": "47"}]
        second = (await gw.chat({"messages": msgs, "tools": TOOLS}, sid, None))["choices"][0]
        assert second["message"]["content"] == REPLIES[1]
        return gw.close_session(sid)

    rec = asyncio.run(episode())
    ex = tokenize(CONVERSATION, TOOLS, hermes_tok)
    assert rec.prompt_ids == ex.prompt_ids
    assert rec.response_ids == ex.response_ids
    assert rec.loss_mask == ex.loss_mask


def test_chat_template_choice(tiny_model, tmp_path):
    """null keeps the tokenizer's own (the tiny model's ChatML ignores tools, like SmolLM2's); hermes shows the tool
    schema with the model's default system text; a .jinja file is used as it is."""
    own = templates.tokenizer(tiny_model, None)
    msgs = [{"role": "user", "content": "hi"}]
    assert "code_interpreter" not in own.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    hermes = templates.tokenizer(tiny_model, "hermes").apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert hermes.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert "code_interpreter" in hermes
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert templates.tokenizer(tiny_model, str(path)).apply_chat_template(msgs, tokenize=False) == "[hi]"
    # the default system text is escaped into the template's string literals
    quoted = templates.hermes_template("It's a \"test\"\nwith two lines \\ and a backslash")
    assert "It's a \"test\"\nwith two lines \\ and a backslash" in own.apply_chat_template(
        msgs, chat_template=quoted, tokenize=False)
    assert templates.QWEN == templates.hermes_template(templates.QWEN_DEFAULT_SYSTEM)


def test_chat_template_config_errors(tiny_model, tmp_path):
    base = tiny_overrides(tiny_model, str(tmp_path))
    for value, match in [("chatml", "must be null .* 'hermes' or a .jinja file"),
                         (str(tmp_path / "missing.jinja"), "file .* does not exist")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [*base, f"model.chat_template={value}"])
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer"):
        load_config(None, [*base, f"model.path={bare}", "model.chat_template=hermes"])
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ConfigError, match="needs a ChatML tokenizer"):
        load_config(None, [*base, f"model.path={llama}", "model.chat_template=hermes"])
    assert load_config(None, [*base, "model.chat_template=hermes"]).model.chat_template == "hermes"


def _write(tmp_path, rows: list) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = {"messages": CONVERSATION, "tools": TOOLS}
BAD_ROWS = [
    ("not a row", "must be an object with messages"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "message 0 must have a role among"),
    ({"messages": CONVERSATION[1:2]}, "the last message must be the assistant's"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "the first assistant message must follow a user"),
    ({"messages": [*CONVERSATION[:2], {"role": "tool", "content": "47"}, CONVERSATION[4]], "tools": TOOLS},
     "a tool message must follow an assistant message with tool_calls"),
    ({"messages": CONVERSATION}, "names no tool of the row's tools"),
    ({"messages": CONVERSATION, "tools": "[not json"}, "tools is not valid JSON"),
    ({"messages": [*CONVERSATION[:2], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "code_interpreter", "arguments": "{bad"}}]}, *CONVERSATION[3:]], "tools": TOOLS},
     "arguments are not valid JSON"),
    ({"messages": [CONVERSATION[1], {"role": "system", "content": "late"}, CONVERSATION[4]]},
     "a system message may only come first"),
]


@pytest.mark.parametrize(("row", "match"), BAD_ROWS)
def test_a_bad_row_names_file_and_row(tmp_path, hermes_tok, row, match):
    path = _write(tmp_path, [GOOD, GOOD, row])
    with pytest.raises(RowError, match=match) as e:
        load_examples(path, hermes_tok, 4096)
    assert str(e.value).startswith(f"{path} row 3: ") and "\n" not in str(e.value)


def test_a_template_that_hides_the_tools_is_refused(tmp_path, tiny_model):
    """The tiny model's own ChatML (like SmolLM2's) drops the tool schema and the calls: refused, pointing at hermes."""
    path = _write(tmp_path, [GOOD])
    with pytest.raises(RowError, match="row 1: message 2: the chat template does not render tool 'code_interpreter'.*"
                                       "model.chat_template: hermes"):
        load_examples(path, templates.tokenizer(tiny_model, None), 4096)


def test_parquet_rows_and_truncation(tmp_path, hermes_tok):
    """verl's parquet layout (structs carry every key, tools as JSON text); a too-long row is an error naming it, or
    with truncation=right keeps its head."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist([{"messages": CONVERSATION, "tools": json.dumps(TOOLS)},
                                         {"messages": [CONVERSATION[1], CONVERSATION[4]], "tools": None}]), path)
    full = load_examples(path, hermes_tok, 4096)
    assert full[0] == tokenize(CONVERSATION, TOOLS, hermes_tok)
    assert full[1] == tokenize([CONVERSATION[1], CONVERSATION[4]], None, hermes_tok)
    limit = len(full[0].prompt_ids) + 5
    with pytest.raises(RowError, match=f"{path} row 1: .* more than sft.max_length={limit}"):
        load_examples(path, hermes_tok, limit)
    cut = load_examples(path, hermes_tok, limit, truncation="right")[0]
    assert cut.num_tokens == limit and cut.loss_mask == full[0].loss_mask[:5]
