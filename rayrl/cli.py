"""`rayrl` command line: train | sft | trace dump | export-hf | serve | make-model."""

from __future__ import annotations

import argparse
import sys

from rayrl import machine
from rayrl.config import ConfigError, check_sft, load_config


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: rayrl train [JOB.yaml] [section.key=value ...] [--verbose]\n"
              "       rayrl sft JOB.yaml [section.key=value ...] [--verbose]   (supervised fine-tuning)\n"
              "       rayrl trace dump [RUN_DIR | JOB.yaml] [--steps FIRST LAST] -o trace.json\n"
              "       rayrl export-hf CHECKPOINT_DIR -o OUT_DIR [--model PATH] [--dtype DTYPE]\n"
              "       rayrl serve MODEL_DIR [--port 8000] [--served-model-name NAME] [-- vllm serve args]\n"
              "       rayrl make-model SHAPE OUT_DIR [--dtype bfloat16] [--untied]   (random-init seed shapes)\n\n"
              "`rayrl train` with no arguments runs the embedded default job (SmolLM2-135M, GRPO, arithmetic; on\n"
              "the first GPU where `nvidia-smi -L` lists one, else on CPU; RAYRL_DEVICE=cpu|cuda decides).\n"
              "Actors' and engines' own output goes to OUTPUT_DIR/logs/; --verbose (trainer.verbose=true) shows it.")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("train", "sft") and "--verbose" in rest:  # every actor's output on the console too
        rest = [a for a in rest if a != "--verbose"] + ["trainer.verbose=true"]
    if cmd == "train":
        return train_main(rest)
    if cmd == "sft":
        return sft_main(rest)
    if cmd == "export-hf":
        p = argparse.ArgumentParser(prog="rayrl export-hf")
        p.add_argument("checkpoint")
        p.add_argument("-o", "--out", required=True)
        p.add_argument("--model", default=None,
                       help="the base model (config + tokenizer); default: the one the checkpoint records")
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="the weights' dtype; default: the run's model.dtype, recorded in the checkpoint")
        a = p.parse_args(rest)
        from rayrl.export import export_hf

        print(export_hf(a.checkpoint, a.out, a.model, a.dtype))
        return 0
    if cmd == "trace":
        return trace_main(rest)
    if cmd == "make-model":
        return make_model_main(rest)
    if cmd == "serve":
        from rayrl.serve import main as serve_main

        return serve_main(rest)
    print(f"rayrl: unknown command {cmd!r} (train, sft, trace, export-hf, serve, make-model)", file=sys.stderr)
    return 2


def train_main(argv: list[str]) -> int:
    """`rayrl train [JOB.yaml] [section.key=value ...]`: the config is checked before ray, torch and verl load."""
    try:
        cfg, on_gpu = train_config(argv)
    except ConfigError as e:
        print(f"rayrl: config error: {e}", file=sys.stderr)
        return 2
    if on_gpu:
        print(f"rayrl: the default job on the GPU ({' '.join(machine.GPU_LAYOUT)}); RAYRL_DEVICE=cpu keeps it on CPU")
    from rayrl.train import train  # seconds of imports (ray, torch, verl): only for a config that can run

    return run_driver(train, cfg)


def train_config(argv: list[str]):
    """`rayrl train`'s arguments -> (the checked Config, whether it is the default job on a GPU). The default job on
    a machine with a CUDA GPU puts engine and learner on the first GPU (rayrl.machine); a job file says its own."""
    path = argv[0] if argv and "=" not in argv[0] else None
    if path is not None:
        return load_config(path, argv[1:]), False
    on_gpu = machine.kind() == "cuda"
    return load_config(None, [*machine.GPU_LAYOUT, *argv] if on_gpu else argv), on_gpu


def sft_main(argv: list[str]) -> int:
    """`rayrl sft JOB.yaml [section.key=value ...]`: the config is checked before ray, torch and transformers load; the
    rows before any actor starts (rayrl.sft)."""
    path = argv[0] if argv and "=" not in argv[0] else None
    try:
        cfg = load_config(path, argv[1:] if path is not None else argv)
        check_sft(cfg)
    except ConfigError as e:
        print(f"rayrl: config error: {e}", file=sys.stderr)
        return 2
    from rayrl.sft import sft

    return run_driver(sft, cfg)


def run_driver(driver, cfg) -> int:
    """Run `rayrl train`'s or `rayrl sft`'s driver; the exit code. SIGTERM (`ray job stop`) and Ctrl-C unwind the
    driver (rayrl.stop), whose `finally` stops the actors and writes the trace: one line, exit 143 / 130. Errors found
    after the CLI's config check (a bad data row, a cluster without the GPUs, no cluster at the address) are one line:
    exit 2 (config, data) or 1 (connection). An actor that failed, died or was lost for good is one line naming it,
    its error's last line and its log file (rayrl.logs.failure): exit 1."""
    import traceback

    from rayrl import logs
    from rayrl.checkpoint import latest
    from rayrl.data import DataError
    from rayrl.recovery import LearnerLost, RoleLost
    from rayrl.stop import Stopped

    folder = logs.log_dir(cfg.trainer.output_dir, cfg.trainer.verbose)
    try:
        driver(cfg)
    except Stopped as e:
        print(f"rayrl: stopped by {e.name} at step {e.step or 0} (last checkpoint: "
              f"{latest(cfg.trainer.output_dir) or 'none'})", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C before Ray started (no actor yet); after, it is a Stopped
        print("rayrl: stopped by SIGINT before the run started", file=sys.stderr)
        return 130
    except (ConfigError, DataError) as e:
        print(f"rayrl: {'config' if isinstance(e, ConfigError) else 'data'} error: {e}", file=sys.stderr)
        return 2
    except (RoleLost, LearnerLost) as e:  # not restarted, or not back in time: why is in their logs
        print(f"rayrl: {e}{''.join(logs.where(folder, 'rayrl/' + n) for n in e.names)}", file=sys.stderr)
        return 1
    except ConnectionError as e:
        print(f"rayrl: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if (line := logs.failure(e, folder)) is None:
            raise
        if cfg.trainer.verbose:  # everything: the driver's traceback too
            traceback.print_exc()
        print(f"rayrl: {line}", file=sys.stderr)
        return 1
    return 0


def make_model_main(argv: list[str]) -> int:
    """`rayrl make-model SHAPE OUT_DIR`: a random-init model of a seed shape with Qwen's tokenizer, for memory and
    speed work without downloading weights."""
    from rayrl.models import SHAPES, make_model

    p = argparse.ArgumentParser(prog="rayrl make-model", description=make_model_main.__doc__)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--untied", action="store_true", help="an untied lm_head even where the released model ties it")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(make_model(a.shape, a.out, a.dtype, a.seed, tie=False if a.untied else None))
    return 0


def trace_main(argv: list[str]) -> int:
    """`rayrl trace dump`: steps FIRST..LAST (inclusive, as numbered in the step log) of a run as one trace.json."""
    p = argparse.ArgumentParser(prog="rayrl trace dump", description=trace_main.__doc__)
    p.add_argument("action", choices=["dump"])
    p.add_argument("run", nargs="?", default=None,
                   help="the run's output_dir, or its job YAML (uses trainer.output_dir); default: the default job's")
    p.add_argument("--steps", nargs=2, type=int, metavar=("FIRST", "LAST"), default=None)
    p.add_argument("-o", "--out", required=True)
    a = p.parse_args(argv)
    from rayrl import trace

    run = a.run
    if run is None or run.endswith((".yaml", ".yml")):
        try:
            run = load_config(run, check_files=False).trainer.output_dir
        except ConfigError as e:
            print(f"rayrl: config error: {e}", file=sys.stderr)
            return 2
    first, last = a.steps or (None, None)
    try:
        print(trace.dump(run, first, last, a.out))
    except FileNotFoundError as e:
        print(f"rayrl: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
