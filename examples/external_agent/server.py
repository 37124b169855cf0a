"""A stand-alone agent service, like the zeroclaw daemon of TACO's setup: its own process, with the LLM
endpoint and key fixed in its own config (here env vars), knowing nothing about rayrl.

POST /run {"task": "..."} -> {"answer": "...", "turns": 2}: asks the model, then asks it to check its answer,
through the OpenAI SDK at $OPENAI_BASE_URL with $OPENAI_API_KEY. The Gateway binds these calls to the
episode's session by their conversation prefix (the task text), since the URL and key are the same for all.

    OPENAI_BASE_URL=http://127.0.0.1:8001/v1 OPENAI_API_KEY=sk-fixed \
        python -m examples.external_agent.server --port 9100
"""

from __future__ import annotations

import argparse
import os

import openai
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

SYSTEM = "You are a careful assistant. Solve the task; end with <answer>...</answer>."


def app() -> Starlette:
    llm = openai.AsyncOpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8001/v1"),
                             api_key=os.environ.get("OPENAI_API_KEY", "sk-fixed"), max_retries=0)
    model = os.environ.get("AGENT_MODEL", "policy")
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "16"))

    async def run(request: Request) -> JSONResponse:
        task = (await request.json())["task"]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
        first = await llm.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Check your answer and give the final one."}]
        second = await llm.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
        return JSONResponse({"answer": second.choices[0].message.content, "turns": 2})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/run", run, methods=["POST"]), Route("/health", health)])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9100)
    a = p.parse_args()
    uvicorn.run(app(), host=a.host, port=a.port, log_level="warning")
