"""infra/'s cluster manifests validate offline against their tools' schemas (manifest_schema.py): the
KubeRay RayCluster against the vendored CRD (kubeconform -strict style), the `ray up` file against the
installed Ray's cluster-config schema; and each check catches a misspelt key and a wrong type."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from manifest_schema import (
    INFRA,
    KUBERAY_CRD,
    crd_errors,
    load_crd,
    openapi_to_json_schema,
    ray_cluster_schema,
    ray_up_errors,
)


@pytest.fixture(scope="module")
def crd() -> dict:
    return load_crd()


@pytest.fixture
def raycluster() -> dict:
    return yaml.safe_load((INFRA / "k8s" / "raycluster.yaml").read_text())


@pytest.fixture
def ray_up() -> dict:
    return yaml.safe_load((INFRA / "ray" / "cluster.yaml").read_text())


def test_vendored_crd_is_kuberays_raycluster_v1_and_documented(crd):
    assert KUBERAY_CRD.stat().st_size < 400_000
    assert (crd["kind"], crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (
        "CustomResourceDefinition", "ray.io", "RayCluster")
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1"]
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert {"headGroupSpec", "workerGroupSpecs", "rayVersion"} <= set(spec)
    source = crd["metadata"]["annotations"]["rstar2/vendored-from"]
    ref = re.fullmatch(r"github\.com/ray-project/kuberay@(\S+):ray-operator/config/crd/bases/"
                       r"ray\.io_rayclusters\.yaml sha256=[0-9a-f]{64}", source)
    assert ref, source
    for readme in (INFRA / "schemas" / "README.md", INFRA / "README.md"):
        assert f"KubeRay {ref[1]}" in readme.read_text(), f"{readme} does not name the vendored KubeRay {ref[1]}"


def test_raycluster_validates_against_the_kuberay_crd(raycluster, crd):
    assert crd_errors(raycluster, crd) == []


def test_ray_up_file_validates_against_rays_cluster_schema(ray_up):
    assert ray_cluster_schema()["additionalProperties"] is False  # the schema itself rejects unknown keys
    assert ray_up_errors(ray_up) == []


def test_ray_up_file_passes_ray_ups_own_config_preparation(ray_up):
    """What `ray up` runs on the file before it connects anywhere: fill in the defaults, then validate."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(ray_up))
    validate_config(prepared)
    nodes = prepared["available_node_types"]
    assert [t["min_workers"] for t in nodes.values()] == [len(ray_up["provider"]["worker_ips"])]


def _head(rc: dict) -> dict:
    return rc["spec"]["headGroupSpec"]


def _worker(rc: dict) -> dict:
    return rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


_CRD_DEFECTS = [
    (lambda rc: _rename(_head(rc), "rayStartParams", "rayStartParam"),
     "spec.headGroupSpec.rayStartParam: unknown field"),
    (lambda rc: _rename(_worker(rc), "image", "imagee"),
     "spec.workerGroupSpecs[0].template.spec.containers[0].imagee: unknown field"),
    (lambda rc: _rename(rc, "spec", "specs"), "specs: unknown field"),
    (lambda rc: _rename(_worker(rc)["resources"], "limits", "limit"),
     "spec.workerGroupSpecs[0].template.spec.containers[0].resources.limit: unknown field"),
    (lambda rc: rc["spec"]["workerGroupSpecs"][0].update(replicas="8"),
     "spec.workerGroupSpecs[0].replicas: '8' is not of type 'integer'"),
    (lambda rc: _head(rc)["rayStartParams"].update({"num-gpus": 0}),
     "spec.headGroupSpec.rayStartParams.num-gpus: 0 is not of type 'string'"),
    (lambda rc: _head(rc)["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="6379"),
     "spec.headGroupSpec.template.spec.containers[0].ports[0].containerPort: '6379' is not of type 'integer'"),
    (lambda rc: _worker(rc)["resources"]["limits"].update(cpu=[128]),
     "spec.workerGroupSpecs[0].template.spec.containers[0].resources.limits.cpu: [128] is not valid"),
    (lambda rc: rc["spec"]["workerGroupSpecs"][0].pop("groupName"),
     "spec.workerGroupSpecs[0]: 'groupName' is a required property"),
    (lambda rc: rc.update(apiVersion="ray.io/v2"), "apiVersion: 'ray.io/v2' is not served by the CRD"),
    (lambda rc: rc.update(kind="RayJob"), "kind: 'RayJob' is not 'RayCluster'"),
]


@pytest.mark.parametrize("break_it, expected", _CRD_DEFECTS, ids=[e for _, e in _CRD_DEFECTS])
def test_crd_check_catches_each_defect(raycluster, crd, break_it, expected):
    break_it(raycluster)
    errors = crd_errors(raycluster, crd)
    assert any(e.startswith(expected) for e in errors), errors


def test_quantities_are_int_or_string_and_strictness_is_what_catches_misspelt_keys(raycluster, crd):
    _worker(raycluster)["resources"]["limits"].update(cpu=128, memory="1400Gi")  # both forms are quantities
    assert crd_errors(raycluster, crd) == []
    _rename(_worker(raycluster), "image", "imagee")
    assert crd_errors(raycluster, crd, strict=False) == []  # the bare CRD schema lets unknown keys through
    assert crd_errors(raycluster, crd, strict=True) != []


def test_openapi_translation_of_kubernetes_extensions():
    import jsonschema

    schema = openapi_to_json_schema({
        "type": "object",
        "properties": {
            "port": {"x-kubernetes-int-or-string": True},
            "free": {"type": "object", "properties": {"a": {"type": "string"}},
                     "x-kubernetes-preserve-unknown-fields": True},
            "maybe": {"type": "string", "nullable": True, "enum": ["x"]},
            "map": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    })
    ok = jsonschema.Draft7Validator(schema)
    for doc in ({"port": 80}, {"port": "http"}, {"free": {"a": "s", "b": [1]}}, {"maybe": None},
                {"maybe": "x"}, {"map": {"k": 1}}):
        assert list(ok.iter_errors(doc)) == [], doc
    for doc in ({"port": 1.5}, {"port": None}, {"free": {"a": 1}}, {"maybe": "y"}, {"map": {"k": "1"}},
                {"prot": 80}):
        assert list(ok.iter_errors(doc)) != [], doc


_RAY_UP_DEFECTS = [
    (lambda c: _rename(c, "max_workers", "max_worker"), "max_worker: unknown field"),
    (lambda c: c.update(max_workers="eight"), "max_workers: 'eight' is not of type 'integer'"),
    (lambda c: c.update(max_workers=-1), "max_workers: -1 is less than the minimum of 0"),
    (lambda c: _rename(c["docker"], "image", "imagee"), "docker.imagee: unknown field"),
    (lambda c: _rename(c["auth"], "ssh_private_key", "ssh_key"), "auth.ssh_key: unknown field"),
    (lambda c: c["docker"].update(pull_before_run="yes"), "docker.pull_before_run: 'yes' is not of type 'boolean'"),
    (lambda c: c.update(head_start_ray_commands="ray start --head"),
     "head_start_ray_commands: 'ray start --head' is not of type 'array'"),
    (lambda c: c["provider"].pop("type"), "provider: 'type' is a required property"),
]


@pytest.mark.parametrize("break_it, expected", _RAY_UP_DEFECTS, ids=[e for _, e in _RAY_UP_DEFECTS])
def test_ray_up_check_catches_each_defect(ray_up, break_it, expected):
    break_it(ray_up)
    errors = ray_up_errors(ray_up)
    assert any(e.startswith(expected) for e in errors), errors
