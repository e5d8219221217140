"""The production rehearsal's overlay (configs/production-rehearsal.overrides) changes sizes, devices and
endpoints only: every other key of qwen3-14b-mi300x (data layouts, SFT sources, the label check's rules,
curation, RoC, the stage schedule's shape, benchmarks, promotion, ZeRO-3) is what the rehearsal runs."""

from rstar2_cli.rehearsal import ALLOWED, differences, not_allowed, overlay_overrides
from rstar2_core.config import load_config


def test_the_overlay_changes_only_allowed_keys():
    base, rehearsed = load_config("qwen3-14b-mi300x"), load_config("qwen3-14b-mi300x", overlay_overrides())
    diffs = differences(base, rehearsed)
    assert not_allowed(diffs) == [], not_allowed(diffs)
    assert 40 <= len(diffs) <= 60, len(diffs)           # docs/rehearsal.md lists them
    # what an ML engineer would not want a rehearsal to change, it does not
    assert base.rl.grpo.model_dump(exclude={"group_size"}) == rehearsed.rl.grpo.model_dump(exclude={"group_size"})
    assert base.data.sources == rehearsed.data.sources
    assert base.data.sft_sources == rehearsed.data.sft_sources and rehearsed.rl.zero_stage == 3
    assert [b.name for b in base.eval.benchmarks] == [b.name for b in rehearsed.eval.benchmarks]
    assert rehearsed.data.label_check.enabled and rehearsed.rollout.engine == "vllm"
    # the stage schedule keeps its shape: three stages, lengths and turns that grow, stage 3 on the hard
    # subset with the optimizer reset
    st = rehearsed.rl.stages
    assert [s.dataset for s in st] == [s.dataset for s in base.rl.stages] == ["curated", "curated", "hard_subset"]
    assert st[2].reset_optimizer and st[0].max_response_tokens < st[1].max_response_tokens == st[2].max_response_tokens
    assert st[0].max_turns == st[1].max_turns < st[2].max_turns


def test_a_change_outside_the_allow_list_is_named():
    base = load_config("qwen3-14b-mi300x")
    bent = load_config("qwen3-14b-mi300x", [*overlay_overrides(), "rl.grpo.clip_high=0.3", "rl.lr=1e-3"])
    assert [k for k, _, _ in not_allowed(differences(base, bent))] == ["rl.grpo.clip_high", "rl.lr"]
    assert all(why for why in ALLOWED.values())


def test_the_rehearsed_layout_spans_two_nodes_of_one_logical_gpu():
    from rstar2_core.runtime.specs import layout_for

    layout = layout_for(load_config("qwen3-14b-mi300x", overlay_overrides()))
    assert layout.nodes * layout.gpus_per_node == 2 and len(layout.trainer_shards) == 2 and len(layout.engines) == 1
