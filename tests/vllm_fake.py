"""A fake `vllm` package for the tests of code written against vLLM's documented API (vLLM does not
install on the development machines): `install_fake_vllm(monkeypatch)` puts it in sys.modules, with
`FakeAsyncLLM` as `vllm.AsyncLLMEngine` (it records the calls the adapter makes, in order, in `events`)
and `vllm.distributed.weight_transfer.nccl_engine` whose `NCCLWeightTransferEngine` records what the
trainer side sends. Used by tests/unit/rollout/test_rollout_vllm_engine.py and tests/unit/cluster/."""

from __future__ import annotations

import asyncio
import enum
import sys
import types
from types import SimpleNamespace
from typing import ClassVar


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class FakeAsyncLLM:
    """Emits prompt[-1]+1, +2, ... until a stop id, a stop string (when the text has one) or max_tokens."""

    instances: ClassVar[list[FakeAsyncLLM]] = []

    def __init__(self, args):
        self.args, self.calls, self.aborted, self.rpcs, self.resets, self.loops = args, [], [], [], 0, set()
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=100, block_size=16))
        self.shut = False
        self.events: list = []
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

    async def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        self.events.append(("rpc", method))

    async def reset_prefix_cache(self):
        self.resets += 1
        self.events.append("reset")

    async def init_weight_transfer_engine(self, request):
        self.events.append(("init", request.init_info))

    async def update_weights(self, request):
        self.events.append(("update", request.update_info))

    async def pause_generation(self, mode="abort"):
        self.events.append(("pause", mode))

    async def resume_generation(self):
        self.events.append("resume")

    async def sleep(self, level=1):
        self.events.append(("sleep", level))

    async def wake_up(self, tags=None):
        self.events.append(("wake_up", tags))

    def shutdown(self):
        self.shut = True



class FakeNCCLWeightTransferEngine:
    """vLLM's trainer side of the NCCL weight transfer: `trainer_init(init_info)` returns the group,
    `trainer_send_weights(iterator, trainer_args)` consumes the (name, tensor) iterator; both recorded."""

    inits: ClassVar[list[dict]] = []
    sent: ClassVar[list[tuple]] = []

    @classmethod
    def trainer_init(cls, init_info):
        cls.inits.append(dict(init_info))
        return SimpleNamespace(kind="nccl-group", init_info=dict(init_info))

    @classmethod
    def trainer_send_weights(cls, iterator, trainer_args):
        cls.sent.append(([(name, t.detach().clone()) for name, t in iterator], trainer_args))


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
    config_mod = types.ModuleType("vllm.config")
    config_mod.WeightTransferConfig = lambda backend: SimpleNamespace(backend=backend)
    base_mod = types.ModuleType("vllm.distributed.weight_transfer.base")
    base_mod.WeightTransferInitRequest = lambda init_info: SimpleNamespace(init_info=init_info)
    base_mod.WeightTransferUpdateRequest = lambda update_info: SimpleNamespace(update_info=update_info)
    nccl_mod = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
    nccl_mod.NCCLWeightTransferEngine = FakeNCCLWeightTransferEngine
    nccl_mod.NCCLTrainerSendWeightsArgs = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp_mod)
    monkeypatch.setitem(sys.modules, "vllm.config", config_mod)
    monkeypatch.setitem(sys.modules, "vllm.distributed", types.ModuleType("vllm.distributed"))
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer",
                        types.ModuleType("vllm.distributed.weight_transfer"))
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.base", base_mod)
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.nccl_engine", nccl_mod)
    FakeAsyncLLM.instances.clear()
    FakeNCCLWeightTransferEngine.inits.clear()
    FakeNCCLWeightTransferEngine.sent.clear()
    return vllm


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
