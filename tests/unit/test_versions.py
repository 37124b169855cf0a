"""Each sampled token's policy version travels from the engine's Generation through the Gateway's session record
(-1 for the tool/env tokens between turns) to the step metrics of partial rollouts."""

from __future__ import annotations

from rayrl.metrics import version_metrics
from rayrl.types import Generation, SessionRecord, Trajectory


def test_session_record_aligns_versions_with_response_tokens():
    s = SessionRecord(session_id="s", task_id="t")
    s.record(Generation(prompt_ids=[1, 2], token_ids=[3, 4, 5], logprobs=[-0.1] * 3, finish_reason="stop",
                        policy_version=0, versions=[0, 0, 1]))  # a partial rollout: updated after two tokens
    s.record(Generation(prompt_ids=[1, 2, 3, 4, 5, 9, 9], token_ids=[6], logprobs=[-0.2], finish_reason="stop",
                        policy_version=1))  # an older engine result without per-token versions: its version
    assert s.versions == [0, 0, 1, -1, -1, 1]
    assert len(s.versions) == len(s.response_ids) == len(s.loss_mask)
    assert [v for v, m in zip(s.versions, s.loss_mask, strict=True) if not m] == [-1, -1]


def test_version_metrics_span_over_sampled_tokens_of_trained_trajectories():
    def traj(versions, ok=True):
        return Trajectory(task_id="t", group_id="g", step=0, data_source="d", response_ids=[1] * len(versions),
                          versions=versions, reward=1.0 if ok else None)

    m = version_metrics([traj([0, 0, -1, 2]), traj([1, 1]), traj([0, 5], ok=False)])
    assert m == {"policy/version_span_max": 2, "policy/version_span_mean": 1.0, "policy/mixed_version_share": 0.5}
    assert version_metrics([traj([], ok=False)]) == {}


def test_tokens_of_a_request_paused_in_place_take_the_version_of_each_update():
    from rayrl.engine import _tag

    assert _tag(5, 3, []) == [3] * 5
    assert _tag(5, 0, [(2, 1)]) == [0, 0, 1, 1, 1]
    assert _tag(6, 0, [(4, 2), (1, 1)]) == [0, 1, 1, 1, 2, 2]  # two updates, in either order
    assert _tag(3, 0, [(3, 1)]) == [0, 0, 0]  # paused after its last token: none of them is the new version's
    assert _tag(0, 0, [(0, 1)]) == []


def test_keep_kv_on_sync_needs_an_awake_vllm_engine():
    import pytest

    from rayrl.config import ConfigError, load_config

    assert load_config(None, ["engine.keep_kv_on_sync=true"]).engine.keep_kv_on_sync
    for bad in (["engine.backend=hf"], ["engine.sleep_level=1", "engine.gpus_per_engine=0.5",
                                        "learner.gpus_per_worker=0.5"]):
        with pytest.raises(ConfigError, match="engine.keep_kv_on_sync needs engine.backend=vllm"):
            load_config(None, ["engine.keep_kv_on_sync=true", *bad])
