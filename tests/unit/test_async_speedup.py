"""bench/async_speedup.py's figures from stored runs (no run needed): the accelerator-busy share from a trace, the
tables, the batch span, repeated runs."""

from __future__ import annotations

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from async_speedup import busy_share_from_trace, run_overrides


def test_run_names_give_staleness_partial_rollouts_and_the_kv_kept():
    assert run_overrides("s0") == ["algo.max_staleness=0", "engine.partial_rollout=false"]
    assert run_overrides("s1p") == ["algo.max_staleness=1", "engine.partial_rollout=true"]
    # keep_kv_on_sync is named only when on, so a baseline run of an older rayrl (without the field) still starts
    assert run_overrides("s2k") == ["algo.max_staleness=2", "engine.partial_rollout=true",
                                    "engine.keep_kv_on_sync=true"]
    for bad in ("x1", "s", "sk", "s1q"):
        with pytest.raises(SystemExit, match="expected s<staleness>"):
            run_overrides(bad)


def span(name: str, pid: int, start: float, end: float, tid: int = 0) -> dict:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start * 1e6, "dur": (end - start) * 1e6}


def test_busy_share_counts_generation_overlapping_the_update_and_leaves_validation_out(tmp_path):
    events = [
        # step 1, driver 0-10 s: rollout 0-6, update 6-8, sync 8-8.5, validation 8.5-10
        span("step 1", 1, 0, 10), span("rollout", 1, 0, 6), span("learner/train_step", 1, 6, 8),
        span("weight_sync", 1, 8, 8.5), span("validate", 1, 8.5, 10),
        span("llm", 1, 0, 2, tid=1), span("llm", 1, 3, 5, tid=1),  # a turn, a tool call (2-3 s), a turn
        span("llm", 1, 9, 10, tid=2),  # a validation episode: not training time
        # step 2, driver 10-14 s, its batch generated during step 1's update (6-8 s, another step's lane)
        span("step 2", 2, 6, 14), span("rollout", 2, 10, 10.1), span("learner/train_step", 2, 10.1, 13),
        span("weight_sync", 2, 13, 13.5), span("llm", 2, 6, 8, tid=1),
        {"name": "process_name", "ph": "M", "pid": 2, "tid": 0, "args": {"name": "step 2"}},
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    # wall: 0-8.5 and 10-14 (validation out) = 12.5 s; busy: 0-2, 3-5, 6-8.5 (step 2's generation beside step 1's
    # update, then the sync), 10.1-13.5 = 2 + 2 + 2.5 + 3.4 = 9.9 s; idle: the tool call, 5-6, 8.5-10 is validation
    assert busy_share_from_trace(str(path)) == pytest.approx(9.9 / 12.5)


def test_summarize_table_of_stored_runs_leaves_the_first_and_last_steps_out_of_the_inner_wall(tmp_path, capsys):
    from async_speedup import main

    def steps(times: list[float], val_last: float) -> str:
        rows = [{"step": i + 1, "time/step_s": t, "reward/mean": 0.5} for i, t in enumerate(times)]
        rows[-1]["time/val_s"] = val_last
        return "".join(json.dumps(r) + "\n" for r in rows)

    for name, times in (("s0", [30.0, 6.0, 6.0, 6.0, 12.0]), ("s1p", [30.0, 2.0, 5.0, 2.0, 10.0])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(steps(times, val_last=3.0))
    assert main(["--summarize", str(tmp_path), "--runs", "s0,s1p"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| s")]
    # walls less validation: s0 57 s, s1p 46 s; steps 2..4: 18 s and 9 s
    assert rows[0].startswith("| s0 | - | 5 | 57.0 | 1.00x | 18.0 | 1.00x |")
    assert rows[1].startswith("| s1p | - | 5 | 46.0 | 0.81x | 9.0 | 0.50x |")


def test_batch_span_adds_the_steps_since_the_batch_entered_the_queue_to_the_wait_for_it():
    from async_speedup import batch_span

    def steps(times: list[float], waits: list[float]) -> list[dict]:
        return [{"step": i + 1, "time/step_s": t, "time/rollout_s": w}
                for i, (t, w) in enumerate(zip(times, waits, strict=True))]

    # staleness 1: batch j entered the queue when step j-1 started. Steps 3 and 5 waited 1.9 s after a 1.1 s step:
    # spans of 3.0 s; steps 2 and 4 found their batch done (0.02 s) and do not count; steps 1 and 6 are left out
    alternating = steps([10.0, 1.1, 2.9, 1.1, 2.9, 10.0], [5.0, 0.02, 1.9, 0.02, 1.9, 0.5])
    assert batch_span(alternating, staleness=1) == pytest.approx(3.0)
    # staleness 2: step 4's batch entered when step 2 started (steps 2 and 3: 1.0 + 1.5 s) and took 0.5 s more
    assert batch_span(steps([9.0, 1.0, 1.5, 1.6, 9.0], [4.0, 0.0, 0.0, 0.5, 0.0]), staleness=2) == pytest.approx(3.0)
    # synchronous: the rollout time of steps 2..n-1
    assert batch_span(steps([9.0, 3.0, 3.2, 8.0], [4.0, 2.0, 2.2, 2.0]), staleness=0) == pytest.approx(2.1)
    assert batch_span(steps([9.0, 1.0, 9.0], [4.0, 0.01, 0.0]), staleness=1) is None  # no step waited


def test_a_name_given_twice_runs_twice_and_the_means_table_shows_each_names_range(tmp_path, capsys):
    from async_speedup import labels, main

    assert labels(["s0", "s1p", "s1p", "s0", "s0"]) == ["s0", "s1p", "s1p.2", "s0.2", "s0.3"]
    for folder, times in (("s0", [9.0, 6.0, 6.0, 9.0]), ("s1p", [9.0, 3.0, 3.0, 9.0]), ("s0.2", [9.0, 8.0, 8.0, 9.0])):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "time/step_s": t}) + "\n" for i, t in enumerate(times)))
    assert main(["--summarize", str(tmp_path), "--runs", "s0,s1p,s0"]) == 0
    out = capsys.readouterr().out
    assert "| s0.2 | - | 4 | 34.0 | 1.13x | 16.0 | 1.33x |" in out  # each run, against the first
    means = out[out.index("Means over repeated runs"):].splitlines()
    # s0: walls 30 and 34 s (mean 32), steps 2..3 12 and 16 s (mean 14); s1p: 24 s and 6 s
    assert means[3].startswith("| s0 | 2 | 32.0 (30.0-34.0) | 1.00x | 14.0 (12.0-16.0) | 1.00x |")
    assert means[4].startswith("| s1p | 1 | 24.0 | 0.75x | 6.0 | 0.43x |")
    capsys.readouterr()
    assert main(["--summarize", str(tmp_path), "--runs", "s0,s1p"]) == 0
    assert "Means over repeated runs" not in capsys.readouterr().out  # no name ran twice


def test_a_tagged_folders_runs_keep_their_own_name_in_both_tables(tmp_path, capsys):
    from async_speedup import main

    for folder, times in (("plain/s0", [9.0, 6.0, 6.0, 9.0]), ("plain/s1p", [9.0, 5.0, 5.0, 9.0]),
                          ("mps/s0", [9.0, 7.0, 7.0, 9.0]), ("mps/s1p", [9.0, 3.0, 3.0, 9.0]),
                          ("mps2/s1p", [9.0, 4.0, 4.0, 9.0])):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "time/step_s": t}) + "\n" for i, t in enumerate(times)))
    dirs = f"{tmp_path / 'plain'},{tmp_path / 'mps'}=mps,{tmp_path / 'mps2'}=mps"
    assert main(["--summarize", dirs, "--runs", "s0,s1p"]) == 0
    out = capsys.readouterr().out
    assert "| s0+mps | - | 4 | 32.0 | 1.07x | 14.0 | 1.17x |" in out  # against the untagged s0 (30 s, 12 s)
    means = out[out.index("Means over repeated runs"):].splitlines()
    assert [m.split(" | ")[0:2] for m in means[3:]] == [["| s0", "1"], ["| s1p", "1"], ["| s0+mps", "1"],
                                                       ["| s1p+mps", "2"]]
    assert means[6].startswith("| s1p+mps | 2 | 25.0 (24.0-26.0) | 0.83x | 7.0 (6.0-8.0) | 0.58x |")
