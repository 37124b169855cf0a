"""`python -m rayrl ...` is the `rayrl` command: `ray job submit -- python -m rayrl train JOB.yaml` reports a config
error in well under a second, where `python -m rayrl.train` first imports ray, torch and verl (seconds)."""

import sys

from rayrl.cli import main

sys.exit(main())
