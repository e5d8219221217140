"""The house's import rules, read from the source (imports inside functions count too):

- rstar2_core has no Prefect/MLflow imports, only cluster/ imports ray;
- data flows one way: flows -> tasks -> rstar2_core; the core imports none of tasks/, flows/,
  rstar2_cli/, bench/, tests/; tasks/ imports no flow;
- the core's sub-packages form layers (`LAYERS`, lowest first): a sub-package imports only its own
  layer or lower ones, so there is no upward arrow (data -> eval, sandbox -> cluster, ...) and no cycle;
- benchmarks do not import test code.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "rstar2_core"

LAYERS = (
    {"config", "storage", "results", "faults", "errors", "lazy_exports", "progress"},   # contract types, helpers
    {"sandbox"},                                  # the tool
    {"chat"},                                     # prompt/tool format (renders sandbox results)
    {"reward"},                                   # grading (extracts answers through chat)
    {"rollout"},                                  # engines and the agent loop (chat + sandbox)
    {"data"},                                     # sources, benchmarks, curation, the synthetic task
    {"models"},                                   # models, tokenizers (trained on the synthetic task)
    {"runtime"},                                  # the stage-runtime seam and its local implementation
    {"cluster"},                                  # Ray: the Ray runtime's actors; open_runtime picks one
    {"sft", "eval", "rl"},                        # the stages: they run on a runtime
)
# Upward arrows known to exist, each also asserted (xfail) by its own test below; the layer and cycle
# tests skip only these, so any new upward arrow fails them.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _modules(path: Path) -> set[str]:
    """Every module name `path` imports (absolute imports, `__import__("x")` with a constant)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                mods.add(arg.value)
    return mods


def _imports(path: Path) -> set[str]:
    return {m.split(".")[0] for m in _modules(path)}


def _subpackage(path: Path) -> str:
    rel = path.relative_to(CORE).parts
    return rel[0].removesuffix(".py")


def core_graph() -> dict[str, dict[str, list[str]]]:
    """{sub-package: {imported sub-package: [files]}} between rstar2_core's sub-packages."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for p in sorted(CORE.rglob("*.py")):
        if p.name == "__init__.py" and p.parent == CORE:
            continue
        src = _subpackage(p)
        for m in _modules(p):
            parts = m.split(".")
            if parts[0] == "rstar2_core" and len(parts) > 1 and parts[1] != src:
                graph[src][parts[1]].append(str(p.relative_to(ROOT)))
    return graph


def _layer(pkg: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if pkg in layer)


def test_core_has_no_prefect_or_mlflow_imports():
    bad = {str(p.relative_to(CORE)): sorted(_imports(p) & {"prefect", "mlflow", "prefect_ray"})
           for p in CORE.rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_ray_only_in_cluster():
    bad = [str(p.relative_to(CORE)) for p in CORE.rglob("*.py")
           if "ray" in _imports(p) and p.relative_to(CORE).parts[0] != "cluster"]
    assert not bad, f"ray imported outside rstar2_core/cluster/: {bad}"


def test_data_flows_down_from_flows_to_tasks_to_the_core():
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")}
    up = {"tasks", "flows", "rstar2_cli", "bench", "tests"} | test_modules
    bad = {str(p.relative_to(ROOT)): sorted(_imports(p) & up) for p in CORE.rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}, "the core imports the pipeline, the CLI or tests"
    bad = {str(p.relative_to(ROOT)): sorted(_imports(p) & {"flows", "bench", "tests"})
           for p in (ROOT / "tasks").rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}, "tasks/ imports flows/"


def test_benchmarks_do_not_import_test_code():
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests", "conftest"}
    bad = {str(p.relative_to(ROOT)): sorted(_imports(p) & test_modules) for p in (ROOT / "bench").glob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_every_core_subpackage_has_a_layer():
    pkgs = {_subpackage(p) for p in CORE.rglob("*.py") if p != CORE / "__init__.py"}
    assert pkgs == set().union(*LAYERS)


def test_no_upward_arrow_between_core_subpackages():
    upward = {(src, dst): files for src, dsts in core_graph().items() for dst, files in dsts.items()
              if _layer(dst) > _layer(src) and (src, dst) not in KNOWN_UPWARD}
    assert not upward, f"imports from a lower layer into a higher one: {upward}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(n: str, path: list[str]) -> list[str] | None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]  # `path` ends at n and holds every node marked 1
            if m not in state and (cyc := visit(m, path + [m])):
                return cyc
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cyc := visit(n, [n])):
            return cyc
    return None


def test_no_cycle_between_core_subpackages():
    graph = {s: {d for d in ds if (s, d) not in KNOWN_UPWARD} for s, ds in core_graph().items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_data_does_not_import_eval():
    assert "eval" not in core_graph()["data"], core_graph()["data"]["eval"]


def test_sandbox_does_not_import_cluster():
    assert "cluster" not in core_graph()["sandbox"], core_graph()["sandbox"]["cluster"]


def test_the_checker_sees_imports_inside_functions_and_cycles(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import os\nfrom mlflow.tracking import MlflowClient\ndef f():\n    import ray\n"
                 "    from rstar2_core.eval.run import evaluate\n")
    assert {"mlflow", "ray", "rstar2_core"} <= _imports(f) and "rstar2_core.eval.run" in _modules(f)
    assert _layer("data") < _layer("eval") and _layer("sandbox") < _layer("cluster")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None
    assert find_cycle({"data": {"eval"}, "eval": {"data"}}) == ["data", "eval", "data"]
