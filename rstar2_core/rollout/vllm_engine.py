"""VLLMEngine: the `Engine` interface over vLLM's async engine (`AsyncLLMEngine` = v1 `AsyncLLM`).

vLLM is imported lazily (the `gpu` extra); nothing here runs on the CPU development machines. The
adapter's logic (request building, output conversion, abort on cancel, weight sync calls, KV
capacity) is tested against a fake `vllm` module injected into `sys.modules`
(tests/unit/rollout/test_vllm_engine.py); it has not been run against a real vLLM here.

Requests are token-in/token-out: `TokensPrompt(prompt_token_ids=...)`, `SamplingParams` with
`max_tokens`, `temperature`, `top_p`, `seed`, `stop` (stop strings; needs `detokenize=True`),
`stop_token_ids`, `include_stop_str_in_output=True` and `skip_special_tokens=False` (the returned
ids are every sampled token, so training sees exactly them), `logprobs=0` (only the sampled token's
logprob) and `output_kind=FINAL_ONLY` (one output per request, no streaming overhead). The engine is
built with `logprobs_mode="processed_logprobs"` so logprobs are taken after temperature, as in
`HFEngine`; with top_p < 1 vLLM's processed logprobs are renormalised over the nucleus, ours are not
(see sampling.py): identical at the paper's top_p = 1.

Weight updates (after each RL step), both through a worker extension (`WeightSyncExtension`, passed as
`worker_extension_cls`, called on every worker with `collective_rpc`):
- `update_weights(state_dict)`: the tensors are sent to each worker (serialised through vLLM's RPC,
  i.e. a host copy: ~2 bytes x parameters per worker, ~28 GB for 14B in bf16, seconds per update;
  production on one node should instead pass CUDA IPC handles or broadcast over NCCL from the trainer
  rank, the same `load_weights` call at the end), then `model.load_weights` reshards them for tensor
  parallelism.
- `update_weights(checkpoint_uri)`: each worker reads the safetensors of a complete checkpoint
  itself (`rollout.weights.load_state_dict_from_uri`, s3:// included) and loads them: no tensor goes
  through the RPC, at the cost of one checkpoint read per worker.
Both end with `reset_prefix_cache()`, since cached KV was computed with the old weights. Call it between
RL steps, with no request in flight (requests then in flight would mix old and new weights).

vLLM's own weight-transfer API (`weight_transfer="nccl" | "ipc"`, built with
`WeightTransferConfig(backend=...)`; cluster/weight_sync.py drives it): `init_weight_transfer` joins
the trainer's NCCL group once, `receive_weights(update_info)` loads one update (NCCL broadcast from
trainer rank 0, or CUDA-IPC handles of a colocated trainer rank) with generation paused
(`pause_generation(mode="keep")` / `resume_generation`) and the prefix cache reset. `sleep(level)` /
`wake_up(tags)` are vLLM's sleep mode for colocated engines (the engine is built with
`enable_sleep_mode=True`). Written against vLLM's `examples/rl/` (rlhf_nccl.py, rlhf_ipc.py,
rlhf_async_new_apis.py); not run against a real vLLM here.

    engine = VLLMEngine("/ckpt/sft", max_model_len=12288, tensor_parallel_size=2)
    out = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=8192, seed=3))
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

from rstar2_core.rollout.types import GenerationOutput, SamplingParams
from rstar2_core.rollout.weights import load_state_dict_from_uri

_IDS = itertools.count()


def _vllm():
    try:
        import vllm
        import vllm.sampling_params
    except ImportError as e:
        raise ImportError("VLLMEngine needs vLLM: install the gpu extra (`uv pip install -e '.[gpu]'`) on a "
                          "CUDA/ROCm machine, or use rollout.engine = \"hf\"") from e
    return vllm


class WeightSyncExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); methods run there through `collective_rpc`."""

    def rstar2_load_state_dict(self, state_dict: dict) -> int:
        self.model_runner.model.load_weights(weights=list(state_dict.items()))
        return len(state_dict)

    def rstar2_load_checkpoint(self, uri: str) -> int:
        return self.rstar2_load_state_dict(load_state_dict_from_uri(uri))


class VLLMEngine:
    """`Engine` over vLLM's AsyncLLM (see module docstring).

    vLLM's engine lives on a private event-loop thread (it binds to the loop it first runs in), so
    `generate` works from any caller's loop and the synchronous `update_weights` of the `Engine`
    protocol can block on it.
    """

    def __init__(self, model: str, *, max_model_len: int | None = None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.85, dtype: str = "bfloat16", seed: int = 0,
                 kv_capacity_tokens: int | None = None, weight_transfer: str | None = None, **engine_kwargs: Any):
        vllm = _vllm()
        if weight_transfer is not None:
            from vllm.config import WeightTransferConfig

            engine_kwargs["weight_transfer_config"] = WeightTransferConfig(backend=weight_transfer)
        if max_model_len is not None:
            engine_kwargs["max_model_len"] = max_model_len
        args = vllm.AsyncEngineArgs(
            model=model, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, seed=seed, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}",
            enable_sleep_mode=True, **engine_kwargs)
        self._vllm = vllm
        self._weight_transfer = weight_transfer
        self._capacity_override = kv_capacity_tokens
        self._inflight, self._busy_since, self._busy_s = 0, 0.0, 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._engine = self._call(_build(vllm, args))

    def _call(self, coro):
        """Run a coroutine on the engine's loop and wait for it (from a thread without that loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def kv_capacity_tokens(self) -> int:
        """GPU KV blocks x block size, as vLLM sized them after profiling memory."""
        if self._capacity_override:
            return int(self._capacity_override)
        cache = self._engine.vllm_config.cache_config
        if not cache.num_gpu_blocks:
            raise RuntimeError("vLLM has not sized its KV cache yet (cache_config.num_gpu_blocks is unset); "
                               "set rollout.kv_capacity_tokens explicitly")
        return int(cache.num_gpu_blocks) * int(cache.block_size)

    def _sampling_params(self, p: SamplingParams):
        v = self._vllm
        return v.SamplingParams(
            n=1, max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
            stop=list(p.stop_strings), stop_token_ids=list(p.stop_token_ids), include_stop_str_in_output=True,
            skip_special_tokens=False, detokenize=bool(p.stop_strings), logprobs=0,
            output_kind=v.sampling_params.RequestOutputKind.FINAL_ONLY)

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, rid: str) -> GenerationOutput:
        final = None
        try:
            async for out in self._engine.generate(prompt=self._vllm.TokensPrompt(prompt_token_ids=prompt_ids),
                                                   sampling_params=self._sampling_params(params), request_id=rid):
                final = out
        except asyncio.CancelledError:
            await self._engine.abort(rid)
            raise
        if final is None or not final.outputs:
            return GenerationOutput((), (), "abort")
        return convert_output(final.outputs[0])

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        fut = asyncio.run_coroutine_threadsafe(self._generate(list(prompt_ids), params, f"rstar2-{next(_IDS)}"),
                                               self._loop)
        self._track(+1)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()         # cancels _generate on the engine loop, which aborts the request
            raise
        finally:
            self._track(-1)

    def _track(self, delta: int) -> None:
        now = time.perf_counter()
        if self._inflight == 0 and delta > 0:
            self._busy_since = now
        self._inflight += delta
        if self._inflight == 0:
            self._busy_s += now - self._busy_since

    def busy_seconds(self) -> float:
        """Wall seconds with at least one request running (vLLM batches them: the engine's busy time)."""
        extra = time.perf_counter() - self._busy_since if self._inflight else 0.0
        return self._busy_s + extra

    # ------------------------------------------------------- vLLM weight transfer (cluster/weight_sync.py)
    def init_weight_transfer(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        """Join the NCCL weight-transfer group of the trainer's rank 0 (`rollout.weight_sync = "nccl"`)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size}
        self._call(self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)))

    def receive_weights(self, update_info: dict) -> None:
        """Load new weights through vLLM's weight transfer (nccl: names/dtypes/shapes of what rank 0
        broadcasts; ipc: plus the CUDA-IPC handles), with generation paused and the prefix cache reset."""
        if self._weight_transfer is None:
            raise ValueError("this VLLMEngine was built without a weight-transfer backend; build it with "
                             "weight_transfer=\"nccl\" or \"ipc\" (rollout.weight_sync)")
        self._call(self._receive(update_info))

    async def _receive(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        pause = getattr(self._engine, "pause_generation", None)
        if pause is not None:
            await pause(mode="keep")
        try:
            await self._engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
            await self._engine.reset_prefix_cache()
        finally:
            resume = getattr(self._engine, "resume_generation", None)
            if resume is not None:
                await resume()

    def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode: drop the KV cache (and at level 1 offload the weights to host memory)."""
        self._call(self._engine.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep`: `tags=["weights"]` first (before a weight transfer), then `["kv_cache"]`."""
        self._call(self._engine.wake_up(tags))

    def update_weights(self, weights: dict[str, Any] | str) -> None:
        self._call(self._update_weights(weights))

    async def _update_weights(self, weights: dict[str, Any] | str) -> None:
        if isinstance(weights, str):
            await self._engine.collective_rpc("rstar2_load_checkpoint", args=(weights,))
        else:
            await self._engine.collective_rpc("rstar2_load_state_dict", args=(weights,))
        await self._engine.reset_prefix_cache()

    async def close(self) -> None:
        self._engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)


async def _build(vllm, args):
    return vllm.AsyncLLMEngine.from_engine_args(args)


def convert_output(completion: Any) -> GenerationOutput:
    """vLLM `CompletionOutput` -> `GenerationOutput` (token ids, sampled-token logprobs, finish reason)."""
    ids = tuple(int(t) for t in completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(ids):
        raise ValueError("vLLM returned no per-token logprobs; the request must set logprobs=0")
    logprobs = tuple(float(step[t].logprob) for step, t in zip(completion.logprobs, ids))
    reason = completion.finish_reason if completion.finish_reason in ("stop", "length") else "abort"
    stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    return GenerationOutput(ids, logprobs, reason, stop)
