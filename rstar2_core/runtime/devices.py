"""Devices by identity: the local GPU index an actor binds, from the GPU id Ray assigned it, and whether a
stage's actors ended up on the devices Ray meant (pure: no Ray, no torch import).

Ray's ids are entries of the visibility list the worker started with (or node slot indices), so the
device to bind is the id's position in the list the GPU runtime applies now, whoever set it (Ray, or the
node under a `RAY_EXPERIMENTAL_NOSET_*` flag): NVIDIA `CUDA_VISIBLE_DEVICES`; ROCm `HIP_VISIBLE_DEVICES`,
else `CUDA_VISIBLE_DEVICES`, within `ROCR_VISIBLE_DEVICES`. Trade-off: nothing is probed here, so the
reports each actor gives of its device's UUID and PCI address (`device_conflicts`) are what catch a list
in another namespace. See docs/ray-runtime.md, "Devices by identity".

    b = resolve_device(["3"], os.environ, torch.cuda.device_count(), rocm=torch.version.hip is not None)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CUDA, HIP, ROCR = "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"
VISIBILITY_VARS = (CUDA, HIP, ROCR)
NOSET_VARS = {v: f"RAY_EXPERIMENTAL_NOSET_{v}" for v in VISIBILITY_VARS}
"""What makes Ray leave each visibility variable as the worker inherited it (Ray 2.60 reads the CUDA and
HIP ones; the ROCR one is older Ray's, and vLLM sets all three on its TP workers)."""
_NO_DEVICES = ("", "NoDevFiles")
_FIX = ("set the variable on the node (`ray start`'s environment) to list every GPU of the node, or unset it, "
        "so that the ids Ray assigns are entries of it")


class DeviceResolutionError(ValueError):
    """The GPU Ray assigned an actor cannot be found among the devices its process sees; the message names
    the variables and what to set. Not retried: the next attempt sees the same environment."""


class DeviceConflict(ValueError):
    """Actors of the stage are not on the devices Ray assigned them (two on one GPU that Ray gave different
    GPUs, or one Ray GPU on two devices); the message names the node and the actors."""


@dataclass(frozen=True)
class DeviceBinding:
    """Where an actor computes: `index` is the torch device (`cuda:index`); `ray_id` the GPU Ray assigned;
    `variable` the list `index` is a position in (None: no list, every device); `entry` the assigned
    device as `CUDA_VISIBLE_DEVICES` (ROCm: `HIP_VISIBLE_DEVICES`, within ROCR's list) names it, what
    narrowing writes; `reason` one line on how it was found."""

    index: int
    ray_id: str
    variable: str | None
    entry: str
    reason: str


def _parse(value: str | None) -> list[str] | None:
    """A visibility variable's list: None when unset, [] when it hides every device."""
    if value is None:
        return None
    if value.strip() in _NO_DEVICES:
        return []
    return [x.strip() for x in value.split(",")]


def _key(x: str) -> str:
    """Compare ids as the runtimes parse them: `03` and `3` are one ordinal."""
    return str(int(x)) if x.isdigit() else x


def _noset_note(environ: Mapping[str, str], rocm: bool) -> str:
    names = [NOSET_VARS[v] for v in ((HIP, CUDA, ROCR) if rocm else (CUDA,)) if environ.get(NOSET_VARS[v])]
    return f" ({', '.join(names)} set: Ray left the variables as the worker inherited them)" if names else ""


def _visible(environ: Mapping[str, str], rocm: bool) -> tuple[str | None, list[str] | None]:
    """(variable, list) whose positions are the process's torch device indices, in Ray's namespace."""
    if not rocm:
        cuda = _parse(environ.get(CUDA))
        if cuda == []:
            raise DeviceResolutionError(f"{CUDA}={environ.get(CUDA)!r} hides every GPU from this process; "
                                        f"unset it on the node, or {_FIX}")
        return (CUDA if cuda is not None else None), cuda
    # the HIP runtime treats an empty HIP/CUDA list as unset
    hip, cuda, rocr = (_parse(environ.get(v)) or None for v in (HIP, CUDA, ROCR))
    selector, chosen = (HIP, hip) if hip is not None else (CUDA, cuda) if cuda is not None else (None, None)
    if chosen is not None and rocr is not None and len(chosen) > len(rocr):
        raise DeviceResolutionError(f"{selector}={environ.get(selector)!r} lists more devices than "
                                    f"{ROCR}={environ.get(ROCR)!r}, which it indexes into: the HIP runtime would "
                                    f"drop the extra ids. Set {selector} to positions within {ROCR}'s list, or "
                                    f"unset {ROCR}")
    if chosen is not None:
        return selector, chosen
    return (ROCR, rocr) if rocr is not None else (None, None)


def resolve_device(assigned: Sequence[str | int], environ: Mapping[str, str], device_count: int | None, *,
                   rocm: bool) -> DeviceBinding:
    """The local device index for the GPU Ray assigned (`assigned`: `get_accelerator_ids()["GPU"]`; a
    fractional share is still one id) in a process with environment `environ` that sees `device_count`
    devices (None: not counted, e.g. before the visibility is narrowed). Raises `DeviceResolutionError`
    naming the variables when no device can be bound (see the module docstring)."""
    ids = [str(x) for x in assigned]
    if not ids:
        raise DeviceResolutionError("Ray assigned this actor no GPU (get_accelerator_ids()['GPU'] is empty): it runs on "
                                    "a GPU bundle but asked for num_gpus = 0")
    if len({_key(x) for x in ids}) > 1:
        var = (HIP if rocm else CUDA)
        raise DeviceResolutionError(f"Ray assigned GPUs {ids} to an actor that asked for one GPU or a share of one: "
                                    f"Ray returns the worker's whole {var} list when the GPU it assigned is not in "
                                    f"it (the node was started with {var} listing fewer GPUs than its --num-gpus); "
                                    f"{_FIX}")
    ray_id = ids[0]
    variable, visible = _visible(environ, rocm)
    note = _noset_note(environ, rocm)
    if visible is None:
        if not ray_id.isdigit():
            raise DeviceResolutionError(f"Ray assigned GPU {ray_id!r}, which is not an index, and no visibility "
                                        f"variable ({', '.join(VISIBILITY_VARS if rocm else (CUDA,))}) is set to "
                                        f"find it in; {_FIX}")
        index, entry = int(ray_id), str(int(ray_id))
        reason = f"Ray GPU {ray_id}; no visibility variable set{note}: every device is visible, cuda:{index}"
    else:
        keys = [_key(x) for x in visible]
        if len(set(keys)) != len(keys):
            raise DeviceResolutionError(f"{variable}={environ.get(variable)!r} lists a device twice (CUDA and HIP "
                                        f"then see no device at all); list each GPU once")
        if _key(ray_id) not in keys:
            raise DeviceResolutionError(
                f"Ray assigned GPU {ray_id!r} but {variable}={environ.get(variable)!r}{note} does not list it: "
                f"the process cannot see the GPU Ray reserved for it (other GPUs are another actor's). {_FIX}; "
                f"on ROCm set {HIP} (Ray's variable), not only {ROCR}")
        index = keys.index(_key(ray_id))
        entry = str(index) if variable == ROCR else visible[index]    # HIP/CUDA name devices within ROCR's list
        reason = f"Ray GPU {ray_id}; {variable}={environ.get(variable)!r}{note} lists it at position {index}: cuda:{index}"
    if device_count is not None and index >= device_count:
        raise DeviceResolutionError(f"{reason}, but torch sees {device_count} device(s): the variables disagree with "
                                    f"the devices the runtime enumerates ({_env_line(environ)}); {_FIX}")
    return DeviceBinding(index, ray_id, variable, entry, reason)


def _env_line(environ: Mapping[str, str]) -> str:
    return ", ".join(f"{v}={environ.get(v)!r}" for v in VISIBILITY_VARS + tuple(NOSET_VARS.values()) if v in environ) \
        or "none of the visibility variables set"


def consistent_visibility(environ: Mapping[str, str], *, rocm: bool) -> dict[str, str]:
    """Updates that keep `CUDA_VISIBLE_DEVICES` equal to `HIP_VISIBLE_DEVICES` on ROCm where both are set and
    differ ({} otherwise). The HIP runtime already prefers HIP's list, so this changes no device; it keeps
    vLLM's import-time check on ROCm ("Inconsistent GPU visibility env vars", raised when Ray set HIP and
    the image set CUDA) from failing in a process that imports vLLM."""
    hip, cuda = environ.get(HIP) or None, environ.get(CUDA) or None
    return {CUDA: hip} if rocm and hip is not None and cuda is not None and hip != cuda else {}


def narrowed_visibility(binding: DeviceBinding, *, rocm: bool) -> dict[str, str]:
    """The variables to set so that the bound device is the process's device 0 (for an engine that builds
    on device 0: vLLM with TP 1, the HF engine). On ROCm both HIP and CUDA get the entry (vLLM requires them
    equal); ROCR is left as is, since the entry indexes within its list."""
    return {HIP: binding.entry, CUDA: binding.entry} if rocm else {CUDA: binding.entry}


# ----------------------------------------------------------------------------------------- identity
_ZERO_UUIDS = {"", "0" * 32, "00000000-0000-0000-0000-000000000000", "GPU-00000000-0000-0000-0000-000000000000"}


def device_identity(props: Any) -> str:
    """One GPU's identity from torch's device properties: its UUID (`props.uuid`, torch 2.x) and its PCI
    address (`pci_domain_id`, `pci_bus_id`, `pci_device_id`, what torch 2.13's numa binding reads too),
    whichever exist; both when both do, so that a UUID the driver reports as blank or shared still leaves
    the devices apart. PCI addresses repeat across machines: compare identities within one node."""
    uuid = str(getattr(props, "uuid", "") or "").strip()
    parts = [uuid] if uuid not in _ZERO_UUIDS else []
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        parts.append(f"pci {int(getattr(props, 'pci_domain_id', 0)):04x}:{int(bus):02x}:"
                     f"{int(getattr(props, 'pci_device_id', 0)):02x}.0")
    if not parts:
        raise DeviceResolutionError(f"torch reports neither a UUID nor a PCI bus id for device {getattr(props, 'name', '?')!r}: "
                                    "its identity cannot be checked")
    return " ".join(parts)


@dataclass(frozen=True)
class DeviceReport:
    """What one GPU actor says of its device: `actor` (e.g. `trainer-3`, `engine-1/tp0`), `node` (its
    Ray node), `ray_gpu` (the GPU id Ray assigned it, or that vLLM chose for a TP worker from its engine's
    assignment) and `device` (`device_identity`)."""

    actor: str
    node: str
    ray_gpu: str
    device: str
    memory_gib: float | None = None
    """The device's total memory (torch's `total_memory`) in GiB; None where it was not read."""


def device_conflicts(reports: Iterable[DeviceReport]) -> list[str]:
    """Problems ([] = every actor is where Ray put it): on one node, actors Ray gave different GPUs that
    run on one device (the "all ranks on GPU 0" failure), and actors Ray gave one GPU that run on
    different devices (a colocated trainer rank and engine apart: memory shares and IPC weight sync then
    miss). A colocated pair shares a Ray GPU id, so it is expected to share its device."""
    by_device: dict[tuple[str, str], list[DeviceReport]] = {}
    by_gpu: dict[tuple[str, str], list[DeviceReport]] = {}
    for r in reports:
        by_device.setdefault((r.node, r.device), []).append(r)
        by_gpu.setdefault((r.node, _key(r.ray_gpu)), []).append(r)
    problems = []
    for (node, device), rs in sorted(by_device.items()):
        if len({_key(r.ray_gpu) for r in rs}) > 1:
            who = ", ".join(f"{r.actor} (Ray GPU {r.ray_gpu})" for r in rs)
            problems.append(f"{node}: {who} all run on one device ({device}) although Ray assigned them different "
                            f"GPUs: they bind by a visibility variable Ray did not set (RAY_EXPERIMENTAL_NOSET_*) or set "
                            f"for another runtime; see docs/ray-runtime.md, \"Devices by identity\"")
    for (node, gpu), rs in sorted(by_gpu.items()):
        devices = sorted({r.device for r in rs})
        if len(devices) > 1:
            who = ", ".join(f"{r.actor} on {r.device}" for r in rs)
            problems.append(f"{node}: Ray assigned GPU {gpu} to {', '.join(r.actor for r in rs)} but they run on "
                            f"{len(devices)} different devices ({who}): the visibility variables of these actors "
                            "disagree (see docs/ray-runtime.md, \"Devices by identity\")")
    return problems


MEMORY_TOLERANCE = 0.01
"""How far `cluster.gpu_memory_gb` may exceed a device's reported total (drivers round it) before it is refused."""


def memory_shortfalls(reports: Iterable[DeviceReport], planned_gib: float | None) -> list[str]:
    """Devices with less memory than the plan assumed (`cluster.gpu_memory_gb`, which `rstar2 plan` and the
    engines' KV budget are computed from), one line per distinct device size; [] when nothing was planned."""
    if planned_gib is None:
        return []
    short: dict[float, list[DeviceReport]] = {}
    for r in reports:
        if r.memory_gib is not None and planned_gib > r.memory_gib * (1 + MEMORY_TOLERANCE):
            short.setdefault(round(r.memory_gib, 1), []).append(r)
    return [f"cluster.gpu_memory_gb = {planned_gib:g} but {', '.join(f'{r.actor} ({r.node})' for r in rs[:4])}"
            f"{f' and {len(rs) - 4} more' if len(rs) > 4 else ''} compute on devices of {gib:g} GiB: the memory "
            f"plan assumed more than they hold; set cluster.gpu_memory_gb = {gib:g} and run `rstar2 plan` again"
            for gib, rs in sorted(short.items())]


def check_devices(reports: Sequence[DeviceReport], planned_gib: float | None = None) -> None:
    """Raise `DeviceConflict` listing `device_conflicts(reports)` and `memory_shortfalls(reports,
    planned_gib)`, if any."""
    problems = device_conflicts(reports) + memory_shortfalls(reports, planned_gib)
    if problems:
        raise DeviceConflict(f"{len(problems)} device problem(s) among the stage's {len(reports)} GPU actors, refused "
                             "before training: " + " | ".join(problems))
