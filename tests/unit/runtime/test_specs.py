"""`open_runtime` turns the config into typed specs once (runtime/specs.py); nothing below it reads the
root config: the backends, their trainers and engines, and the RL step take their part of the spec."""

import ast
from pathlib import Path

import pytest

from rstar2_core.config import load_config
from rstar2_core.config.rl import RLConfig
from rstar2_core.config.sections import SFTConfig
from rstar2_core.rl.trainer import RL_STEP
from rstar2_core.runtime import RuntimeSpec, TrainerSpec
from rstar2_core.sft.step import SFT_STEP

ROOT = Path(__file__).resolve().parents[3]
# the translation from the config: these may name it; every other module under runtime/ and the step may not
TRANSLATORS = {"rstar2_core/runtime/specs.py", "rstar2_core/runtime/factory.py"}


def test_a_local_spec_has_one_engine_spec_per_engine_and_the_trainers_own_section():
    cfg = load_config("tiny", ["rollout.num_engines=3", "rl.seed=7"])
    spec = RuntimeSpec.from_config(cfg, policy_url="file:///ckpt", max_model_len=640,
                                   trainer=TrainerSpec("rl", 10, 2, "constant", RL_STEP), grader=False)
    assert spec.kind == "local" and spec.layout is None
    assert [e.seed for e in spec.engines] == [7, 8, 9] and {e.max_model_len for e in spec.engines} == {640}
    assert isinstance(spec.trainer.optim, RLConfig) and spec.trainer.optim == cfg.rl
    assert spec.trainer.model == cfg.model and spec.trainer.spec.total_steps == 10
    assert spec.sandbox == cfg.sandbox and spec.grader_timeout_s is None and spec.weight_sync == "state_dict"


def test_an_sft_spec_has_no_engines_sandbox_or_grader():
    cfg = load_config("tiny")
    spec = RuntimeSpec.from_config(cfg, policy_url="file:///ckpt", trainer=TrainerSpec("sft", 5, 0, "cosine", SFT_STEP),
                                   engines=False, sandbox=False, grader=False)
    assert spec.engines == () and spec.sandbox is None and spec.grader_timeout_s is None
    assert isinstance(spec.trainer.optim, SFTConfig)


def test_a_ray_spec_carries_its_layout_and_engine_specs_for_every_slot():
    cfg = load_config("tiny", ['cluster.runtime="ray"', 'rl.backend="deepspeed"', 'sft.backend="deepspeed"', 'sandbox.backend="ray"',
                               "rollout.num_engines=2", "cluster.trainer_ranks=2"])
    spec = RuntimeSpec.from_config(cfg, policy_url="file:///ckpt")
    assert spec.kind == "ray" and len(spec.layout.engines) == len(spec.engines) == 2
    assert spec.weight_sync == "object_store" and {e.device for e in spec.engines} == {"cpu"}


def test_an_unknown_runtime_is_refused_with_the_valid_ones():
    cfg = load_config("tiny")
    object.__setattr__(cfg.cluster, "runtime", "slurm")       # past the config's own validation
    with pytest.raises(ValueError, match=r"unknown cluster.runtime 'slurm'; valid: \['local', 'ray'\]"):
        RuntimeSpec.from_config(cfg, policy_url="file:///ckpt")


def _config_parameters(path: Path) -> list[str]:
    """Parameters of functions in `path` that take the root config: annotated `Config`, or named
    `cfg`/`config` without a type or as `Any` (a typed section under that name is fine)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for a in node.args.args + node.args.kwonlyargs:
                ann = ast.unparse(a.annotation) if a.annotation is not None else ""
                if ann in {"Config", "'Config'"} or (a.arg in {"cfg", "config"} and ann in {"", "Any"}):
                    where = path.relative_to(ROOT) if ROOT in path.parents else path.name
                    out.append(f"{where}:{node.lineno} {node.name}({a.arg}: {ann or '?'})")
    return out


def test_nothing_below_open_runtime_takes_the_root_config():
    files = sorted((ROOT / "rstar2_core" / "runtime").rglob("*.py")) + [ROOT / "rstar2_core" / "rl" / "step.py"]
    bad = [p for f in files if str(f.relative_to(ROOT)) not in TRANSLATORS for p in _config_parameters(f)]
    assert not bad, f"take a typed section or spec instead of the root config: {bad}"


def test_the_checker_finds_a_root_config_parameter(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("def build(cfg: Any, x: int):\n    pass\n\nasync def run(*, settings: Config):\n    pass\n")
    found = _config_parameters(f)
    assert len(found) == 2 and "build(cfg: Any)" in found[0] and "run(settings: Config)" in found[1]
