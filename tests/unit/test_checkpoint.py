"""rayrl.checkpoint without a learner: which checkpoints a commit prunes (by step number, never the one it wrote,
never a dir without COMPLETE), and when a step is due for a save (save_freq, save_interval_s, the end)."""

from __future__ import annotations

import os

import pytest

from rayrl import checkpoint


def save(out: str, step: int) -> str:
    return checkpoint.commit(checkpoint.begin(out, step), step, {"step": step})


def steps(out: str) -> list[str]:
    return sorted(d for d in os.listdir(checkpoint.root(out)) if d.startswith("step_"))


def test_prunes_by_step_number_not_by_name(tmp_path):
    out = str(tmp_path)
    for s in (8, 9, 10, 11):  # as names, "step_10" < "step_8" < "step_9"
        save(out, s)
    assert steps(out) == ["step_10", "step_11"]
    assert checkpoint.latest(out) == os.path.join(checkpoint.root(out), "step_11")


def test_keep_one_and_keep_zero(tmp_path):
    out = str(tmp_path / "a")
    for s in (9, 10):
        checkpoint.commit(checkpoint.begin(out, s), s, {"step": s}, keep=1)
    assert steps(out) == ["step_10"]
    out = str(tmp_path / "b")
    for s in (9, 10, 11):
        checkpoint.commit(checkpoint.begin(out, s), s, {"step": s}, keep=0)
    assert steps(out) == ["step_10", "step_11", "step_9"]


def test_a_run_resumed_from_an_older_checkpoint_sets_the_left_history_aside(tmp_path):
    """Resumed at step 4 while step_9 and step_10 exist: its step 5 stays (the newest of the run), the left
    history is renamed out of `latest`'s way (not removed), so resume=auto continues this run."""
    out = str(tmp_path)
    for s in (4, 9, 10):  # the first run, saving at 4, 9 and 10 (keep=0: all three stay)
        checkpoint.commit(checkpoint.begin(out, s), s, {"step": s}, keep=0)
    save(out, 5)
    assert steps(out) == ["step_4", "step_5"]
    assert sorted(d for d in os.listdir(checkpoint.root(out)) if d.startswith("abandoned_")) == [
        "abandoned_step_10", "abandoned_step_9"]
    assert checkpoint.latest(out) == os.path.join(checkpoint.root(out), "step_5")


def test_dirs_without_the_marker_are_neither_counted_nor_removed(tmp_path):
    out = str(tmp_path)
    save(out, 1)
    os.makedirs(os.path.join(checkpoint.root(out), "step_3"))  # of an older rayrl: never loaded
    save(out, 2)
    assert steps(out) == ["step_1", "step_2", "step_3"]
    assert checkpoint.latest(out) == os.path.join(checkpoint.root(out), "step_2")


def test_the_temp_dir_of_a_killed_save_goes_at_the_next_save(tmp_path):
    out = str(tmp_path)
    checkpoint.begin(out, 1)  # killed before its commit
    save(out, 1)
    assert steps(out) == ["step_1"]


def test_a_checkpoint_being_pruned_is_renamed_before_its_files_go(tmp_path, monkeypatch):
    """A kill in the middle of pruning step_1 (its COMPLETE already removed) must not leave a `step_1` that is never
    counted, so never pruned: the dir is renamed to a temp dir first, which the next save removes."""
    out = str(tmp_path)
    save(out, 1)
    save(out, 2)
    rmtree = checkpoint.shutil.rmtree

    def killed(path, ignore_errors=False):  # the removal stops after the marker
        if os.path.basename(path).startswith(".tmp-old-") and os.path.exists(os.path.join(path, checkpoint.MARKER)):
            os.remove(os.path.join(path, checkpoint.MARKER))
            raise KeyboardInterrupt
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save(out, 3)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    assert steps(out) == ["step_2", "step_3"]
    save(out, 4)
    assert sorted(os.listdir(checkpoint.root(out))) == ["step_3", "step_4"]


@pytest.mark.parametrize(("step", "freq", "interval", "since", "due"), [
    (4, 0, 0, 0.0, True),  # the last step (total 4) always
    (3, 0, 0, 1e9, False),  # both off: only at the end
    (2, 2, 0, 0.0, True),
    (3, 2, 0, 1e9, False),  # interval off
    (3, 2, 600, 599.9, False),
    (3, 2, 600, 600.0, True),  # 10 minutes since the last save, whatever save_freq says
    (3, 0, 600, 601.0, True),
])
def test_a_step_is_due_by_count_by_time_or_at_the_end(step, freq, interval, since, due):
    assert checkpoint.due(step, 4, freq, interval, since) is due


def test_save_interval_is_checked_and_on_by_default():
    from rayrl.config import ConfigError, load_config

    assert load_config(None, []).trainer.save_interval_s > 0  # a crash loses a bounded time by default
    assert load_config(None, ["trainer.save_interval_s=0"]).trainer.save_interval_s == 0
    with pytest.raises(ConfigError, match=r"^trainer.save_interval_s must be >= 0 \(0 = off\), got -5.0$"):
        load_config(None, ["trainer.save_interval_s=-5"])


GB = 10**9


def test_room_refuses_a_disk_that_cannot_hold_one_checkpoint():
    # the 4B shape: 4.02e9 parameters x 12 bytes = 48.2 GB, the checkpoint that filled the H200 host's disk
    with pytest.raises(checkpoint.ConfigError, match=r"trainer.output_dir '/ckpt': 40.0 GB free on its disk; one "
                       r"checkpoint of this 4.02B-parameter model needs ~48.2 GB .* export ~8.0 GB"):
        checkpoint.room("/ckpt", 4_020_000_000, 8 * GB, free=40 * GB)
    with pytest.raises(checkpoint.ConfigError):  # the checkpoint fits, the export after it does not
        checkpoint.room("/ckpt", 4_020_000_000, 8 * GB, free=50 * GB)


def test_room_warns_when_the_kept_checkpoints_and_the_next_do_not_fit():
    warning = checkpoint.room("/ckpt", 10**9, 0, free=30 * GB)  # 12 GB each: one fits, KEEP + 1 = 3 do not
    assert warning is not None and "30.0 GB free" in warning and "3 exist at once" in warning
    assert checkpoint.room("/ckpt", 10**9, 0, free=36 * GB) is None


def test_preflight_counts_the_models_parameters_from_its_config(tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    from rayrl.models import make_tiny_model, param_count

    path = make_tiny_model(str(tmp_path / "tiny"))
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    capsys.readouterr()  # transformers' progress bars
    assert param_count(path) == sum(p.numel() for p in loaded.parameters()) > 0
    n = param_count(path)
    checkpoint.preflight(str(tmp_path / "out" / "not-yet"), n, "float32", True)  # this disk has room: silent
    assert capsys.readouterr().err == ""
