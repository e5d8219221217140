"""Refresh the vendored KubeRay RayCluster CRD (infra/schemas/README.md).

    python infra/schemas/refresh.py --ref v1.7.0                  # downloads from GitHub
    python infra/schemas/refresh.py --ref v1.7.0 --from-file ray.io_rayclusters.yaml   # a local copy

Keeps the CRD's `v1` version only (schema, printer columns, subresources), records where it came from in
an annotation, and writes it as gzipped JSON (no timestamp in the gzip header, so the same input gives
the same bytes). Then update the commit, date and version in infra/schemas/README.md and infra/README.md
and run `.venv/bin/python -m pytest -q tests/unit/infra/test_manifest_schemas.py`.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import urllib.request
from pathlib import Path

import yaml

REPO = "ray-project/kuberay"
PATH = "ray-operator/config/crd/bases/ray.io_rayclusters.yaml"
OUT = Path(__file__).resolve().parent / "kuberay-raycluster-crd.json.gz"
VERSION = "v1"


def trim(crd: dict, ref: str, sha256: str) -> dict:
    if crd.get("kind") != "CustomResourceDefinition" or crd["spec"]["names"]["kind"] != "RayCluster":
        raise SystemExit(f"not the RayCluster CRD: {crd.get('kind')} {crd.get('metadata', {}).get('name')}")
    versions = [v for v in crd["spec"]["versions"] if v["name"] == VERSION]
    if not versions or "openAPIV3Schema" not in versions[0].get("schema", {}):
        raise SystemExit(f"the CRD has no {VERSION} schema")
    meta = crd["metadata"]
    meta.setdefault("annotations", {})["rstar2/vendored-from"] = f"github.com/{REPO}@{ref}:{PATH} sha256={sha256}"
    return {**crd, "metadata": meta, "spec": {**crd["spec"], "versions": versions}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="KubeRay tag or commit, e.g. v1.7.0")
    ap.add_argument("--from-file", type=Path, help="a local copy of the CRD instead of downloading it")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    if a.from_file:
        raw = a.from_file.read_bytes()
    else:
        with urllib.request.urlopen(f"https://raw.githubusercontent.com/{REPO}/{a.ref}/{PATH}", timeout=60) as r:
            raw = r.read()
    sha = hashlib.sha256(raw).hexdigest()
    crd = trim(yaml.safe_load(raw), a.ref, sha)
    text = json.dumps(crd, indent=1, ensure_ascii=False) + "\n"
    a.out.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    print(f"{a.out}: {a.out.stat().st_size} bytes ({len(text)} uncompressed), upstream sha256 {sha}")


if __name__ == "__main__":
    main()
