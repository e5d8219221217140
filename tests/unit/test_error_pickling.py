"""Every exception class the project defines survives pickling with its type, message and attributes:
that is how Ray hands a stage task's failure to the flow (inside the task's Failed state) and an actor's
error to its caller, and an error that cannot be unpickled reaches the user as Ray's `RaySystemError`
about a constructor (issue 35). The classes are found by importing every module of the packages, so a
new one cannot slip by; one whose constructor needs arguments must have sample arguments here."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pickle
import pkgutil
import threading
from pathlib import Path

import ray.cloudpickle
import ray.exceptions as rex

from rstar2_core.runtime.ray.errors import ActorFailure

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rstar2_core", "tasks", "flows", "rstar2_cli")
# stdlib-only scripts the sandbox loads by path into its own processes (their folder on sys.path), never
# imported as package modules: `test_sandbox_scripts_define_no_exception` reads their source instead
SCRIPTS = "rstar2_core.sandbox.confined."

# Constructor arguments of the classes whose __init__ needs more than a message (the rest get one).
SAMPLE_ARGS: dict[str, tuple] = {
    "rstar2_core.runtime.ray.errors.ActorFailure": ("engine-0", rex.ActorDiedError()),
    "rstar2_core.runtime.ray.errors.ActorStartTimeout": (
        ["engine-0", "trainer-1"], "actors engine-0, trainer-1 not ready within 60 s"),
    "rstar2_core.runtime.ray.errors.ActorConfigError": ("trainer-0", "ValueError: bf16 needs a GPU"),
    "rstar2_core.runtime.ray.errors.NodeLost": ({"node 5c3a9e1f (10.0.0.7)": ["engine-1", "trainer-1"]},
                                               rex.ActorUnavailableError("socket closed", None)),
    "rstar2_core.runtime.ray.errors.LayoutDoesNotFit": (
        ["placement group rstar2-node2 needs 8 GPU, 32 CPU on one node ...: node 5c3a9e1f (10.0.0.7) lacks 8 GPU"],
        ["node 5c3a9e1f (10.0.0.7): GPU 0 free of 0, CPU 16 free of 16"]),
    "rstar2_core.runtime.ray.errors.ModelDownloadTimeout": (
        "s3://rstar2-models/Qwen3-14B-Base", {"node 5c3a9e1f (10.0.0.7)": (1234, 29_500_000_000)}, 1800.0),
    "rstar2_core.data.sources.Reject": ("missing_field:answer",),
    "rstar2_core.errors.SFTNotConverged": ("SFT did not converge: ...", 0.23, 0.1, 1993, 0),
    "rstar2_core.errors.AttentionKernelMismatch": ("the attention kernels disagree ...",
                                                   {"actor/kernel_check_loss_rel_diff": 0.3}),
    "rstar2_core.errors.StoreUnavailable": ("wrote", "s3://rstar2/runs/r/rl-stage-1/steps/step-000002/_COMPLETE",
                                            9, 121.5, 120.0, ConnectionRefusedError(111, "Connection refused")),
}


def project_exceptions() -> dict[str, type[BaseException]]:
    """{"module.Class": class} of every exception class defined in the packages' modules."""
    found: dict[str, type[BaseException]] = {}
    for top in PACKAGES:
        pkg = importlib.import_module(top)
        names = [top] + [m.name for m in pkgutil.walk_packages(pkg.__path__, top + ".")]
        for name in names:
            if name.startswith(SCRIPTS):
                continue
            module = importlib.import_module(name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__ == name:
                    found[f"{name}.{cls.__qualname__}"] = cls
    return found


def needs_arguments(cls: type) -> bool:
    """True when the class's own (Python) __init__ has a required parameter besides self."""
    init = cls.__init__
    if not inspect.isfunction(init):
        return False  # a builtin exception's __init__: any message will do
    params = list(inspect.signature(init).parameters.values())[1:]
    return any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _same(a, b) -> bool:
    if isinstance(a, BaseException):   # exceptions compare by identity: compare what a reader sees
        return type(a) is type(b) and str(a) == str(b)
    return a == b


def test_every_project_exception_round_trips_through_pickle():
    classes = project_exceptions()
    assert {"rstar2_core.runtime.ray.errors.ActorFailure", "rstar2_core.errors.InfraFailureShareExceeded",
            "rstar2_core.errors.StaleEngineWeights", "rstar2_core.errors.StageTrainedNothing",
            "tasks.modelref.ModelRefError", "flows.evaluate.RegressionError"} <= set(classes)
    missing = sorted(n for n, c in classes.items() if needs_arguments(c) and n not in SAMPLE_ARGS)
    assert not missing, f"add sample constructor arguments to SAMPLE_ARGS for {missing}"
    broken = []
    for name, cls in classes.items():
        err = cls(*SAMPLE_ARGS.get(name, ("something failed; the message says what to do",)))
        for dumps in (pickle.dumps, ray.cloudpickle.dumps):   # the standard library's and Ray's
            try:
                back = pickle.loads(dumps(err))
            except Exception as e:  # noqa: BLE001 - every failure is reported with its class
                broken.append(f"{name} ({dumps.__module__}): {type(e).__name__}: {e}")
                continue
            if not (type(back) is cls and str(back) == str(err) and back.args == err.args
                    and vars(back).keys() == vars(err).keys()
                    and all(_same(v, getattr(back, k)) for k, v in vars(err).items())):
                broken.append(f"{name} ({dumps.__module__}): came back as {type(back).__name__}({back}) with {vars(back)}")
    assert not broken, ("these errors do not survive pickling (give a class with its own __init__ "
                        "rstar2_core.errors.PicklableError as its first base):\n" + "\n".join(broken))


class _TwoArgs(Exception):
    """Pickles, but cannot be unpickled: its __init__ takes two arguments and passes one message on."""

    def __init__(self, a: str, b: str):
        super().__init__(f"{a}/{b}")


def test_a_cause_that_cannot_be_pickled_travels_as_its_type_and_message():
    locked = RuntimeError("engine socket closed")
    locked.lock = threading.Lock()   # pickling fails
    for cause in (locked, _TwoArgs("a", "b")):
        err = ActorFailure("engine-0", cause)
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is ActorFailure and str(back) == str(err) and back.actor == "engine-0"
        assert back.cause == f"{type(cause).__name__}: {cause}"
        assert err.cause is cause   # the original keeps its cause


def test_sandbox_scripts_define_no_exception():
    """The scripts the walk skips define no exception class (a base named like one would need a walk)."""
    folder = ROOT / "rstar2_core" / "sandbox" / "runtime"
    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                assert not bases & builtin and not any(b.endswith(("Error", "Exception")) for b in bases), (
                    f"{path.name} defines exception {node.name}: import it in project_exceptions")
