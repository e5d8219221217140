import json

import pytest

from rstar2_core.config import ConfigError, available_profiles, load_config
from rstar2_cli.main import main


def test_profiles_exist():
    assert {"tiny", "smol", "qwen3-14b-mi300x"} <= set(available_profiles())


def test_production_profile_has_the_papers_numbers():
    cfg = load_config("qwen3-14b-mi300x")
    assert [s.max_response_tokens for s in cfg.rl.stages] == [8192, 12288, 12288]
    assert [s.max_turns for s in cfg.rl.stages] == [10, 10, 15]
    assert [s.steps for s in cfg.rl.stages] == [300, 85, 125]
    assert cfg.rl.stages[2].dataset == "hard_subset" and cfg.rl.stages[2].reset_optimizer
    assert cfg.rl.prompts_per_step == 512
    assert cfg.rl.grpo.oversample * cfg.rl.grpo.group_size == 32 and cfg.rl.grpo.group_size == 16
    assert (cfg.rl.grpo.clip_low, cfg.rl.grpo.clip_high) == (0.2, 0.28)
    assert cfg.rl.lr == 1e-6 and cfg.rl.warmup_steps == 20 and cfg.rl.grad_clip == 1.0
    assert cfg.sft.lr == 5e-6 and cfg.sft.epochs == 3 and cfg.sft.batch_size == 128
    assert cfg.eval.k == 16 and cfg.eval.temperature == 0.6 and cfg.eval.max_turns == 30


def test_dotted_override_into_list():
    cfg = load_config("tiny", ["rl.stages.0.max_response_tokens=4096", "rl.grpo.positive_mode=lowest_penalty"])
    assert cfg.rl.stages[0].max_response_tokens == 4096
    assert cfg.rl.grpo.positive_mode == "lowest_penalty"


@pytest.mark.parametrize("override, needle", [
    ("rl.stages.0.max_response_tokens=-1", "rl.stages.0.max_response_tokens"),
    ("rl.grpo.positive_mode=best", "rl.grpo.positive_mode"),
    ("rl.grpo.clip_hgh=0.3", "rl.grpo.clip_hgh: unknown field"),
    ("sft.micro_batch_size=7", "multiple of micro_batch_size"),
    ("rl.stages.9.steps=1", "indexes a list of 3 items"),
    ("rl.grpo.resample=none", "rl.grpo.oversample = 1"),
    ("nonsense", "section.field=value"),
])
def test_bad_values_name_the_field_and_the_fix(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    assert needle in str(e.value)


def test_unknown_profile_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="tiny"):
        load_config("does-not-exist")


def test_cli_config_show(capsys):
    assert main(["config", "show", "--profile", "qwen3-14b-mi300x"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["rl"]["stages"][1]["max_response_tokens"] == 12288
    assert main(["config", "show", "--set", "sft.lr=-1"]) == 2
    assert "sft.lr" in capsys.readouterr().err
