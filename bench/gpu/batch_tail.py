"""Each step's batch from a run's trace (trace.json.gz of async_call.sh): when its first trajectory started, when 90%
and all of its trajectories had ended, and the tail between the two (validation episodes left out). Seconds from the
first rollout's start.

    python bench/gpu/batch_tail.py RUN/trace.json.gz
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    doc = json.load(gzip.open(path))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    t0 = min(e["ts"] for e in events if e.get("cat") == "driver" and e.get("name") == "rollout")
    by_step = defaultdict(list)
    for e in events:
        if e.get("cat") == "trajectory" and not e["args"]["task_id"].startswith("val"):
            by_step[int(e["args"]["task_id"].split("/")[0][1:])].append(e)
    print("batch  first start  90% ended  all ended  tail (all - 90%)")
    for s in sorted(by_step):
        ends = sorted((e["ts"] + e["dur"] - t0) / 1e6 for e in by_step[s])
        first = min(e["ts"] - t0 for e in by_step[s]) / 1e6
        q90 = ends[int(len(ends) * 0.9)]
        print(f"{s:5d}  {first:11.2f}  {q90:9.2f}  {ends[-1]:9.2f}  {ends[-1] - q90:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
