"""The image holds what the pod runs: each Dockerfile's build check imports every third-party module the
code imports that the image installs (derived from the code by tests/unit/infra/image_imports.py), the
code imports nothing the image lacks unless `NOT_IN_IMAGE` says why, and the files the Dockerfile copies
are enough for `rstar2 plan --strict` and `prefect deploy` (prefect.yaml, configs, infra)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from image_imports import (
    ROOT,
    build_check_imports,
    image_distributions,
    module_distributions,
    sandbox_preloads,
    third_party_imports,
)

DOCKERFILES = ("Dockerfile.rocm", "Dockerfile.cuda")

NOT_IN_IMAGE = {
    # the rehearsal's local S3 server (rstar2_cli/local_services.py): the `dev` extra, never run in a pod
    "moto": "dev",
    # fused Triton kernels, used only when importable (rstar2_core/models/token_logprobs.py): the `kernels`
    # extra, which the image does not install; to ship them, add `[kernels]` to its pip install and the check
    "liger_kernel": "kernels",
}
"""Modules the code imports that the image leaves out on purpose, with the extra that provides them."""

LOADED_INDIRECTLY = {
    "s3fs": "fsspec loads it for s3:// URLs (rstar2_core/storage.py): every store read and write in production",
    "psycopg2": "the MLflow server (infra/k8s/mlflow.yaml) runs from this image on a postgresql:// store",
    "asyncpg": "the Prefect server (infra/k8s/prefect-server.yaml) runs from this image on postgresql+asyncpg://",
}
"""Modules no file imports by name that the image's processes load, each with who loads it."""


def _needed(dockerfile: Path) -> tuple[dict[str, list[str]], list[str]]:
    """({module the check must import: who imports it}, [modules imported that the image does not provide])."""
    image, dists = image_distributions(dockerfile), module_distributions()
    used = third_party_imports()
    for mod in sandbox_preloads():
        used.setdefault(mod, []).append("sandbox.preload of configs/qwen3-14b-mi300x.toml")
    for mod, why in LOADED_INDIRECTLY.items():
        used.setdefault(mod, []).append(why)
    needed = {m: w for m, w in used.items() if dists.get(m, set()) & image and m not in NOT_IN_IMAGE}
    lacking = sorted(m for m in used if m not in needed and m not in NOT_IN_IMAGE)
    return needed, lacking


def missing_from_check(dockerfile: Path) -> dict[str, list[str]]:
    needed, _ = _needed(dockerfile)
    checked = build_check_imports(dockerfile)
    return {m: w for m, w in sorted(needed.items()) if m not in checked}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_build_check_imports_everything_the_code_imports(name):
    dockerfile = ROOT / "infra" / "docker" / name
    missing = missing_from_check(dockerfile)
    assert not missing, (f"infra/docker/{name}'s build check (python -c \"import ...\") does not import: "
                         + "; ".join(f"{m} (imported by {', '.join(sorted(set(w))[:3])})" for m, w in missing.items()))
    _, lacking = _needed(dockerfile)
    assert not lacking, (f"the code imports {lacking}, which the image of {name} does not install: add its "
                         "distribution to pyproject's dependencies, or to NOT_IN_IMAGE with the reason")
    assert "prefect" in build_check_imports(dockerfile) and "mlflow" in build_check_imports(dockerfile)


def test_the_allow_lists_name_modules_that_are_really_used():
    used = third_party_imports()
    assert set(NOT_IN_IMAGE) <= set(used), "NOT_IN_IMAGE names a module nothing imports any more: drop it"
    assert not set(LOADED_INDIRECTLY) & set(used), "a module imported by name needs no LOADED_INDIRECTLY entry"
    for name in DOCKERFILES:
        assert not set(NOT_IN_IMAGE) & build_check_imports(ROOT / "infra" / "docker" / name), name


def test_the_check_names_an_import_deleted_from_the_dockerfile(tmp_path):
    text = (ROOT / "infra" / "docker" / "Dockerfile.rocm").read_text()
    assert " mlflow," in text and " pyseccomp," in text
    broken = tmp_path / "Dockerfile.rocm"
    broken.write_text(text.replace(" mlflow,", "", 1).replace(" pyseccomp,", "", 1))
    missing = missing_from_check(broken)
    assert set(missing) == {"mlflow", "pyseccomp"}
    assert "rstar2_core/sandbox/syscalls.py" in missing["pyseccomp"]


def _copied(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        if line.startswith("COPY "):
            *srcs, dst = line.split()[1:]
            out += [(s, dst) for s in srcs]
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_tree_holds_what_plan_and_deploy_read(name, tmp_path):
    """The files the Dockerfile copies, laid out as in the image, run `rstar2 plan --strict` for the
    production profile (it reads prefect.yaml's pull steps and infra/) and hold prefect.yaml for `prefect
    deploy` and `rstar2 deploy`."""
    image = tmp_path / "opt" / "rstar2"
    image.mkdir(parents=True)
    for src, dst in _copied(ROOT / "infra" / "docker" / name):
        target = image / dst / Path(src).name if dst.endswith("/") else image / dst
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / src, target)
    assert (image / "prefect.yaml").exists() and (image / "infra" / "prefect" / "base-job-template.json").exists()
    env = {**os.environ, "PYTHONPATH": str(image), "PYTHONSAFEPATH": "1"}
    code = ("import sys, rstar2_cli.main as m; assert m.__file__.startswith(sys.argv[1]), m.__file__; "
            "sys.exit(m.main(['plan', '--profile', 'qwen3-14b-mi300x', '--strict']))")
    r = subprocess.run([sys.executable, "-c", code, str(image)], cwd=image, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "no problems found" in r.stdout
