"""A local cluster that rayrl starts keeps Ray's token authentication on, with a token held only in its processes'
environment: no ~/.ray/auth_token is left behind to switch auth on for a later `ray start --head`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

SCRIPT = """
import os, ray
from rayrl import cluster
from rayrl.config import load_config
cluster.connect(load_config(None, ["trainer.ray_num_cpus=2"], check_files=False))
@ray.remote
def mode():
    return os.environ.get("RAY_AUTH_MODE"), bool(os.environ.get("RAY_AUTH_TOKEN"))
print("WORKER", *ray.get(mode.remote(), timeout=120))
ray.shutdown()
"""


def test_local_cluster_leaves_no_token_file(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert "WORKER token True" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert not (tmp_path / ".ray" / "auth_token").exists()
