"""Offline schema checks of infra/'s two cluster manifests (infra/schemas/README.md).

- `ray up` file (infra/ray/cluster.yaml): Ray's own cluster-config JSON Schema, `ray-schema.json` of the
  installed `ray` package (the file `ray up` validates against; read at test time, never vendored).
- KubeRay `RayCluster` (infra/k8s/raycluster.yaml): the OpenAPI v3 schema of the RayCluster CRD vendored
  in infra/schemas/kuberay-raycluster-crd.json.gz, translated to JSON Schema the way kubeconform's
  openapi2jsonschema does for `kubeconform -strict`: every object schema that declares `properties`
  (and does not set `x-kubernetes-preserve-unknown-fields`) gets `additionalProperties: false`, so a
  misspelt key is an error; `x-kubernetes-int-or-string` is integer or string (Kubernetes quantities:
  `128Gi`, `"24"`, `8`); `nullable` admits null. apiVersion and kind must be the CRD's group/version and
  kind. Not checked (nor by kubeconform): CEL rules (`x-kubernetes-validations`), `format`s, and
  `metadata`, which a CRD schema leaves as a bare object.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

INFRA = Path(__file__).resolve().parents[3] / "infra"
KUBERAY_CRD = INFRA / "schemas" / "kuberay-raycluster-crd.json.gz"

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "definitions")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not")


def ray_cluster_schema() -> dict:
    """Ray's cluster-config schema, from the installed package (what `ray up` validates a config with)."""
    return json.loads((resources.files("ray.autoscaler") / "ray-schema.json").read_text())


def load_crd(path: Path = KUBERAY_CRD) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def openapi_to_json_schema(node: Any, strict: bool = True) -> Any:
    """A CRD's OpenAPI v3 (structural) schema as JSON Schema; `strict` closes every declared object."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in _SUBSCHEMA_MAPS:
            out[k] = {name: openapi_to_json_schema(s, strict) for name, s in v.items()}
        elif k in _SUBSCHEMA_LISTS:
            out[k] = [openapi_to_json_schema(s, strict) for s in v]
        elif k in _SUBSCHEMA_ONE:
            out[k] = ([openapi_to_json_schema(s, strict) for s in v] if isinstance(v, list)
                      else openapi_to_json_schema(v, strict))
        elif k == "nullable" or k.startswith("x-kubernetes-"):
            continue  # Kubernetes extensions: applied below, or not checkable offline (CEL rules)
        else:
            out[k] = v
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]
        if "anyOf" in out:
            out["anyOf"] = [*out["anyOf"], {"type": "null"}]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if strict and "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def _path(parts) -> str:
    s = ""
    for p in parts:
        s += f"[{p}]" if isinstance(p, int) else (f".{p}" if s else str(p))
    return s or "<root>"


def _messages(validator: jsonschema.protocols.Validator, doc: Any) -> list[str]:
    out = []
    for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        if e.validator == "additionalProperties" and e.validator_value is False and isinstance(e.instance, dict):
            known = set(e.schema.get("properties", {}))
            extra = [k for k in e.instance if k not in known]  # (no patternProperties in these schemas)
            out += [f"{_path([*e.absolute_path, k])}: unknown field" for k in extra]
        else:
            out.append(f"{_path(e.absolute_path)}: {e.message}")
    return out


def ray_up_errors(config: Any) -> list[str]:
    """Why Ray's cluster-config schema rejects `config` (empty: it validates)."""
    schema = ray_cluster_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return _messages(cls(schema), config)


def crd_errors(manifest: Any, crd: dict | None = None, strict: bool = True) -> list[str]:
    """Why the CRD rejects `manifest`, kubeconform -strict style (empty: it validates)."""
    crd = crd if crd is not None else load_crd()
    if not isinstance(manifest, dict):
        return [f"<root>: not an object: {manifest!r}"]
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    served = {f"{group}/{v['name']}": v for v in crd["spec"]["versions"] if v.get("served")}
    if manifest.get("kind") != kind:
        return [f"kind: {manifest.get('kind')!r} is not {kind!r}"]
    if manifest.get("apiVersion") not in served:
        return [f"apiVersion: {manifest.get('apiVersion')!r} is not served by the CRD (one of {sorted(served)})"]
    return _messages(_crd_validator(crd, manifest["apiVersion"], strict), manifest)


_VALIDATORS: dict[tuple[int, str, bool], tuple[dict, jsonschema.Draft7Validator]] = {}


def _crd_validator(crd: dict, api_version: str, strict: bool) -> jsonschema.Draft7Validator:
    """The translated schema of one served version, built once per CRD object (it holds the CRD, so the
    id in the key stays its own)."""
    key = (id(crd), api_version, strict)
    if key not in _VALIDATORS:
        version = next(v for v in crd["spec"]["versions"] if f"{crd['spec']['group']}/{v['name']}" == api_version)
        schema = openapi_to_json_schema(version["schema"]["openAPIV3Schema"], strict)   # builds new dicts
        jsonschema.Draft7Validator.check_schema(schema)
        _VALIDATORS[key] = (crd, jsonschema.Draft7Validator(schema))
    return _VALIDATORS[key][1]
