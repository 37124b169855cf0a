"""`rayrl` command line: train | export-hf."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: rayrl train [JOB.yaml] [section.key=value ...]\n"
              "       rayrl export-hf CHECKPOINT_DIR -o OUT_DIR [--model PATH]\n\n"
              "`rayrl train` with no arguments runs the embedded default job (SmolLM2-135M, GRPO, arithmetic, CPU).")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from rayrl.train import main as train_main

        return train_main(rest)
    if cmd == "export-hf":
        p = argparse.ArgumentParser(prog="rayrl export-hf")
        p.add_argument("checkpoint")
        p.add_argument("-o", "--out", required=True)
        p.add_argument("--model", default="smollm2", help="the base model the run started from (config + tokenizer)")
        a = p.parse_args(rest)
        from rayrl.export import export_hf

        print(export_hf(a.checkpoint, a.out, a.model))
        return 0
    print(f"rayrl: unknown command {cmd!r} (train, export-hf)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
