"""A strict fake of vLLM 0.32 on a GPU, for the paths that cannot run here: NCCL and CUDA-IPC weight
transfer, sleep mode, tensor parallelism (everything else runs against the real CPU build, tests/vllm/).

`install_fake_vllm(monkeypatch)` puts it in sys.modules. `FakeAsyncLLM` (as `vllm.AsyncLLMEngine`) records
the calls the adapter makes, in order, in `events`, and refuses what the pinned vLLM refuses, with vLLM's
messages: a weight update without `start_weight_update`, a finish without one, a second start, update or
init info with keys the backend's dataclass does not have (or without its required ones), a
weight-transfer call on an engine built without a backend, sleep mode without `enable_sleep_mode`. A
failing worker call reaches the caller as vLLM's `collective_rpc` failure does (`Exception("Call to
collective_rpc method failed: Worker failed with error '...'")`), and a failed update closes the session.
tests/vllm/test_vllm_protocol.py runs the same protocol against the real CPU engine and this fake, and
checks the field lists below against vLLM's dataclasses, so the fake cannot drift from the pinned
version. The trainer side (`WeightTransferTrainerFactory.trainer_init` + `send_weights()`) records what
it sends (`FakeNCCLTrainerEngine`)."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import sys
import types
from types import SimpleNamespace
from typing import ClassVar


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# the fields of vLLM 0.32's dataclasses (required ones first), checked against the real ones in tests/vllm/
INIT_FIELDS = {
    "nccl": ({"rank_offset", "world_size"},
             {"master_address", "master_port", "nccl_unique_id_b64", "packed", "packed_buffer_size_bytes",
              "packed_num_buffers"}),
    "ipc": (set(), {"packed"}),
}
UPDATE_FIELDS = {
    "nccl": ({"names", "dtype_names", "shapes"}, set()),
    "ipc": ({"names", "dtype_names", "shapes"}, {"ipc_handles", "ipc_handles_pickled", "tensor_sizes"}),
}
ENGINE_CLASS = {"nccl": "NCCLWeightTransferEngine", "ipc": "IPCWeightTransferEngine"}
FIELD_ORDER = {"init": {"nccl": ["rank_offset", "world_size"], "ipc": []},
               "update": {"nccl": ["names", "dtype_names", "shapes"], "ipc": ["names", "dtype_names", "shapes"]}}


def worker_failure(message: str) -> Exception:
    """What `AsyncLLM.collective_rpc` raises when a worker raised `message` (vLLM 0.32, multiprocess executor)."""
    return Exception(f"Call to collective_rpc method failed: Worker failed with error '{message}', please check "
                     "the stack trace above for the root cause")


def _parse(kind: str, backend: str, info: dict) -> None:
    required, optional = (INIT_FIELDS if kind == "init" else UPDATE_FIELDS)[backend]
    cls = f"{'NCCL' if backend == 'nccl' else 'IPC'}WeightTransfer{'Init' if kind == 'init' else 'Update'}Info"
    for key in info:
        if key not in required | optional:
            raise ValueError(f"Invalid {kind}_info for {ENGINE_CLASS[backend]}: {cls}.__init__() got an unexpected "
                             f"keyword argument '{key}'")
    missing = [f for f in FIELD_ORDER[kind][backend] if f in required - set(info)]
    if missing:                         # Python's own TypeError text (init infos are keyword-only dataclasses)
        what = "keyword-only" if kind == "init" else "positional"
        names = " and ".join(f"'{m}'" for m in missing) if len(missing) < 3 else (
            ", ".join(f"'{m}'" for m in missing[:-1]) + f", and '{missing[-1]}'")
        raise ValueError(f"Invalid {kind}_info for {ENGINE_CLASS[backend]}: {cls}.__init__() missing {len(missing)} "
                         f"required {what} argument{'s' if len(missing) > 1 else ''}: {names}")
    if kind == "update" and not (len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"])):
        raise ValueError("`dtype_names` and `shapes` should be of the same size as `names`")


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
@dataclasses.dataclass
class NCCLTrainerInitInfo:
    backend: ClassVar[str] = "nccl"
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2
    rank: int = dataclasses.field(kw_only=True)


@dataclasses.dataclass(kw_only=True)
class NCCLWeightTransferInitInfo:
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2


def worker_init_payload(info) -> dict:
    return {k: v for k, v in dataclasses.asdict(info).items() if v is not None}


@dataclasses.dataclass
class ParamMeta:
    name: str
    dtype: object
    shape: tuple


class WeightSource:
    pass


class FakeNCCLTrainerEngine:
    """vLLM's NCCL trainer engine: `trainer_init` opens the group (sender) after asking the client to
    init the workers; `send_weights` asks start, update (the metadata's names/dtypes/shapes), walks the
    source on every rank (the sender records what it would broadcast), asks finish."""

    inits: ClassVar[list[dict]] = []
    sent: ClassVar[list[tuple]] = []

    def __init__(self, info, client, source):
        self.info, self.client, self.source = info, client, source

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError("NCCL trainer weight transfer requires a WeightSource.")
        engine = cls(init_info, client, source)
        if init_info.rank == 0:
            client.init_weight_transfer_engine(worker_init_payload(NCCLWeightTransferInitInfo(
                master_address=init_info.master_address, master_port=init_info.master_port, rank_offset=1,
                world_size=init_info.world_size, packed=init_info.packed)))
            cls.open_endpoint(init_info)
        return engine

    @classmethod
    def open_endpoint(cls, init_info):
        cls.inits.append(dataclasses.asdict(init_info))

    def send_weights(self):
        meta = self.source.metadata()
        if self.info.rank != 0:
            for _ in self.source:
                pass
            return
        self.client.start_weight_update()
        self.client.update_weights({"names": [m.name for m in meta],
                                    "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                                    "shapes": [list(m.shape) for m in meta]})
        self.broadcast([(name, t.detach().clone()) for name, t in self.source])
        self.client.finish_weight_update()

    def broadcast(self, pairs):
        type(self).sent.append((pairs, self.info))


class WeightTransferTrainerFactory:
    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if init_info.backend != "nccl":
            raise ValueError(f"Invalid weight transfer backend: {init_info.backend}")
        return FakeNCCLTrainerEngine.trainer_init(init_info, client=client, source=source)


def install_fake_vllm(monkeypatch):
    """Put the fake `vllm` modules in sys.modules (undone by `monkeypatch`); returns the `vllm` module."""
    vllm = types.ModuleType("vllm")
    sp_mod = types.ModuleType("vllm.sampling_params")
    sp_mod.RequestOutputKind = RequestOutputKind
    vllm.sampling_params = sp_mod
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    vllm.TokensPrompt = lambda **kw: dict(**kw)
    vllm.AsyncEngineArgs = lambda **kw: SimpleNamespace(**kw)
    vllm.AsyncLLMEngine = FakeAsyncLLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: False, is_sleep_mode_available=lambda: True,
                                                 device_name="cuda")
    config_mod = types.ModuleType("vllm.config")
    config_mod.WeightTransferConfig = lambda backend: SimpleNamespace(backend=backend)
    base_mod = types.ModuleType("vllm.distributed.weight_transfer.base")
    base_mod.WeightTransferInitRequest = lambda init_info: SimpleNamespace(init_info=init_info)
    base_mod.WeightTransferUpdateRequest = lambda update_info: SimpleNamespace(update_info=update_info)
    base_mod.ParamMeta = ParamMeta
    base_mod.WeightSource = WeightSource
    nccl_mod = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
    nccl_mod.NCCLTrainerInitInfo = NCCLTrainerInitInfo
    common_mod = types.ModuleType("vllm.distributed.weight_transfer.nccl_common")
    common_mod.NCCLWeightTransferInitInfo = NCCLWeightTransferInitInfo
    common_mod.worker_init_payload = worker_init_payload
    factory_mod = types.ModuleType("vllm.distributed.weight_transfer.factory")
    factory_mod.WeightTransferTrainerFactory = WeightTransferTrainerFactory
    for name, mod in {"vllm": vllm, "vllm.sampling_params": sp_mod, "vllm.platforms": platforms,
                      "vllm.config": config_mod, "vllm.distributed": types.ModuleType("vllm.distributed"),
                      "vllm.distributed.weight_transfer": types.ModuleType("vllm.distributed.weight_transfer"),
                      "vllm.distributed.weight_transfer.base": base_mod,
                      "vllm.distributed.weight_transfer.nccl_engine": nccl_mod,
                      "vllm.distributed.weight_transfer.nccl_common": common_mod,
                      "vllm.distributed.weight_transfer.factory": factory_mod}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    FakeAsyncLLM.instances.clear()
    FakeNCCLTrainerEngine.inits.clear()
    FakeNCCLTrainerEngine.sent.clear()
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
