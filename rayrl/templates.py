"""Chat templates rayrl ships (Jinja, as `tokenizer.chat_template`), and the tokenizer with the template the job
chose (`model.chat_template`), which the Gateway and `rayrl sft` both load through `tokenizer`.

QWEN is Qwen2.5-Instruct's template: ChatML turns, the tool schemas listed in the system turn inside <tools></tools>,
assistant tool calls as hermes `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, and consecutive tool
results grouped into one user turn of `<tool_response>` blocks. vLLM's hermes parser reads exactly these calls back.
"""

from __future__ import annotations

import re
from typing import Any

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
GENERIC_SYSTEM = "You are a helpful assistant."  # hermes' system turn for a model whose template adds none


def tokenizer(model_path: str, chat_template: str | None) -> Any:
    """`model_path`'s tokenizer with the chat template `model.chat_template` names: None = its own; "hermes" =
    `hermes_template` with the system text the model's own template adds by default; else a .jinja file's text.
    The Gateway (prompts and its hermes parser) and `rayrl sft` both load it here, so they render the same tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    if chat_template == "hermes":
        tok.chat_template = hermes_template(default_system(tok))
    elif chat_template is not None:
        with open(chat_template, encoding="utf-8") as f:
            tok.chat_template = f.read()
    return tok


def default_system(tok: Any) -> str:
    """The system text `tok`'s own ChatML template puts before a conversation that has no system message
    (SmolLM2: "You are a helpful AI assistant named SmolLM, ..."); GENERIC_SYSTEM when it puts none."""
    if not tok.chat_template:
        return GENERIC_SYSTEM
    text = tok.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False)
    m = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", text, re.DOTALL)
    return m.group(1) if m else GENERIC_SYSTEM


def hermes_template(default_system: str) -> str:
    """The Qwen2.5 template with `default_system` as the system turn when the conversation has none."""
    # a Jinja string literal: backslashes, quotes and newlines escaped
    default_system = default_system.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return (
        "{%- if tools %}{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
        "{%- else %}{{- '" + default_system + "' }}{%- endif %}"
        "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
        "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
        "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
        "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
        "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
        "{%- else %}"
        "{%- if messages[0]['role'] == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
        "(message.role == 'assistant' and not message.tool_calls) %}"
        "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}"
        "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
        "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
        "{%- for tool_call in message.tool_calls %}"
        "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
        "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
        "{%- else %}{{- tool_call.arguments | tojson }}"
        "{%- endif %}{{- '}\\n</tool_call>' }}"
        "{%- endfor %}{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
        "{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
        "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


QWEN = hermes_template(QWEN_DEFAULT_SYSTEM)
