"""Actor layout of an RL stage on the cluster: which GPUs/CPUs each engine, trainer shard and sandbox
actor gets, as Ray placement-group bundles (one STRICT_PACK group per node). Pure logic (no Ray import) over the config's `cluster`, `rollout` and `sandbox` sections (no sandbox
bundles with `sandbox.backend = "service"`: the tool service has nodes of its own): `rstar2 plan`
prints it without a cluster, runtime/ray/placement.py turns it into placement groups, and `fit_layout`
places it on paper on a live cluster's nodes. Invariant: a layout that would leave an actor pending
forever (too few CPUs in a GPU bundle, an engine across nodes) raises `LayoutError` naming the field.

    layout = compute_layout(cfg.cluster, cfg.rollout, cfg.sandbox)          # or specs.layout_for(cfg)
    problems = driver_conflicts(layout, cfg.cluster.resources.get("rl"))   # [] when it fits
See docs/ray-runtime.md, "Cluster layout".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from rstar2_core.config import ClusterConfig, RolloutConfig, SandboxConfig
from rstar2_core.config.runtime_rules import computes_on_gpu

COLOCATED_GPU_FRACTION = 0.5  # engine share + trainer share of one GPU bundle in the colocated layout
ENGINE_ACTOR_CPUS = 1         # an engine actor asks this of its (first) GPU bundle (rstar2_core/runtime/ray/engine_actors.py)
TRAINER_SHARD_CPUS = 1        # a trainer shard asks this of its GPU bundle (rstar2_core/runtime/ray/trainer_shards.py)


class LayoutError(ValueError):
    """The config does not describe a layout that fits the cluster; the message names the field to change."""


@dataclass(frozen=True)
class Bundle:
    gpus: int
    cpus: int
    role: Literal["gpu", "sandbox", "cpu"]

    def resources(self) -> dict[str, float]:
        """Ray bundle dict, e.g. {"CPU": 2, "GPU": 1}."""
        out: dict[str, float] = {"CPU": float(self.cpus)}
        if self.gpus:
            out["GPU"] = float(self.gpus)
        return out


@dataclass(frozen=True)
class PlacementGroupSpec:
    name: str
    node: int
    bundles: tuple[Bundle, ...]
    strategy: str = "STRICT_PACK"

    @property
    def gpus(self) -> int:
        return sum(b.gpus for b in self.bundles)

    @property
    def cpus(self) -> int:
        return sum(b.cpus for b in self.bundles)


@dataclass(frozen=True)
class EngineSlot:
    """Inference engine `index`: `tp` GPU bundles of node `node`'s placement group."""

    index: int
    node: int
    bundle_indices: tuple[int, ...]
    tp: int
    gpu_fraction: float
    """GPU share each TP rank asks of its bundle (1.0 separate, 0.5 colocated; 0 on CPU clusters)."""


@dataclass(frozen=True)
class TrainerShard:
    """Data-parallel rank `rank` of the actor (ZeRO shard) on one GPU bundle."""

    rank: int
    node: int
    bundle_index: int
    gpu_fraction: float


@dataclass(frozen=True)
class SandboxSlot:
    node: int
    bundle_index: int
    cpus: int


@dataclass(frozen=True)
class ClusterLayout:
    mode: Literal["colocated", "separate"]
    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    placement_groups: tuple[PlacementGroupSpec, ...]
    engines: tuple[EngineSlot, ...]
    trainer_shards: tuple[TrainerShard, ...]
    sandbox_actors: tuple[SandboxSlot, ...]
    device: Literal["cuda", "cpu"] = "cpu"
    """Where engines and trainer shards compute: `cuda` on GPU nodes, `cpu` on CPU-only clusters and on
    logical GPUs (`cluster.logical_gpus`: the GPU layout's placement, CPU compute)."""

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def engine_gpus(self) -> int:
        return sum(e.tp for e in self.engines) if self.gpus_per_node else 0

    @property
    def trainer_gpus(self) -> int:
        return len(self.trainer_shards) if self.gpus_per_node else 0

    @property
    def sandbox_cpus(self) -> int:
        return sum(s.cpus for s in self.sandbox_actors)

    def pg_name(self, node: int) -> str:
        return self.placement_groups[node].name

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> list[str]:
        """Human-readable summary, one line per node plus totals (what `rstar2 plan` prints)."""
        logical = " logical" if self.gpus_per_node and self.device == "cpu" else ""
        lines = [(f"layout {self.mode}: {self.nodes} node(s) x {self.gpus_per_node}{logical} GPU, {self.cpus_per_node} CPU "
                  f"= {self.total_gpus} GPUs; {len(self.engines)} engine(s) x TP {self.engines[0].tp} "
                  f"({self.engine_gpus} GPUs), {len(self.trainer_shards)} trainer shard(s) "
                  f"({self.trainer_gpus} GPUs), "
                  + (f"{len(self.sandbox_actors)} sandbox actor(s) ({self.sandbox_cpus} CPUs)" if self.sandbox_actors
                     else "no sandbox actors (the tool service's own nodes)"))]
        for pg in self.placement_groups:
            eng = [e.index for e in self.engines if e.node == pg.node]
            tr = [t.rank for t in self.trainer_shards if t.node == pg.node]
            sb = [s for s in self.sandbox_actors if s.node == pg.node]
            lines.append(f"  node {pg.node} pg {pg.name} {pg.strategy}: {len(pg.bundles)} bundles "
                         f"({pg.gpus} GPU, {pg.cpus} CPU); engines {_ranges(eng)}; trainer ranks {_ranges(tr)}"
                         + (f"; sandbox {len(sb)} x {sb[0].cpus} CPU" if sb else ""))
        return lines


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "-"
    return f"{xs[0]}" if len(xs) == 1 else f"{xs[0]}-{xs[-1]}"


def _driver(cl: ClusterConfig) -> Any | None:
    return cl.resources.get("rl")


def compute_layout(cluster: ClusterConfig, rollout: RolloutConfig, sandbox: SandboxConfig) -> ClusterLayout:
    """The RL stage's actor layout for the config's `cluster`, `rollout` and `sandbox` sections (see the
    module docstring).

    The RL driver task's CPUs (`cluster.resources.rl.num_cpus`, default 1: Ray's default for a task) are
    kept free on every node, since the driver may land on any of them."""
    cl, ro = cluster, rollout
    gpn = cl.gpus_per_node
    driver = _driver(cl)
    driver_cpus = int(-(-float(driver.num_cpus) // 1)) if driver is not None else 1
    reserved = gpn * cl.cpus_per_gpu + driver_cpus
    free = cl.cpus_per_node - reserved
    if sandbox.backend == "service":
        if free < 0:
            raise LayoutError(f"cluster.cpus_per_node = {cl.cpus_per_node} is below the {reserved} CPUs of {gpn} GPUs "
                              f"x cluster.cpus_per_gpu = {cl.cpus_per_gpu} and {driver_cpus} for the RL driver task; "
                              "lower those or raise cluster.cpus_per_node")
        n_sb, sb_cpus = 0, 0      # the tool service runs on CPU nodes of its own: no sandbox bundles here
        if gpn == 0:
            return _cpu_layout(cl, ro, sb_cpus, n_sb)
        return _gpu_layout(cl, ro, sb_cpus, n_sb)
    if free < 1:
        raise LayoutError(f"cluster.cpus_per_node = {cl.cpus_per_node} leaves no CPU for the sandbox after "
                          f"{gpn} GPUs x cluster.cpus_per_gpu = {cl.cpus_per_gpu} and {driver_cpus} for the RL "
                          "driver task (cluster.resources.rl.num_cpus); lower those or raise cluster.cpus_per_node")
    n_sb = sandbox.ray_actors_per_node or 1
    if n_sb > free:
        raise LayoutError(f"sandbox.ray_actors_per_node = {n_sb} exceeds the {free} free CPUs of a node; "
                          f"set it to at most {free} (0 = one actor per node)")
    sb_cpus = free // n_sb
    if gpn == 0:
        return _cpu_layout(cl, ro, sb_cpus, n_sb)
    return _gpu_layout(cl, ro, sb_cpus, n_sb)


def _gpu_layout(cl: ClusterConfig, ro: RolloutConfig, sb_cpus: int, n_sb: int) -> ClusterLayout:
    """Engines and trainer shards on GPU bundles, `n_sb` sandbox bundles of `sb_cpus` per node."""
    gpn, tp = cl.gpus_per_node, ro.tensor_parallel_size
    if gpn % tp:
        raise LayoutError(f"rollout.tensor_parallel_size = {tp} must divide cluster.gpus_per_node = {gpn} "
                          "(an engine's TP ranks stay on one node)")
    total = cl.nodes * gpn
    if cl.layout == "colocated":
        trainer_range, engine_range, frac = range(total), range(total), COLOCATED_GPU_FRACTION
    else:
        if not 0 < cl.trainer_gpus < total:
            raise LayoutError(f"cluster.layout = \"separate\" needs 0 < cluster.trainer_gpus < {total}")
        if cl.trainer_gpus % tp:
            raise LayoutError(f"cluster.trainer_gpus = {cl.trainer_gpus} must be a multiple of "
                              f"rollout.tensor_parallel_size = {tp} so that no engine straddles two nodes")
        trainer_range, engine_range, frac = range(cl.trainer_gpus), range(cl.trainer_gpus, total), 1.0
    need = ro.num_engines * tp
    if need > len(engine_range):
        fit = len(engine_range) // tp
        raise LayoutError(f"rollout.num_engines = {ro.num_engines} x rollout.tensor_parallel_size = {tp} needs "
                          f"{need} GPUs but the {cl.layout} layout has {len(engine_range)} for engines; "
                          f"set rollout.num_engines = {fit}")
    pgs = []
    for node in range(cl.nodes):
        bundles = [Bundle(1, cl.cpus_per_gpu, "gpu") for _ in range(gpn)]
        bundles += [Bundle(0, sb_cpus, "sandbox") for _ in range(n_sb)]
        pgs.append(PlacementGroupSpec(f"rstar2-node{node}", node, tuple(bundles)))
    engines = []
    for i in range(ro.num_engines):
        node, local = divmod(engine_range[i * tp], gpn)
        engines.append(EngineSlot(i, node, tuple(range(local, local + tp)), tp, frac))
    shards = [TrainerShard(r, *divmod(g, gpn), frac) for r, g in enumerate(trainer_range)]
    _check_bundle_cpus(cl, engines, shards)
    sandbox = [SandboxSlot(node, gpn + j, sb_cpus) for node in range(cl.nodes) for j in range(n_sb)]
    return ClusterLayout(cl.layout, cl.nodes, gpn, cl.cpus_per_node, tuple(pgs), tuple(engines), tuple(shards),
                         tuple(sandbox), "cuda" if computes_on_gpu(cl) else "cpu")


def _check_bundle_cpus(cl: Any, engines: list[EngineSlot], shards: list[TrainerShard]) -> None:
    """Refuse GPU bundles whose actors ask more CPUs than the bundle has: Ray would leave the last actor
    pending forever (in the colocated layout a trainer shard and an engine actor share a bundle)."""
    demand: dict[tuple[int, int], int] = {}
    for s in shards:
        demand[(s.node, s.bundle_index)] = demand.get((s.node, s.bundle_index), 0) + TRAINER_SHARD_CPUS
    for e in engines:
        key = (e.node, e.bundle_indices[0])
        demand[key] = demand.get(key, 0) + ENGINE_ACTOR_CPUS
    need = max(demand.values(), default=0)
    if need > cl.cpus_per_gpu:
        raise LayoutError(f"cluster.cpus_per_gpu = {cl.cpus_per_gpu} is below the {need} CPUs the {cl.layout} layout's "
                          f"actors ask of one GPU bundle (trainer shard {TRAINER_SHARD_CPUS} + engine actor "
                          f"{ENGINE_ACTOR_CPUS}): Ray would leave an actor pending forever; set "
                          f"cluster.cpus_per_gpu >= {need}")


def _cpu_layout(cl: ClusterConfig, ro: RolloutConfig, sb_cpus: int, n_sb: int) -> ClusterLayout:
    """No GPUs: engines and the trainer run in the driver process (bundle index -1); placement groups
    hold only the sandbox actors."""
    if ro.tensor_parallel_size != 1:
        raise LayoutError("rollout.tensor_parallel_size > 1 needs GPUs; set it to 1 or cluster.gpus_per_node > 0")
    pgs = tuple(PlacementGroupSpec(f"rstar2-node{n}", n, (Bundle(0, sb_cpus, "sandbox"),) * n_sb)
                for n in range(cl.nodes) if n_sb)
    engines = tuple(EngineSlot(i, 0, (), 1, 0.0) for i in range(ro.num_engines))
    sandbox = tuple(SandboxSlot(n, j, sb_cpus) for n in range(cl.nodes) for j in range(n_sb))
    shards = tuple(TrainerShard(r, 0, -1, 0.0) for r in range(max(1, cl.trainer_ranks)))
    return ClusterLayout(cl.layout, cl.nodes, 0, cl.cpus_per_node, pgs, engines, shards, sandbox)


# ---------------------------------------------------------------------------------- fit to a cluster
@dataclass(frozen=True)
class NodeResources:
    """One live Ray node: its resources in all (`total`) and those free now (`available`)."""

    node_id: str
    address: str
    total: dict[str, float]
    available: dict[str, float]
    head: bool = False

    @property
    def label(self) -> str:
        return f"node {self.node_id[:8]} ({self.address}{', head' if self.head else ''})"


@dataclass(frozen=True)
class LayoutFit:
    """Whether a layout's placement groups fit a cluster's nodes: `placement` maps each group that fits to
    the node it would take; `problems` says, for each group that fits none, what every node lacks."""

    placement: dict[str, str]
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.problems


_SHOWN = ("GPU", "CPU")


def fit_layout(layout: ClusterLayout, nodes: list[NodeResources], *, free_only: bool = False) -> LayoutFit:
    """Place the layout's placement groups (STRICT_PACK: each whole on one node) on `nodes`, their total
    resources (`free_only`: what is free now). First fit, largest group first: the groups of a layout are
    alike (one per node), so this finds a placement whenever one exists for them. A group that fits no
    node is a problem naming, per node, the resources it lacks after the groups placed before it."""
    left = {n.node_id: dict(n.available if free_only else n.total) for n in nodes}
    placement: dict[str, str] = {}
    problems: list[str] = []
    for pg in sorted(layout.placement_groups, key=lambda g: (-g.gpus, -g.cpus, g.node)):
        need = {r: float(v) for r, v in (("GPU", pg.gpus), ("CPU", pg.cpus)) if v}
        node = next((n for n in nodes if all(left[n.node_id].get(r, 0.0) >= v for r, v in need.items())), None)
        if node is not None:
            for r, v in need.items():
                left[node.node_id][r] = left[node.node_id].get(r, 0.0) - v
            placement[pg.name] = node.label
            continue
        short = []
        for n in nodes:
            lack = {r: v - left[n.node_id].get(r, 0.0) for r, v in need.items() if left[n.node_id].get(r, 0.0) < v}
            short.append(f"{n.label} lacks {_fmt(lack)}")
        problems.append(f"placement group {pg.name} needs {_fmt(need)} on one node ({len(pg.bundles)} bundles, "
                        f"{pg.strategy}) and no node has it{' free' if free_only else ''}: "
                        + ("; ".join(short) if short else "the cluster has no live node"))
    return LayoutFit(placement, tuple(problems))


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{res[k]:g} {k}" for k in _SHOWN if k in res)


def describe_nodes(nodes: list[NodeResources]) -> list[str]:
    """One line per live node: its GPUs and CPUs, free of total."""
    return [f"{n.label}: " + ", ".join(f"{r} {n.available.get(r, 0.0):g} free of {n.total.get(r, 0.0):g}"
                                        for r in _SHOWN) for n in nodes]


def driver_conflicts(layout: ClusterLayout, driver: Any | None) -> list[str]:
    """Problems when the RL task's own GPU reservation (`cluster.resources.rl`, held by the Prefect->Ray
    task that drives the stage) leaves too few GPUs for the layout's placement groups."""
    if driver is None:
        return []
    problems = []
    gpus_left = layout.total_gpus - float(driver.num_gpus)
    used_gpus = sum(pg.gpus for pg in layout.placement_groups)
    if used_gpus > gpus_left:
        problems.append(f"cluster.resources.rl.num_gpus = {driver.num_gpus:g} is held by the RL driver task, "
                        f"leaving {gpus_left:g} of {layout.total_gpus} GPUs but the layout's placement groups "
                        f"need {used_gpus}: set cluster.resources.rl.num_gpus = 0 (the stage's actors get their "
                        "GPUs from the placement groups; the driver only coordinates)")
    return problems
