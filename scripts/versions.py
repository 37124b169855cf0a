"""Read versions.toml: `python scripts/versions.py KIND KEY` prints KEY's pins for KIND (cpu | cuda), one a line.

A list KEY is the kind's list followed by [common]'s (torch, torch_index, engine, remove, nodeps, lock, sdist_only).
Two keys are for bench/gpu/prepare_host.sh: `wheels` (engine + lock + nodeps, less the sdist-only ones: what the
offline bundle downloads as wheels; the host image has torch) and `sdists` (the lock's sdist-only pins).
Standard library only: it runs before anything is installed (Python >= 3.11).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

VERSIONS = Path(__file__).resolve().parent.parent / "versions.toml"


def name(spec: str) -> str:
    """`reasoning-gym==0.1.25` -> `reasoning-gym` (PEP 503 normalized: reasoning_gym and Reasoning.Gym too)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~\[;\s]", spec, maxsplit=1)[0]).lower()


def pins(kind: str, key: str, path: Path = VERSIONS) -> list[str]:
    table = tomllib.loads(path.read_text())
    if kind not in ("cpu", "cuda"):
        raise SystemExit(f"versions.py: KIND must be cpu or cuda, not {kind!r}")
    own, common = table[kind], table["common"]
    sdist_only = set(common.get("sdist_only", []))
    if key == "wheels":
        specs = pins(kind, "engine", path) + pins(kind, "lock", path) + pins(kind, "nodeps", path)
        return [s for s in specs if name(s) not in sdist_only]
    if key == "sdists":
        return [s for s in pins(kind, "lock", path) if name(s) in sdist_only]
    if key not in own and key not in common:
        raise SystemExit(f"versions.py: no key {key!r} in {path}")
    value = own.get(key, [])
    if isinstance(value, str):
        return [value] if value else []
    return [*value, *common.get(key, [])]


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print("\n".join(pins(sys.argv[1], sys.argv[2])))  # noqa: T201 - the interface
