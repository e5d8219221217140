"""Engine actors around a fake engine on a local Ray: the driver-side RemoteEngine behaves as an
`Engine` (concurrent generate, KV capacity), weight sync reaches every engine once per step through the
object store or as a checkpoint URI, a dead engine raises ActorFailure, and the Ray options of the
production layout's TP-2 engines pin vLLM's workers to their bundles."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rstar2_core.config import load_config
from rstar2_core.rollout.types import GenerationOutput, SamplingParams
from rstar2_core.runtime.ray.errors import ActorFailure
from rstar2_core.runtime.specs import layout_for


class FakeEngine:
    """Answers with the prompt reversed, shifted by the sum of its current weights (so a weight update
    is visible in the output); records every update."""

    def __init__(self, index: int):
        self.index = index
        self.shift = 0
        self.updates: list[str] = []
        self.inflight = 0
        self.overlap: asyncio.Event | None = None

    async def generate(self, prompt_ids, params):
        # Each request waits until a second one is in flight on this engine: served one at a time, the
        # first would never see a second and the wait_for raises (a deadlock guard, not a speed bound).
        self.overlap = self.overlap or asyncio.Event()
        self.inflight += 1
        if self.inflight >= 2:
            self.overlap.set()
        try:
            await asyncio.wait_for(self.overlap.wait(), timeout=60)
        finally:
            self.inflight -= 1
        ids = tuple(int(t) + self.shift for t in reversed(prompt_ids))[: params.max_new_tokens]
        return GenerationOutput(ids, tuple(-0.5 for _ in ids), "length")

    def kv_capacity_tokens(self):
        return 1000 + self.index

    def kv_tokens_per_sequence(self):
        return 10

    def update_weights(self, weights):
        if isinstance(weights, str):
            self.updates.append(f"uri:{weights}")
        else:
            self.shift = int(sum(float(t.sum()) for t in weights.values()))
            self.updates.append(f"state:{len(weights)}")

    async def close(self):
        pass


def _fake_factory(i):
    def make():
        return FakeEngine(i)
    return make


def _cpu_layout(n_engines: int):
    return layout_for(load_config("tiny", [f"rollout.num_engines={n_engines}"]))


class _Trainer:
    def __init__(self, weights):
        self.weights = weights

    def weights_ref(self):
        import ray

        return ray.put(self.weights), sum(t.numel() * t.element_size() for t in self.weights.values())


@pytest.mark.slow
def test_remote_engines_generate_and_sync_weights(ray_here):
    from types import SimpleNamespace

    from rstar2_core.runtime.ray.engine_actors import start_engines
    from rstar2_core.runtime.ray.placement import ActorGroup
    from rstar2_core.runtime.ray.weight_sync import make_weight_sync

    layout = _cpu_layout(2)
    with ActorGroup(None) as group:
        engines = start_engines(group, layout, factory=_fake_factory)
        assert [e.kv_capacity_tokens() for e in engines] == [1000, 1001]
        assert engines[0].kv_tokens_per_sequence() == 10

        async def many():
            p = SamplingParams(max_new_tokens=3)
            return await asyncio.gather(*[engines[i % 2].generate([1, 2, 3, i], p) for i in range(16)])

        outs = asyncio.run(many())  # would raise TimeoutError if an engine served requests one at a time
        assert outs[5].token_ids == (5, 3, 2) and outs[5].finish_reason == "length"

        weights = {"a": torch.ones(4), "b": torch.full((2, 2), 2.0)}  # sum 12
        rt = SimpleNamespace(engines=engines, trainer=_Trainer(weights),
                             cfg=load_config("tiny"))
        t0 = time.perf_counter()
        rep = make_weight_sync("object_store", rt).push()
        took = time.perf_counter() - t0
        assert rep.bytes == 8 * 4 and len(rep.engine_seconds) == 2
        # the push's seconds are its own (within the call, timed here) and hold each engine's load
        assert 0 < max(rep.engine_seconds) <= rep.metrics()["sync/seconds"] <= took, (rep, took)
        assert min(rep.engine_seconds) > 0 and rep.metrics()["sync/engine_max_s"] == max(rep.engine_seconds)
        out = asyncio.run(engines[1].generate([1], SamplingParams(max_new_tokens=1)))
        assert out.token_ids == (13,)
        rep = make_weight_sync("checkpoint", rt).push("s3://bucket/ckpt/step-3")
        assert rep.mode == "checkpoint" and rep.bytes == 0
        assert len(set(group.call_all("pid"))) == 2
        with pytest.raises(ValueError, match="needs the URL"):
            make_weight_sync("checkpoint", rt).push(None)
        with pytest.raises(ValueError, match="not a Ray-runtime backend"):
            make_weight_sync("state_dict", rt)


@pytest.mark.slow
def test_dead_engine_raises_actor_failure(ray_here, kill_and_wait):
    import ray

    from rstar2_core.runtime.ray.engine_actors import start_engines
    from rstar2_core.runtime.ray.placement import ActorGroup

    with ActorGroup(None) as group:
        engines = start_engines(group, _cpu_layout(2), factory=_fake_factory)
        kill_and_wait(ray, engines[0].handle)
        with pytest.raises(ActorFailure, match="engine-0"):
            asyncio.run(engines[0].generate([1, 2], SamplingParams(max_new_tokens=2)))
        assert group.actors == {}     # the group was shut down before the failure was raised
        with pytest.raises(ActorFailure):
            engines[0].update_weights("s3://x")


def test_production_engine_options_pin_tp_workers():
    from rstar2_core.runtime.ray.engine_actors import engine_actor_options
    from rstar2_core.runtime.specs import engine_spec

    cfg = load_config("qwen3-14b-mi300x")
    layout = layout_for(cfg)
    opts = engine_actor_options(layout.engines[5], None)
    assert opts["num_gpus"] == 0
    assert opts["runtime_env"]["env_vars"] == {"VLLM_RAY_BUNDLE_INDICES": "2,3", "VLLM_RAY_PER_WORKER_GPUS": "0.5"}
    tp1 = layout_for(load_config("qwen3-14b-mi300x", ["rollout.tensor_parallel_size=1",
                                                          "rollout.num_engines=64"]))
    assert engine_actor_options(tp1.engines[9], None) == {"num_cpus": 1, "num_gpus": 0.5}
    spec = engine_spec(cfg, "s3://rstar2-artifacts/runs/x/sft", 12288 + 2048, "cuda")
    assert (spec.kind, spec.tensor_parallel_size, spec.dtype, spec.weight_transfer) == ("vllm", 2, "bfloat16", "ipc")
    actor = spec.for_actor("cuda", tp_over_ray=True)
    assert actor.distributed_executor_backend == "ray" and actor.max_model_len == 12288 + 2048


class _RecordingGroup:
    """Stands in for ActorGroup in start_engines: records each actor's Ray options, starts nothing."""

    def __init__(self):
        self.options: dict[str, dict] = {}
        self.actors: dict[str, object] = {}

    def pg(self, node):
        return None

    def spawn(self, name, cls, *args, **options):
        from types import SimpleNamespace

        self.options[name] = options
        self.actors[name] = SimpleNamespace(__ray_ready__=SimpleNamespace(remote=lambda: None))
        return self.actors[name]

    def get(self, refs, names, timeout=None):
        return refs

    def wait_ready(self, names, timeout_s, what="actors"):
        return None

    def shutdown(self):
        self.actors.clear()

    def failure(self, name, e):
        self.shutdown()
        return e


def _env(opts: dict) -> dict:
    return opts.get("runtime_env", {}).get("env_vars", {})


@pytest.mark.parametrize("overrides, ipc", [
    ([], True),                                                               # production: ipc, TP 2
    (["rollout.tensor_parallel_size=1", "rollout.num_engines=64"], True),     # ipc, TP 1
    (['cluster.layout="separate"', "cluster.trainer_gpus=32", 'rollout.weight_sync="nccl"',
      "rollout.num_engines=16"], False),                                      # nccl, TP 2
    (['cluster.layout="separate"', "cluster.trainer_gpus=32", 'rollout.weight_sync="nccl"',
      "rollout.tensor_parallel_size=1", "rollout.num_engines=32"], False),    # nccl, TP 1
])
def test_ipc_engines_and_only_they_allow_vllms_pickle_fallback(overrides, ipc):
    """IPC update infos hold reduce_tensor handles, which vLLM's msgpack encoder refuses unless
    VLLM_ALLOW_INSECURE_SERIALIZATION=1; every other engine keeps vLLM's safe default."""
    from rstar2_core.runtime import RuntimeSpec
    from rstar2_core.runtime.ray.engine_actors import start_engines

    cfg = load_config("qwen3-14b-mi300x", overrides)
    spec = RuntimeSpec.from_config(cfg, policy_url="s3://rstar2-artifacts/runs/x/sft", max_model_len=12288)
    assert {e.weight_transfer for e in spec.engines} == {"ipc" if ipc else "nccl"}
    assert [e.seed for e in spec.engines] == [cfg.rl.seed + i for i in range(cfg.rollout.num_engines)]
    group = _RecordingGroup()
    engines = start_engines(group, spec.layout, spec.engines)
    assert len(engines) == len(group.options) == cfg.rollout.num_engines
    for opts in group.options.values():
        env = _env(opts)
        assert ("VLLM_ALLOW_INSECURE_SERIALIZATION" in env) == ipc
        if ipc:
            assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
        if cfg.rollout.tensor_parallel_size > 1:   # the TP pinning variables are kept beside it
            assert {"VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS"} <= set(env)
