"""What the image must import, derived from the code (tests/unit/infra/test_image.py): every third-party
top-level module that rstar2_core, tasks, flows and rstar2_cli import anywhere (function-level imports
included; `if TYPE_CHECKING:` blocks left out), plus the modules the sandbox's template preloads in the
production profile, kept when the image installs the distribution that provides it (pyproject's
dependencies and the extras and packages infra/docker's `pip install` names, and the base image's torch
and vLLM, with what they require), and the modules a Dockerfile's `python -c "import ..."` check imports."""

from __future__ import annotations

import ast
import re
import shlex
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("rstar2_core", "tasks", "flows", "rstar2_cli")
BASE_IMAGE_MODULES = ("torch", "vllm")
"""What infra/docker's base images (vLLM's ROCm and CUDA images) install, with their own requirements."""


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}


def _imports(tree: ast.AST) -> set[str]:
    """Top-level names of every absolute import in `tree` (at any depth), constant `import_module` included."""
    out: set[str] = set()
    todo = [tree]
    while todo:
        node = todo.pop()
        todo.extend(c for c in ast.iter_child_nodes(node) if not _is_type_checking(c))
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in {"importlib.import_module", "__import__"}
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value.split(".")[0])
    return out


def third_party_imports() -> dict[str, list[str]]:
    """{top-level module: the files importing it} over PACKAGES, without the standard library and the
    project's own modules (its packages, and files of it imported by their bare name, as the sandbox's
    confined child imports `sbx_*`)."""
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    own = {*PACKAGES, "bench", "tests", *(p.stem for p in files)}
    found: dict[str, list[str]] = {}
    for path in files:
        for mod in _imports(ast.parse(path.read_text(), filename=str(path))):
            if mod not in sys.stdlib_module_names and mod not in own:
                found.setdefault(mod, []).append(str(path.relative_to(ROOT)))
    return found


def sandbox_preloads() -> set[str]:
    """Third-party modules the production profile's sandbox template imports when it starts."""
    from rstar2_core.config import load_config

    mods = load_config("qwen3-14b-mi300x").sandbox.preload
    return {m.split(".")[0] for m in mods} - set(sys.stdlib_module_names)


def _image_requirements(dockerfile: Path) -> list[tuple[str, frozenset[str]]]:
    """(distribution, extras) the Dockerfile's `pip install`s name: `.`/`-e .[x]` expands to pyproject's
    dependencies and those extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    reqs: list[tuple[str, frozenset[str]]] = []
    for cmd in re.findall(r"pip install ([^&;\n]+)", text):
        for word in shlex.split(cmd):
            if word.startswith("-"):
                continue
            if word.startswith("."):
                extras = re.findall(r"\w[\w-]*", word[word.find("[") + 1:]) if "[" in word else []
                specs = [*project["dependencies"], *(d for e in extras for d in project["optional-dependencies"][e])]
                reqs += [(Requirement(s).name, frozenset(Requirement(s).extras)) for s in specs]
            else:
                r = Requirement(re.sub(r"\$\{\w+\}", "0", word))
                reqs.append((r.name, frozenset(r.extras)))
    return reqs


def image_distributions(dockerfile: Path) -> set[str]:
    """Normalized names of the distributions the image holds, as far as this environment's metadata tells:
    the Dockerfile's requirements and the base image's (BASE_IMAGE_MODULES) with their requirements."""
    provided = metadata.packages_distributions()
    todo = list(_image_requirements(dockerfile))
    todo += [(d, frozenset()) for m in BASE_IMAGE_MODULES for d in provided.get(m, [m])]
    seen: set[str] = set()
    env = default_environment()
    while todo:
        name, extras = todo.pop()
        key = _norm(name)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue                                    # not installed here (a GPU-only requirement)
        for spec in requires:
            r = Requirement(spec)
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in (extras or {""})):
                todo.append((r.name, frozenset(r.extras)))
    return seen


@cache
def module_distributions() -> dict[str, set[str]]:
    return {m: {_norm(d) for d in ds} for m, ds in metadata.packages_distributions().items()}


def build_check_imports(dockerfile: Path) -> set[str]:
    """Top-level modules the Dockerfile's `python -c "..."` build check imports."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out: set[str] = set()
    for code in re.findall(r'python -c "([^"]*)"', text):
        out |= _imports(ast.parse(code.strip()))
    return out
