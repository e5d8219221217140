"""Stand-ins for what vLLM 0.32 cannot run on this machine, inside the installed vLLM: an engine with NCCL or
CUDA-IPC weight transfer, sleep mode or tensor parallelism (`FakeAsyncLLM`, as `vllm.AsyncLLMEngine`; a
CUDA platform for the adapter's checks), and the two GPU calls of vLLM's NCCL trainer engine (`NCCLWire`:
the sender's endpoint, a PyNccl group, and its packed broadcast). Everything else is vLLM's own: the trainer
factory and `NCCLTrainerWeightTransferEngine` (its rendezvous thread, its client calls, `_checked_iter`),
the init/update info dataclasses, `AsyncEngineArgs`, `SamplingParams`, `WeightTransferConfig`, the requests.

`install_fake_vllm(monkeypatch)` patches those three places for one test. `FakeAsyncLLM` records the calls
the adapter makes, in order, in `events`, and refuses what vLLM refuses, with vLLM's messages: a weight
update without `start_weight_update`, a finish without one, a second start, init or update info that the
backend's own dataclass does not take (parsed by that class, as vLLM's `parse_init_info` /
`parse_update_info` do, so its checks are vLLM's), a weight-transfer call on an engine built without a
backend, sleep mode without `enable_sleep_mode`. What vLLM's workers check only when they receive (IPC
handles looked up by GPU UUID, a packed buffer's byte table) is not applied here: the IPC tests run
vLLM's own `packed_ipc_consumer` and `unpack_tensor` for that. A failing worker call reaches the caller as vLLM's
`collective_rpc` failure does (`Exception("Call to collective_rpc method failed: Worker failed with error
'...'")`), and a failed update closes the session. tests/vllm/test_vllm_protocol.py runs the same
protocol against the real CPU engine and this fake."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import ClassVar

from vllm.distributed.weight_transfer import nccl_engine
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

ENGINE_CLASS = {"nccl": NCCLWeightTransferEngine, "ipc": IPCWeightTransferEngine}
"""vLLM's worker-side engine of each backend, whose `init_info_cls` / `update_info_cls` parse the infos."""


def worker_failure(message: str) -> Exception:
    """What `AsyncLLM.collective_rpc` raises when a worker raised `message` (vLLM 0.32, multiprocess executor)."""
    return Exception(f"Call to collective_rpc method failed: Worker failed with error '{message}', please check "
                     "the stack trace above for the root cause")


def _parse(kind: str, backend: str, info: dict):
    """vLLM's `WeightTransferEngine.parse_init_info` / `parse_update_info`, on the backend's real classes."""
    engine = ENGINE_CLASS[backend]
    try:
        return (engine.init_info_cls if kind == "init" else engine.update_info_cls)(**info)
    except TypeError as e:
        raise ValueError(f"Invalid {kind}_info for {engine.__name__}: {e}") from e


class FakeAsyncLLM:
    """Emits prompt[-1]+1, +2, ... until a stop id, a stop string (when the text has one) or max_tokens."""

    instances: ClassVar[list[FakeAsyncLLM]] = []

    def __init__(self, args):
        self.args, self.calls, self.aborted, self.rpcs, self.resets, self.loops = args, [], [], [], 0, set()
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=100, block_size=16))
        self.shut = False
        self.events: list = []
        wt = getattr(args, "weight_transfer_config", None)
        self.backend = wt.backend if wt is not None else None
        self.active = False          # a weight update is open on the workers
        FakeAsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(cls, args):
        return cls(args)

    async def generate(self, prompt, sampling_params, request_id):
        self.loops.add(asyncio.get_running_loop())
        self.calls.append((prompt, sampling_params, request_id))
        sp = sampling_params
        if sp.max_tokens == 999:          # a request that never finishes (for the cancel test)
            await asyncio.sleep(30)
        ids, lps, reason, stop = [], [], "length", None
        for i in range(sp.max_tokens):
            tok = prompt["prompt_token_ids"][-1] + 1 + i
            ids.append(tok)
            lps.append({tok: SimpleNamespace(logprob=-0.1 * (i + 1)), 0: SimpleNamespace(logprob=-9.0)})
            if tok in sp.stop_token_ids:
                reason, stop = "stop", tok
                break
            if "x" in sp.stop and tok == 50:
                reason, stop = "stop", "x"
                break
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lps, finish_reason=reason,
                                                       stop_reason=stop)])

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if not method.startswith("rstar2_"):
            raise worker_failure(f"'CUDAWorker' object has no attribute '{method}'")
        self.rpcs.append((method, args))
        self.events.append(("rpc", method))

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.resets += 1
        self.events.append("reset")

    def _configured(self) -> str:
        if self.backend is None:
            raise worker_failure("Weight transfer not configured. Please set weight_transfer_config to enable "
                                 "weight transfer.")
        return self.backend

    async def init_weight_transfer_engine(self, request):
        try:
            _parse("init", self._configured(), request.init_info)
        except ValueError as e:
            raise worker_failure(str(e)) from e
        self.events.append(("init", request.init_info))

    async def start_weight_update(self):
        self._configured()
        if self.active:
            raise worker_failure("start_weight_update called while a weight update is already active. Call "
                                 "finish_weight_update first.")
        self.active = True
        self.events.append("start")

    async def update_weights(self, request):
        backend = self._configured()
        if not self.active:
            raise worker_failure("start_weight_update must be called before update_weights.")
        try:
            _parse("update", backend, request.update_info)
        except ValueError as e:
            self.active = False
            raise worker_failure(str(e)) from e
        self.events.append(("update", request.update_info))

    async def finish_weight_update(self, weight_version=None):
        self._configured()
        if not self.active:
            raise worker_failure("finish_weight_update called without a matching start_weight_update.")
        self.active = False
        self.events.append("finish")

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        self.events.append(("pause", mode))

    async def resume_generation(self):
        self.events.append("resume")

    async def sleep(self, level=1, mode="abort"):
        if not self.args.enable_sleep_mode:
            raise worker_failure("Sleep mode is not enabled. Please compile vLLM with sleep mode enabled.")
        self.events.append(("sleep", level))

    async def wake_up(self, tags=None):
        self.events.append(("wake_up", tags))
        return True

    def shutdown(self):
        self.shut = True


# ----------------------------------------------------------------------------------- the trainer side
class NCCLWire:
    """The GPU calls of vLLM's `NCCLTrainerWeightTransferEngine`, recorded: `open_endpoint` stands for
    `nccl_common.trainer_init` (the sender opens the PyNccl group as rank 0: `inits` gets its init info) and
    `broadcast` for `packed_nccl_broadcast_producer` (`sent` gets what the sender would broadcast, after
    vLLM's `_checked_iter` checked it against the metadata, and the wire settings). Tests may patch either
    (install_fake_vllm looks them up at each call)."""

    inits: ClassVar[list[dict]] = []
    sent: ClassVar[list[tuple]] = []

    @classmethod
    def open_endpoint(cls, init_info):
        cls.inits.append(dataclasses.asdict(init_info))
        return SimpleNamespace(destroy=lambda: None)

    @classmethod
    def broadcast(cls, *, iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers):
        pairs = [(item[0], post_iter_func(item).detach().clone()) for item in iterator]
        cls.sent.append((pairs, {"src": src, "buffer_size_bytes": buffer_size_bytes, "num_buffers": num_buffers}))


CUDA_PLATFORM = SimpleNamespace(is_cpu=lambda: False, is_sleep_mode_available=lambda: True, device_name="cuda")
"""What the adapter asks of `vllm.platforms.current_platform`, answered as on a CUDA machine."""


def install_fake_vllm(monkeypatch):
    """Patch the installed vLLM for one test (undone by `monkeypatch`): `AsyncLLMEngine` is `FakeAsyncLLM`,
    the platform is CUDA's, the NCCL trainer engine's endpoint and broadcast are `NCCLWire`'s. Returns
    the `vllm` module."""
    import vllm
    import vllm.platforms

    monkeypatch.setattr(vllm, "AsyncLLMEngine", FakeAsyncLLM, raising=False)
    monkeypatch.setattr(vllm.platforms, "current_platform", CUDA_PLATFORM, raising=False)
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: NCCLWire.open_endpoint(info))
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", lambda **kw: NCCLWire.broadcast(**kw))
    FakeAsyncLLM.instances.clear()
    NCCLWire.inits.clear()
    NCCLWire.sent.clear()
    return vllm


def fake_checkpoint(tmp_path) -> str:
    """A folder VLLMEngine accepts (it checks for config.json; the fake reads nothing from it)."""
    (tmp_path / "config.json").write_text('{"num_attention_heads": 2, "hidden_size": 64, "num_hidden_layers": 1}')
    return str(tmp_path)


class InProcessEngine:
    """A `RemoteEngine` stand-in over an `EngineActor` built in this process: `handle.<method>.remote(...)`
    runs the actor's method at once and returns its result, `get(result)` returns it (what Ray would do,
    minus the processes). `tp` as RemoteEngine's."""

    def __init__(self, actor, name: str, tp: int = 1):
        self.name, self.tp, self._actor = name, tp, actor
        self.handle = self

    def __getattr__(self, method):
        return SimpleNamespace(remote=getattr(self._actor, method))

    def get(self, ref):
        return ref
