"""Sample trajectories from a checkpoint with the real agent loop (engines + sandbox + chat format);
shared by evaluation, the curation label check and the learning benchmark.

    with PolicySampler.open(cfg, url) as s:
        groups = s.sample(["What is 2+3?"], n=4, limits=RolloutLimits(4, 384, 0.6), seed=0)

`PolicySampler.open` opens the configured runtime without a trainer; `PolicySampler(engines, chat,
sandbox_cfg)` takes any `Engine` (tests use scripted ones); `label_check_sampler(cfg)` opens the label
check's (None when the check is off). Invariant: one event loop for the sampler's whole life, so the
engines' batching tasks, the runtime and the sandbox live on the same loop across calls.
See docs/data-and-eval.md, "Sampling from a checkpoint".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Self

from rstar2_core.config import Config, SandboxConfig


class PolicySampler:
    def __init__(self, engines: Any, chat: Any, sandbox_cfg: SandboxConfig | None, scheduler: str = "kv_aware",
                 *, runtime: Any = None, loop: asyncio.AbstractEventLoop | None = None, group_affinity: bool = False):
        self.engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        self.chat = chat
        self.sandbox_cfg = sandbox_cfg
        self.scheduler, self.group_affinity = scheduler, group_affinity
        self._runtime = runtime
        self._loop = loop or asyncio.new_event_loop()
        self._sandbox: Any = runtime.sandbox if runtime is not None else None

    @property
    def engine(self) -> Any:
        return self.engines[0]

    @classmethod
    def open(cls, cfg: Config, checkpoint_url: str, max_model_len: int | None = None) -> PolicySampler:
        """A sampler on the runtime of `cfg.cluster.runtime` for `checkpoint_url` (engines + sandbox)."""
        from rstar2_core.chat import ChatFormat
        from rstar2_core.runtime import open_runtime

        loop = asyncio.new_event_loop()
        try:
            rt = open_runtime(cfg, policy_url=checkpoint_url, max_model_len=max_model_len, grader=False)
            loop.run_until_complete(rt.__aenter__())
        except BaseException:
            loop.close()
            raise
        return cls(rt.engines, ChatFormat(rt.tokenizer, with_tools=True), cfg.sandbox, cfg.rollout.scheduler,
                   runtime=rt, loop=loop, group_affinity=cfg.rollout.group_affinity)

    def sample(self, problems: Sequence[str], n: int, limits: Any, seed: int) -> list[list[Any]]:
        """n trajectories per problem, in problem order (list[list[Trajectory]])."""
        return self._loop.run_until_complete(self._sample(list(problems), n, limits, seed))

    async def _sample(self, problems: list[str], n: int, limits: Any, seed: int) -> list[list[Any]]:
        from rstar2_core.rollout import rollout_groups
        from rstar2_core.sandbox import LocalSandbox

        if self._sandbox is None:
            sandbox = LocalSandbox(self.sandbox_cfg)
            await sandbox.__aenter__()
            self._sandbox = sandbox
        return await rollout_groups(self.engines, self._sandbox, self.chat, problems, n, limits, seed=seed,
                                    scheduler=self.scheduler, group_affinity=self.group_affinity)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            if self._runtime is not None:
                rt, self._runtime, self._sandbox = self._runtime, None, None
                self._loop.run_until_complete(rt.aclose())
                return
            if self._sandbox is not None:
                self._loop.run_until_complete(self._sandbox.__aexit__(None, None, None))
                self._sandbox = None
            for engine in self.engines:
                close = getattr(engine, "close", None)
                if close is not None:
                    res = close()
                    if asyncio.iscoroutine(res):
                        self._loop.run_until_complete(res)
        finally:
            self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def label_check_sampler(cfg: Config) -> Iterator[PolicySampler | None]:
    """The sampler of `data.label_check`'s checking model for `curate(..., sampler=...)`, closed on exit;
    None when the label check is off. Raises before loading anything when no model is configured."""
    lc = cfg.data.label_check
    if not lc.enabled:
        yield None
        return
    url = lc.model or cfg.model.name_or_path
    if not url:
        raise ValueError("data.label_check.enabled needs a checking model: set data.label_check.model "
                         "to a checkpoint URL (or model.name_or_path)")
    with PolicySampler.open(cfg, url) as sampler:
        yield sampler
