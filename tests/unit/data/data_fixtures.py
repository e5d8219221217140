"""Configs over the fixture files for the curation tests (imported by the test modules)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from rstar2_core.config import config_dir, config_from_dict

FIX = Path(__file__).resolve().parents[2] / "fixtures"


def fixture_config(**data_overrides):
    tree = tomllib.loads((config_dir() / "tiny.toml").read_text())
    tree["data"] = {
        "sources": [
            {"url": str(FIX / "dapo_math.jsonl"), "layout": "dapo", "name": "dapo"},
            {"url": f"file://{FIX / 'openmathreasoning.jsonl'}", "layout": "openmathreasoning", "name": "omr"},
            {"url": str(FIX / "project_euler.jsonl"), "layout": "project_euler", "name": "pe"},
            {"url": str(FIX / "generic.jsonl"), "layout": "generic", "name": "generic"},
        ],
        "synthetic": {"enabled": False, "n_rl": 0, "n_eval": 0},
        "near_dup_threshold": 0.5,
        **data_overrides,
    }
    tree["eval"]["benchmarks"] = [
        {"name": "aime24", "url": str(FIX / "aime24.jsonl"), "layout": "aime"},
        {"name": "math500", "url": str(FIX / "math500.jsonl"), "layout": "math500"},
    ]
    return config_from_dict(tree, "test")

