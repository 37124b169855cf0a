"""Puts the repo root on sys.path so `tests.*` helpers import in pytest and in spawned subprocesses."""

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
