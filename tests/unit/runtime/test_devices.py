"""Devices by identity (rstar2_core/runtime/devices.py), pure: the device index an actor binds for every
combination of visibility variables and Ray NOSET flags users meet, with a stubbed device count (how many
devices torch would see), and the check that refuses two actors on one device. Each case asserts the index
the assigned GPU has in the process's visible list, so a resolver that trusted device 0, or one variable
only, fails here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rstar2_core.runtime.devices import (
    DeviceConflict,
    DeviceReport,
    DeviceResolutionError,
    check_devices,
    consistent_visibility,
    device_conflicts,
    device_identity,
    memory_shortfalls,
    narrowed_visibility,
    resolve_device,
)

CUDA, HIP, ROCR = "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"
NOSET_CUDA, NOSET_HIP, NOSET_ROCR = (f"RAY_EXPERIMENTAL_NOSET_{v}" for v in (CUDA, HIP, ROCR))
ALL8 = "0,1,2,3,4,5,6,7"

# (case, Ray's id, environment, devices torch sees, ROCm?, index bound, variable it came from)
RESOLVED = [
    # NVIDIA
    ("ray masks CUDA (default)", "3", {CUDA: "3"}, 1, False, 0, CUDA),
    ("colocated half GPU: same id, same mask", "3", {CUDA: "3"}, 1, False, 0, CUDA),
    ("NOSET_CUDA, nothing set: sees all 8", "5", {NOSET_CUDA: "1"}, 8, False, 5, None),
    ("NOSET_CUDA, node lists all 8", "6", {NOSET_CUDA: "1", CUDA: ALL8}, 8, False, 6, CUDA),
    ("NOSET_CUDA, node lists 4-7: id is a value of it", "6", {NOSET_CUDA: "1", CUDA: "4,5,6,7"}, 4, False, 2, CUDA),
    ("ray masks within a node list 4-7", "6", {CUDA: "6"}, 1, False, 0, CUDA),
    ("NOSET_CUDA, UUIDs", "GPU-bbb", {NOSET_CUDA: "1", CUDA: "GPU-aaa,GPU-bbb"}, 2, False, 1, CUDA),
    ("HIP/ROCR ignored on NVIDIA", "2", {CUDA: "2", HIP: "0", ROCR: "0", NOSET_HIP: "1"}, 1, False, 0, CUDA),
    ("NOSET for HIP does not stop Ray masking CUDA", "4", {CUDA: "4", NOSET_HIP: "1"}, 1, False, 0, CUDA),
    ("leading zero is the same ordinal", "3", {NOSET_CUDA: "1", CUDA: "01,03"}, 2, False, 1, CUDA),
    # ROCm
    ("ray 2.60 masks HIP (default)", "3", {HIP: "3"}, 1, True, 0, HIP),
    ("NOSET_HIP, nothing set: sees all 8", "5", {NOSET_HIP: "1"}, 8, True, 5, None),
    ("NOSET_HIP, image sets CUDA to all 8: HIP runtime falls back to it", "3",
     {NOSET_HIP: "1", CUDA: ALL8}, 8, True, 3, CUDA),
    ("HIP wins over the image's CUDA list", "3", {HIP: "3", CUDA: ALL8}, 1, True, 0, HIP),
    ("empty HIP counts as unset", "5", {HIP: "", CUDA: "5"}, 1, True, 0, CUDA),
    ("ray masks HIP under ROCR 4-7", "2", {ROCR: "4,5,6,7", HIP: "2"}, 1, True, 0, HIP),
    ("NOSET_HIP, HIP indexes within ROCR 4-7", "2", {ROCR: "4,5,6,7", HIP: "0,1,2,3", NOSET_HIP: "1"}, 4, True, 2, HIP),
    ("only ROCR: old Ray masked with it", "6", {ROCR: "6"}, 1, True, 0, ROCR),
    ("only ROCR, NOSET_ROCR: inherited 4-7", "6", {ROCR: "4,5,6,7", NOSET_ROCR: "1"}, 4, True, 2, ROCR),
    ("every NOSET set (vLLM's TP workers), nothing set", "7", {NOSET_CUDA: "1", NOSET_HIP: "1", NOSET_ROCR: "1"},
     8, True, 7, None),
]


@pytest.mark.parametrize(("ray_id", "env", "count", "rocm", "index", "variable"),
                         [c[1:] for c in RESOLVED], ids=[c[0] for c in RESOLVED])
def test_the_bound_index_is_the_assigned_gpus_position_in_what_the_process_sees(ray_id, env, count, rocm, index,
                                                                              variable):
    b = resolve_device([ray_id], env, count, rocm=rocm)
    assert (b.index, b.variable, b.ray_id) == (index, variable, ray_id)
    assert f"cuda:{index}" in b.reason
    if env.get(NOSET_CUDA if not rocm else NOSET_HIP):
        assert "RAY_EXPERIMENTAL_NOSET" in b.reason
    assert resolve_device([ray_id], env, None, rocm=rocm).index == index      # the count only checks


# (case, Ray's ids, environment, devices torch sees, ROCm?, what the error must say)
REFUSED = [
    ("no GPU assigned", [], {CUDA: "0"}, 1, False, "no GPU"),
    ("Ray fell back to the whole list", ["0", "1", "2", "3"], {CUDA: "0,1,2,3"}, 4, False, "whole CUDA_VISIBLE_DEVICES"),
    ("NOSET_CUDA, node masks 0-3, id 6", ["6"], {NOSET_CUDA: "1", CUDA: "0,1,2,3"}, 4, False,
     "CUDA_VISIBLE_DEVICES='0,1,2,3' .*RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES set.* does not list"),
    ("CUDA hides every GPU", ["0"], {CUDA: ""}, 0, False, "hides every GPU"),
    ("a repeated id", ["1"], {NOSET_CUDA: "1", CUDA: "1,1"}, 0, False, "twice"),
    ("NOSET, sees fewer devices than the id", ["5"], {NOSET_CUDA: "1"}, 1, False, "torch sees 1 device"),
    ("a UUID with nothing to find it in", ["GPU-aaa"], {NOSET_CUDA: "1"}, 8, False, "not an index"),
    ("only ROCR 4-7, id 1 is not in it", ["1"], {ROCR: "4,5,6,7"}, 4, True,
     "ROCR_VISIBLE_DEVICES='4,5,6,7' does not list.*HIP_VISIBLE_DEVICES"),
    ("HIP longer than ROCR", ["0"], {ROCR: "0,1", HIP: "0,1,2,3"}, 2, True, "more devices than ROCR"),
    ("NOSET_HIP, node masks HIP 0-3, id 6", ["6"], {NOSET_HIP: "1", HIP: "0,1,2,3"}, 4, True,
     "HIP_VISIBLE_DEVICES='0,1,2,3'.*does not list"),
]


@pytest.mark.parametrize(("ids", "env", "count", "rocm", "message"), [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_an_assignment_that_cannot_be_found_is_refused_naming_the_variables(ids, env, count, rocm, message):
    with pytest.raises(DeviceResolutionError, match=message):
        resolve_device(ids, env, count, rocm=rocm)


def test_fractional_shares_of_one_gpu_resolve_to_the_same_device_whatever_the_flags():
    """The colocated layout: a trainer rank and an engine each ask 0.5 GPU of one bundle and get one id;
    one masked by Ray, one with NOSET (as vLLM's workers): both land on physical GPU 5."""
    masked = resolve_device(["5"], {CUDA: "5"}, 1, rocm=False)
    noset = resolve_device(["5"], {NOSET_CUDA: "1", CUDA: ALL8}, 8, rocm=False)
    assert (masked.index, noset.index) == (0, 5)
    assert masked.entry == noset.entry == "5"


@pytest.mark.parametrize(("ray_id", "env", "rocm", "want"), [
    ("5", {NOSET_CUDA: "1"}, False, {CUDA: "5"}),
    ("GPU-bbb", {NOSET_CUDA: "1", CUDA: "GPU-aaa,GPU-bbb"}, False, {CUDA: "GPU-bbb"}),
    ("2", {ROCR: "4,5,6,7", HIP: "0,1,2,3", NOSET_HIP: "1"}, True, {HIP: "2", CUDA: "2"}),
    ("6", {ROCR: "4,5,6,7", NOSET_ROCR: "1"}, True, {HIP: "2", CUDA: "2"}),      # a position within ROCR's list
    ("3", {HIP: "3", CUDA: ALL8}, True, {HIP: "3", CUDA: "3"}),
], ids=["nvidia all visible", "nvidia uuid", "hip under rocr", "only rocr", "hip over the image's cuda"])
def test_an_engine_narrows_visibility_so_that_its_device_0_is_the_assigned_gpu(ray_id, env, rocm, want):
    assert narrowed_visibility(resolve_device([ray_id], env, None, rocm=rocm), rocm=rocm) == want


def test_cuda_is_kept_equal_to_hip_on_rocm_only():
    assert consistent_visibility({HIP: "3", CUDA: ALL8}, rocm=True) == {CUDA: "3"}
    assert consistent_visibility({HIP: "3", CUDA: "3"}, rocm=True) == {}
    assert consistent_visibility({HIP: "3"}, rocm=True) == {}
    assert consistent_visibility({HIP: "3", CUDA: ALL8}, rocm=False) == {}


def test_identity_is_uuid_and_pci_address_whichever_exist():
    full = SimpleNamespace(uuid="GPU-5c3a", pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0, name="MI300X")
    assert device_identity(full) == "GPU-5c3a pci 0000:1b:00.0"
    blank = SimpleNamespace(uuid="00000000-0000-0000-0000-000000000000", pci_domain_id=1, pci_bus_id=0xC1,
                            pci_device_id=0, name="MI300X")
    assert device_identity(blank) == "pci 0001:c1:00.0"
    assert device_identity(SimpleNamespace(uuid="GPU-77")) == "GPU-77"
    with pytest.raises(DeviceResolutionError, match="neither a UUID nor a PCI"):
        device_identity(SimpleNamespace(uuid="", name="x"))


A, B = "node 5c3a9e1f (10.0.0.7)", "node 77aa01bc (10.0.0.8)"


def _r(actor, gpu, device, node=A):
    return DeviceReport(actor, node, gpu, device)


def test_colocated_pairs_share_and_distinct_gpus_on_distinct_devices_pass():
    reports = [_r("trainer-0", "0", "d0"), _r("engine-0", "0", "d0"), _r("trainer-1", "1", "d1"),
               _r("engine-1", "1", "d1"),
               _r("trainer-8", "0", "d0", node=B)]      # the same PCI address on another machine is another GPU
    assert device_conflicts(reports) == []
    check_devices(reports)


def test_devices_smaller_than_the_planned_memory_are_refused_with_the_setting_to_use():
    """`cluster.gpu_memory_gb` is what `rstar2 plan` and the engines' KV budget were computed from: a device
    that holds less is refused before training, naming the actors and the value to set; drivers' rounding
    (within 1%) and an unset plan pass."""
    mi300x, small = 191.69, 176.0      # torch's total_memory of an MI300X in GiB; a partitioned one
    reports = [DeviceReport("trainer-0", A, "0", "d0", mi300x), DeviceReport("engine-0", A, "0", "d0", mi300x),
               DeviceReport("trainer-9", B, "1", "d1", small), DeviceReport("engine-9/tp0", B, "1", "d1", small)]
    (problem,) = memory_shortfalls(reports, 192.0)
    assert problem.startswith("cluster.gpu_memory_gb = 192 but trainer-9 (node 77aa01bc") and "engine-9/tp0" in problem
    assert "devices of 176 GiB" in problem and "set cluster.gpu_memory_gb = 176" in problem
    assert "trainer-0" not in problem
    assert memory_shortfalls(reports[:2], 192.0) == [] and memory_shortfalls(reports, None) == []
    assert memory_shortfalls([DeviceReport("t", A, "0", "d0", None)], 192.0) == []    # not read: nothing to compare
    with pytest.raises(DeviceConflict, match="set cluster.gpu_memory_gb = 176"):
        check_devices(reports, planned_gib=192.0)
    check_devices(reports[:2], planned_gib=192.0)


def test_two_actors_ray_gave_different_gpus_on_one_device_are_refused_naming_node_and_actors():
    reports = [_r("trainer-0", "0", "d0"), _r("trainer-1", "1", "d0"), _r("engine-0/tp1", "2", "d2")]
    (problem,) = device_conflicts(reports)
    assert problem.startswith(A) and "trainer-0 (Ray GPU 0), trainer-1 (Ray GPU 1)" in problem and "d0" in problem
    with pytest.raises(DeviceConflict, match="trainer-1"):
        check_devices(reports)


def test_one_ray_gpu_on_two_devices_is_refused():
    """A colocated engine that bound another device than its trainer rank (IPC weight sync would miss)."""
    (problem,) = device_conflicts([_r("trainer-2", "2", "d2"), _r("engine-2", "2", "d5")])
    assert "Ray assigned GPU 2 to trainer-2, engine-2" in problem and "d2" in problem and "d5" in problem
