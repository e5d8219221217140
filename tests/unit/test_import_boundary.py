"""rstar2_core stays importable without Prefect/MLflow, and only cluster/ imports ray."""

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "rstar2_core"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                mods.add(arg.value.split(".")[0])
    return mods


def test_core_has_no_prefect_or_mlflow_imports():
    bad = {str(p.relative_to(CORE)): sorted(_imports(p) & {"prefect", "mlflow", "prefect_ray"})
           for p in CORE.rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_ray_only_in_cluster():
    bad = [str(p.relative_to(CORE)) for p in CORE.rglob("*.py")
           if "ray" in _imports(p) and p.relative_to(CORE).parts[0] != "cluster"]
    assert not bad, f"ray imported outside rstar2_core/cluster/: {bad}"


def test_boundary_checker_catches_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import os\nfrom mlflow.tracking import MlflowClient\ndef f():\n    import ray\n")
    assert {"mlflow", "ray"} <= _imports(f)
