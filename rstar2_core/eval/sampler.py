"""Sample trajectories from a checkpoint with the real agent loop (engine + sandbox + chat format).

Shared by evaluation and the curation label check. `PolicySampler.open(cfg, checkpoint_url)` loads the
model once (`rstar2_core.models.load_model_and_tokenizer`) and wraps it in an `HFEngine`;
`PolicySampler(engine, chat, sandbox_cfg)` takes any `Engine` (tests use scripted ones).

    with PolicySampler.open(cfg, url) as s:
        groups = s.sample(["What is 2+3?"], n=4, limits=RolloutLimits(4, 384, 0.6), seed=0)

`label_check_sampler(cfg)` opens the sampler curation's label check needs (`data.label_check.model`,
else the base model), or gives None when the check is off.

`groups[i]` holds the n trajectories of problem i (the rollout contract's order). The sampler owns
one event loop for its whole life, so the engine's batching tasks and the sandbox (opened on the
first `sample` call, closed by `close()`) live on the same loop across calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Self

from rstar2_core.config import Config, SandboxConfig


class PolicySampler:
    def __init__(self, engine: Any, chat: Any, sandbox_cfg: SandboxConfig, scheduler: str = "kv_aware"):
        self.engine = engine
        self.chat = chat
        self.sandbox_cfg = sandbox_cfg
        self.scheduler = scheduler
        self._loop = asyncio.new_event_loop()
        self._sandbox: Any = None

    @classmethod
    def open(cls, cfg: Config, checkpoint_url: str) -> PolicySampler:
        import torch

        from rstar2_core.chat import ChatFormat
        from rstar2_core.models import load_model_and_tokenizer
        from rstar2_core.rollout import HFEngine

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, tok = load_model_and_tokenizer(checkpoint_url, device=device)
        model.eval()
        engine = HFEngine(model, tok, max_batch_size=cfg.rollout.max_batch_size, device=device)
        return cls(engine, ChatFormat(tok, with_tools=True), cfg.sandbox, cfg.rollout.scheduler)

    def sample(self, problems: Sequence[str], n: int, limits: Any, seed: int) -> list[list[Any]]:
        """n trajectories per problem, in problem order (list[list[Trajectory]])."""
        return self._loop.run_until_complete(self._sample(list(problems), n, limits, seed))

    async def _sample(self, problems: list[str], n: int, limits: Any, seed: int) -> list[list[Any]]:
        from rstar2_core.rollout import rollout_groups
        from rstar2_core.sandbox import make_sandbox

        if self._sandbox is None:
            sandbox = make_sandbox(self.sandbox_cfg)
            await sandbox.__aenter__()
            self._sandbox = sandbox
        return await rollout_groups(self.engine, self._sandbox, self.chat, problems, n, limits, seed=seed,
                                    scheduler=self.scheduler)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            if self._sandbox is not None:
                self._loop.run_until_complete(self._sandbox.__aexit__(None, None, None))
                self._sandbox = None
            close = getattr(self.engine, "close", None)
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
