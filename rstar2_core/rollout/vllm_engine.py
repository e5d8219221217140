"""VLLMEngine: the `Engine` interface over vLLM's async engine (v1 `AsyncLLM`), pinned to vLLM 0.32.

    engine = VLLMEngine("/ckpt/sft", max_model_len=12288, max_num_seqs=64, tensor_parallel_size=2)
    out = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=8192, seed=3))

Requests are token-in/token-out (`TokensPrompt`, every sampled id returned, logprobs after temperature
as in `HFEngine`). Weights arrive through `WeightSyncExtension` on every worker (`collective_rpc`) or
vLLM's weight-transfer engines (`nccl`, `ipc`; GPU only). vLLM's CPU build runs it in the tests; NCCL
and IPC transfers, sleep mode and tensor parallelism are written to the pinned API, GPU only.
Invariant: every weight change resets the prefix cache, and while an update is unfinished (or failed)
the engine refuses to generate until whole weights load. See docs/rollout.md, "VLLMEngine".
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rstar2_core.rollout.types import GenerationOutput, SamplingParams
from rstar2_core.rollout.weights import load_state_dict_from_uri

_IDS = itertools.count()

VLLM_VERSIONS = ">=0.32,<0.33"
"""The vLLM releases this adapter is written and tested against (pyproject, infra/ images, setup.sh)."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Variables vLLM's CPU platform writes into the calling process's environment while it builds an engine
# (LD_PRELOAD of torch's libgomp among them). They matter to the engine's own worker processes, which
# have been started by the time the engine is built; restored afterwards so that later subprocesses of
# this process (the sandbox's interpreters, graders) do not inherit them.
_ENV_RESTORED_AFTER_BUILD = ("LD_PRELOAD", "VLLM_WORKER_MULTIPROC_METHOD", "NUMEXPR_MAX_THREADS",
                             "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
                             "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "VLLM_SSM_CONV_STATE_LAYOUT")


def _vllm():
    try:
        import vllm
        import vllm.sampling_params
    except ImportError as e:
        raise ImportError(f"rollout.engine = \"vllm\" needs vLLM {VLLM_VERSIONS}: `make setup` installs its CPU "
                          "build here; GPU images install the CUDA/ROCm build (infra/). Or use "
                          "rollout.engine = \"hf\"") from e
    return vllm


def kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int:
    """Bytes of K and V one token takes in the cache of the model at `model_dir` (all layers)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def _max_positions(model_dir: str | Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["max_position_embeddings"])


class WeightSyncExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); methods run there through `collective_rpc`."""

    def rstar2_stage_safetensors(self, blob: bytes, first: bool) -> int:
        """Add one chunk of a state dict (safetensors bytes) to what this worker holds for the next
        `rstar2_load_staged`; `first` drops what an earlier, unfinished update left."""
        from safetensors.torch import load

        staged = {} if first else getattr(self, "_rstar2_staged", None) or {}
        staged.update(load(blob))
        self._rstar2_staged = staged
        return len(staged)

    def rstar2_load_staged(self) -> int:
        staged, self._rstar2_staged = getattr(self, "_rstar2_staged", None) or {}, None
        if not staged:
            raise RuntimeError("rstar2_load_staged: no staged weights (send the chunks first)")
        return self._rstar2_load(staged)

    def rstar2_load_checkpoint(self, uri: str) -> int:
        return self._rstar2_load(load_state_dict_from_uri(uri))

    def _rstar2_load(self, state_dict: dict) -> int:
        # a model with tied embeddings stores them once in a checkpoint (HF drops lm_head.weight); vLLM's
        # in-place reload then leaves the output head on the old weights (measured on CPU: a 0.12 log-prob
        # gap), so the head gets the tied tensor under its own name, as a trainer's state dict has it
        tied = getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False)
        if tied and "lm_head.weight" not in state_dict and "model.embed_tokens.weight" in state_dict:
            state_dict = {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"]}
        # vLLM's in-place reload: after the first load a layer's parameters may be repacked into a kernel
        # layout; the reload restores the checkpoint layout, loads, and processes the weights again
        self.reload_weights(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)
        return len(state_dict)

    def rstar2_device(self) -> dict:
        """This worker's GPU as plain properties (the runtime turns them into an identity and checks them:
        runtime/devices.py): `uuid`, the PCI address and `total_memory` (bytes) of the device it computes on
        (`self.device`, which vLLM set; not the calling thread's current device), and `ray_gpu`, the GPU vLLM took for this
        worker from its Ray executor's assignment (None outside vLLM's Ray executor)."""
        import torch

        device = getattr(self, "device", None)
        index = device.index if isinstance(device, torch.device) and device.index is not None \
            else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        out = {k: getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")}
        ids = self.vllm_config.parallel_config.assigned_physical_gpu_ids
        rank = getattr(self, "local_rank", 0)
        out.update(uuid=str(getattr(props, "uuid", "") or ""), name=props.name, total_memory=props.total_memory,
                   ray_gpu=str(ids[rank]) if ids is not None and rank < len(ids) else None)
        return out


class VLLMEngine:
    """`Engine` over vLLM's AsyncLLM (see module docstring).

    vLLM's engine lives on a private event-loop thread (it binds to the loop it first runs in), so
    `generate` works from any caller's loop and the synchronous calls (`update_weights`, the
    weight-transfer protocol, sleep) can block on it.

    KV cache: `kv_capacity_tokens` sets it in tokens (turned into `kv_cache_memory_bytes` from the model's
    shape); unset, a GPU gives vLLM `gpu_memory_utilization` of its memory (None: 0.85), while on CPU (where
    that share would be of host memory, and is refused) the cache holds `max_num_seqs` sequences of
    `max_model_len` tokens, the HF engine's default. `kv_capacity_tokens()` reports what vLLM allocated
    (whole blocks).
    """

    def __init__(self, model_dir: str, *, max_model_len: int | None = None, max_num_seqs: int = 64,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None,
                 dtype: str = "bfloat16",
                 seed: int = 0, kv_capacity_tokens: int | None = None, weight_transfer: str | None = None,
                 sleep_mode: bool = False, distributed_executor_backend: str | None = None):
        vllm = _vllm()
        from vllm.platforms import current_platform

        if not Path(model_dir, "config.json").is_file():
            raise ValueError(f"VLLMEngine loads a local checkpoint folder; {model_dir!r} has no config.json "
                             "(localise a URL with rstar2_core.models.io.local_checkpoint_dir)")
        on_cpu = current_platform.is_cpu()
        if on_cpu and gpu_memory_utilization is not None:
            raise ValueError("rollout.gpu_memory_utilization is a share of GPU memory; a vLLM engine on CPU "
                             "sizes its KV cache by rollout.kv_capacity_tokens (0 = max_batch_size x the "
                             "maximum length): remove rollout.gpu_memory_utilization")
        if sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError("rollout.release_memory_during_training = true needs vLLM's sleep mode, which "
                             f"the {current_platform.device_name!r} platform does not have (CUDA and ROCm "
                             "only); set rollout.release_memory_during_training = false")
        kw: dict[str, Any] = {}
        if weight_transfer is not None:
            from vllm.config import WeightTransferConfig

            kw["weight_transfer_config"] = WeightTransferConfig(backend=weight_transfer)
        if max_model_len is not None:
            kw["max_model_len"] = max_model_len
        if distributed_executor_backend:
            kw["distributed_executor_backend"] = distributed_executor_backend
        if on_cpu:
            # the longest sequence: what vLLM itself takes when max_model_len is not given
            longest = max_model_len or _max_positions(model_dir)
            if kv_capacity_tokens is None:
                kv_capacity_tokens = max_num_seqs * longest
            # no chunked prefill on CPU: vLLM 0.32's CPU runner crashes the engine when a seeded request's
            # prefill is split across steps (it rewinds the request's torch.Generator, which CPU generators
            # refuse: "CPU Generator does not use offset"); each prompt is prefilled in one step instead
            kw["enable_chunked_prefill"] = False
            kw["max_num_batched_tokens"] = max(longest, 2048)
        if kv_capacity_tokens is not None:
            kw["kv_cache_memory_bytes"] = int(kv_capacity_tokens) * kv_bytes_per_token(model_dir, dtype)
        args = vllm.AsyncEngineArgs(
            model=str(model_dir), tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
            gpu_memory_utilization=0.85 if gpu_memory_utilization is None else gpu_memory_utilization,
            dtype=dtype, seed=seed, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", enable_sleep_mode=sleep_mode,
            # CPU: torch.compile of the model costs minutes on a few cores and CPU engines serve correctness
            # checks, not speed; GPUs keep vLLM's compiled graphs
            enforce_eager=on_cpu,
            worker_extension_cls=f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}", **kw)
        self._vllm = vllm
        self._weight_transfer = weight_transfer
        # set from the start of a weight-transfer update until it finishes: vLLM restores the layers to an
        # unloaded state at the start and fills them as chunks arrive, so an update that fails or is left
        # open leaves a model that kills the engine core at its next forward
        self._half_loaded: str | None = None
        self.weight_chunk_bytes = WEIGHT_CHUNK_BYTES
        self._inflight, self._busy_since, self._busy_s = 0, 0.0, 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        saved = {k: os.environ.get(k) for k in _ENV_RESTORED_AFTER_BUILD}
        try:
            self._engine = self._call(_build(vllm, args))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._capacity = _allocated_kv_tokens(self._engine)

    def _call(self, coro):
        """Run a coroutine on the engine's loop and wait for it (from a thread without that loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache vLLM allocated (blocks x block size)."""
        return self._capacity

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
        if self._half_loaded:
            raise RuntimeError(f"this vLLM engine's weights are half-loaded ({self._half_loaded}); load "
                               "whole weights with update_weights() or build a new engine")
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

    def worker_devices(self) -> list[dict]:
        """Each worker's GPU (`WeightSyncExtension.rstar2_device`), in the executor's worker order."""
        return list(self._call(self._engine.collective_rpc("rstar2_device")))

    # ------------------------------------------------------------------- worker-extension weight updates
    def update_weights(self, weights: dict[str, Any] | str) -> None:
        """Load a state dict (name -> tensor, HF names) or a checkpoint URI on every worker; call it with
        no request in flight (those would mix old and new weights)."""
        self._call(self._update_weights(weights))

    async def _update_weights(self, weights: dict[str, Any] | str) -> None:
        if isinstance(weights, str):
            await self._engine.collective_rpc("rstar2_load_checkpoint", args=(weights,))
        else:   # in chunks: vLLM's RPC encoder (msgpack) takes no bytes object of 4 GiB or more
            for i, blob in enumerate(safetensors_chunks(weights, self.weight_chunk_bytes)):
                await self._engine.collective_rpc("rstar2_stage_safetensors", args=(blob, i == 0))
            await self._engine.collective_rpc("rstar2_load_staged")
        await self._engine.reset_prefix_cache()
        self._half_loaded = None          # every layer was reloaded

    # ------------------------------------ vLLM's weight-transfer protocol (runtime/ray/weight_sync.py)
    def init_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's transfer (nccl: the rendezvous with trainer rank 0, blocking until it joins)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=dict(init_info))
        self._call(self._engine.init_weight_transfer_engine(request))

    def start_weight_update(self) -> None:
        """Pause generation (requests in flight stay queued) and open an update on every worker. Until
        `finish_weight_update` returns the engine serves nothing (`generate` refuses): a failed update
        leaves it so, and only `update_weights` (whole weights) or a new engine makes it serve again."""
        if self._half_loaded == "a weight update is open":
            raise RuntimeError("a weight update is already open on this engine: finish it first")
        self._call(self._start())

    async def _start(self) -> None:
        await self._engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._engine.start_weight_update()
        except BaseException:
            await self._engine.resume_generation()
            raise
        self._half_loaded = "a weight update is open"

    def receive_weight_chunk(self, update_info: dict) -> None:
        """Load one chunk (nccl: names/dtype_names/shapes of what trainer rank 0 broadcasts; ipc: plus the
        CUDA-IPC handles). Between `start_weight_update` and `finish_weight_update`."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        try:
            request = WeightTransferUpdateRequest(update_info=dict(update_info))
            self._call(self._engine.update_weights(request))
        except BaseException as e:
            if self._half_loaded:
                self._half_loaded = f"a weight update failed: {e}"
            raise

    def finish_weight_update(self) -> None:
        """Close the update on every worker, reset the prefix cache and resume generation."""
        self._call(self._finish())

    async def _finish(self) -> None:
        try:
            await self._engine.finish_weight_update()
            await self._engine.reset_prefix_cache()
            self._half_loaded = None
        finally:
            await self._engine.resume_generation()

    def receive_weights(self, update_info: dict) -> None:
        """One whole update of a single chunk (NCCL: the trainer broadcasts every parameter in it): start,
        receive, finish; after a failure generation resumes and the error propagates."""
        self.start_weight_update()
        try:
            self.receive_weight_chunk(update_info)
        except BaseException:
            self.abort_weight_update()
            raise
        self.finish_weight_update()

    def abort_weight_update(self) -> None:
        """Resume generation after a failed update (the worker already closed its side when it raised)."""
        self._call(self._engine.resume_generation())

    def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode: drop the KV cache (and at level 1 offload the weights to host memory)."""
        self._call(self._engine.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep`: `tags=["weights"]` first (before a weight transfer), then `["kv_cache"]`."""
        self._call(self._engine.wake_up(tags))

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        engine.shutdown()
        del engine               # collected now, not by vLLM's __del__ at interpreter exit (it fails there)
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)


async def _build(vllm, args):
    return vllm.AsyncLLMEngine.from_engine_args(args)


WEIGHT_CHUNK_BYTES = 64 << 20
"""Bytes of tensors per message when a state dict goes to the workers (`update_weights` with a dict), each
one safetensors blob (msgpack refuses 4 GiB or more). Each message is copied on its way (blob, RPC frame,
engine core, worker) while the worker stages the whole dict, so the size sets the push's memory peak
(1 GiB: ~7x a small model's size; 64 MiB: under 2x and no slower; smaller: more messages for 14B; figures
in docs/benchmarks-training.md). A tensor larger than this goes alone (Qwen3-14B's largest, the embedding,
~1.5 GB); one of 4 GiB or more would still be refused by the encoder."""


def safetensors_chunks(state_dict: dict[str, Any], max_bytes: int) -> Iterator[bytes]:
    """A state dict as safetensors blobs of at most `max_bytes` of tensors each (a larger tensor alone in
    its own), in the dict's order: vLLM's RPC encoder (msgpack) keeps bytes as they are, while tensors
    nested in a dict argument reach the worker as lists. Tensors sharing memory (tied input and output
    embeddings) are copied apart: safetensors refuses aliases."""
    from safetensors.torch import save

    seen: set[int] = set()
    out: dict[str, Any] = {}
    size = 0
    for k, v in state_dict.items():
        v = v.detach().contiguous()
        ptr = v.untyped_storage().data_ptr()
        v = v.clone() if ptr in seen else v
        seen.add(ptr)
        n = v.numel() * v.element_size()
        if out and size + n > max_bytes:
            yield save(out)
            out, size = {}, 0
        out[k], size = v, size + n
    if out:
        yield save(out)


def _allocated_kv_tokens(engine: Any) -> int:
    cache = engine.vllm_config.cache_config
    if not cache.num_gpu_blocks:
        raise RuntimeError("vLLM did not report its KV cache size (cache_config.num_gpu_blocks is unset)")
    return int(cache.num_gpu_blocks) * int(cache.block_size)


def convert_output(completion: Any) -> GenerationOutput:
    """vLLM `CompletionOutput` -> `GenerationOutput` (token ids, sampled-token logprobs, finish reason)."""
    ids = tuple(int(t) for t in completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(ids):
        raise ValueError("vLLM returned no per-token logprobs; the request must set logprobs=0")
    logprobs = tuple(float(step[t].logprob) for step, t in zip(completion.logprobs, ids))
    reason = completion.finish_reason if completion.finish_reason in ("stop", "length") else "abort"
    stop = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    return GenerationOutput(ids, logprobs, reason, stop)
