"""The house's import rules, read from the source. Every import counts: at module level, inside functions
(lazy imports), `__import__`/`importlib.import_module` with a constant name, and the names a package
exports lazily (`lazy_exports(__name__, {...})`); only `if TYPE_CHECKING:` blocks, which never run, are
left out.

- rstar2_core has no Prefect/MLflow imports; nothing in the project but rstar2_core/runtime/ray/
  imports Ray (tests aside);
- data flows one way: flows -> tasks -> rstar2_core; the core imports none of tasks/, flows/,
  rstar2_cli/, bench/, tests/; tasks/ imports no flow;
- the core's sub-packages form layers (`LAYERS`, lowest first): a sub-package imports only its own
  layer or lower ones, so there is no upward arrow (data -> eval, sandbox -> runtime, ...);
- no import cycle between modules of rstar2_core, tasks/, flows/ and rstar2_cli/, nor between the
  core's sub-packages;
- benchmarks do not import test code.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "rstar2_core"
PACKAGES = ("rstar2_core", "tasks", "flows", "rstar2_cli")
RAY_HOME = CORE / "runtime" / "ray"

LAYERS = (
    {"config", "storage", "results", "faults", "errors", "lazy_exports", "progress"},   # contract types, helpers
    {"sandbox"},                                  # the tool
    {"chat"},                                     # prompt/tool format (renders sandbox results)
    {"reward"},                                   # grading (extracts answers through chat)
    {"rollout"},                                  # engines and the agent loop (chat + sandbox)
    {"data"},                                     # sources, benchmarks, curation, the synthetic task
    {"models"},                                   # models, tokenizers (trained on the synthetic task)
    {"runtime"},                                  # where a stage runs: protocol, specs, local/ and ray/
    {"sft", "eval", "rl"},                        # the stages: they run on a runtime
)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}


def _walk(tree: ast.AST):
    """ast.walk, skipping the bodies of `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not _is_type_checking(c))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(path: Path) -> set[str]:
    """Every module name `path` imports (see the module docstring); `from pkg import name` gives both
    `pkg` and `pkg.name` (the latter is a module when `name` is a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path) if ROOT in path.parents else path.stem
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    dicts = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
             for t in n.targets if isinstance(t, ast.Name)}
    mods: set[str] = set()
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args:
            name = ast.unparse(node.func)
            arg = node.args[0]
            if name in {"__import__", "importlib.import_module"}:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    mods.add(arg.value)
            elif name == "lazy_exports" and len(node.args) > 1:
                where = node.args[1]
                where = dicts.get(where.id, where) if isinstance(where, ast.Name) else where
                if isinstance(where, ast.Dict):
                    mods.update(f"{package}.{v.value}" for v in where.values if isinstance(v, ast.Constant))
    return mods


def _imports(path: Path) -> set[str]:
    return {m.split(".")[0] for m in _modules(path)}


def _files(*roots: Path):
    for root in roots:
        yield from sorted(root.rglob("*.py"))


def module_graph() -> dict[str, set[str]]:
    """{module: modules of the project it imports} over rstar2_core, tasks, flows and rstar2_cli."""
    files = {_module_name(p): p for p in _files(*(ROOT / p for p in PACKAGES))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for m in _modules(path):
            while m and m not in files:        # `pkg.name` where name is not a module: `pkg`
                m = m.rpartition(".")[0]
            if m and m != name:
                deps.add(m)
        graph[name] = deps
    return graph


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


def test_core_has_no_prefect_or_mlflow_imports():
    bad = {str(p.relative_to(CORE)): sorted(_imports(p) & {"prefect", "mlflow", "prefect_ray"})
           for p in CORE.rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_ray_is_imported_only_by_the_ray_backend():
    roots = [ROOT / p for p in PACKAGES] + [ROOT / "bench"]
    bad = [str(p.relative_to(ROOT)) for p in _files(*roots) if "ray" in _imports(p) and RAY_HOME not in p.parents]
    assert not bad, f"ray imported outside rstar2_core/runtime/ray/: {bad}"


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
              if _layer(dst) > _layer(src)}
    assert not upward, f"imports from a lower layer into a higher one: {upward}"


def test_no_cycle_between_core_subpackages():
    cycle = find_cycle({s: set(ds) for s, ds in core_graph().items()})
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_cycle_between_modules():
    cycle = find_cycle(module_graph())
    assert cycle is None, f"import cycle (lazy imports included): {' -> '.join(cycle)}"


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import os\nfrom typing import TYPE_CHECKING\nfrom mlflow.tracking import MlflowClient\n"
                 "if TYPE_CHECKING:\n    import never_run\n"
                 "def f():\n    import ray\n    from rstar2_core.eval.run import evaluate\n"
                 "    importlib.import_module('rstar2_core.eval.compare')\n"
                 "_W = {'A': 'a_mod'}\n__getattr__, __dir__ = lazy_exports(__name__, _W)\n")
    mods = _modules(f)
    assert {"mlflow", "ray", "rstar2_core"} <= _imports(f) and "never_run" not in _imports(f)
    assert {"rstar2_core.eval.run", "rstar2_core.eval.run.evaluate", "rstar2_core.eval.compare"} <= mods
    assert any(m.endswith(".a_mod") for m in mods), mods
    assert _layer("data") < _layer("eval") and _layer("sandbox") < _layer("runtime")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None
    assert find_cycle({"data": {"eval"}, "eval": {"data"}}) == ["data", "eval", "data"]


def test_the_module_graph_holds_the_known_lazy_edges():
    g = module_graph()
    assert "rstar2_core.runtime.ray.ray_runtime" in g["rstar2_core.runtime.ray"]       # lazy_exports
    assert "rstar2_core.runtime.local" in g["rstar2_core.runtime.factory"]            # inside a function
    assert "rstar2_core.runtime.ray.errors" in g["tasks.retry"]


def test_the_product_runtime_does_not_import_the_local_cluster_harness():
    """The local multi-node harness (runtime/ray/rehearsal/: several raylets on one machine) serves the CLI,
    the rehearsal and the tests; the runtime a cluster runs reaches its faults through `node_kill`."""
    g = module_graph()
    harness = "rstar2_core.runtime.ray.rehearsal"
    bad = sorted(m for m, deps in g.items() if m.startswith("rstar2_core.") and not m.startswith(harness)
                 and any(d.startswith(harness) for d in deps))
    assert not bad, f"core modules importing the local cluster harness: {bad}"
    assert any(d.startswith(harness) for d in g["rstar2_cli.cluster"])                 # the scan sees it
