"""A toy policy for RL stage tests (`toy_policy.py`): a tiny Qwen2 model SFT-ed in a few seconds of
CPU to call the Python tool with `print(1)` or `print(2)` (sometimes a misspelt `pritn` first), then
answer with what it printed. On problems whose gold answer is 1 some rollouts are right, so GRPO
groups have signal."""

from __future__ import annotations

import pytest
import torch
from toy_policy import build_toy_policy


@pytest.fixture(scope="session")
def toy_policy(tmp_path_factory):
    """(checkpoint_url, data_url, final SFT loss) of the SFT-ed toy policy and a 12-problem RL set (gold 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: intra-op threads only add contention at these sizes
    try:
        return build_toy_policy(tmp_path_factory.mktemp("toy_policy"))
    finally:
        torch.set_num_threads(n)
