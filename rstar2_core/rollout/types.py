"""Token-in/token-out types shared by engines, the agent loop, the scheduler and the RL trainer.

Shapes: a `Trajectory` holds flat per-token tuples over the *response* (everything after the prompt):
`response_ids`, `loss_mask` (1 = token the model sampled, 0 = tool-response / template token) and
`logprobs` (sampling log-probabilities; 0.0 where loss_mask == 0) all have the same length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]
TrajectoryEnd = Literal["answer", "eos", "max_turns", "max_tokens", "infra_error"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]          # log p(token) under the sampling distribution, same length
    finish_reason: FinishReason          # stop (stop id/string/EOS), length (max_new_tokens), abort
    stop_string: str | None = None       # which stop string ended it, if any


@runtime_checkable
class Engine(Protocol):
    """An inference engine: many `generate` calls may be in flight at once."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput: ...

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache this engine can hold (for KV-aware admission)."""
        ...

    def update_weights(self, weights: dict[str, Any] | str) -> None:
        """Load new policy weights: a state_dict or a checkpoint URI."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class ToolCallRecord:
    name: str | None
    status: str           # sandbox Status value, or a parse error kind: invalid_json, unknown_tool, bad_arguments
    failed: bool          # counts toward the RoC error penalty
    infra: bool = False   # the service failed (Status.INTERNAL): not the model's fault
    duration_s: float = 0.0
    cpu_s: float | None = None   # the program's CPU seconds, where the sandbox measured them


@dataclass(frozen=True)
class Trajectory:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    response_text: str
    tool_calls: tuple[ToolCallRecord, ...]
    n_turns: int
    n_answer_blocks: int
    finish: TrajectoryEnd
    truncated: bool
    infra_error: str | None = None
    gen_time_s: float = 0.0
    tool_time_s: float = 0.0
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def n_tool_calls(self) -> int:
        return len(self.tool_calls)

    @property
    def n_failed_tool_calls(self) -> int:
        return sum(c.failed for c in self.tool_calls)

    @property
    def n_generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def infra_failed(self) -> bool:
        """The infrastructure failed this trajectory (an engine error, or a tool call the service failed):
        its outcome says nothing about the model."""
        return self.infra_error is not None or any(c.infra for c in self.tool_calls)


@dataclass(frozen=True)
class RolloutLimits:
    """Per-trajectory limits and sampling settings of one RL stage (or of evaluation).

    max_response_tokens counts generated *and* tool-response tokens (RECIPE.md's max response
    length). The tool-response truncation sizes come from `RolloutConfig`.
    """

    max_turns: int
    max_response_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    tool_head_chars: int = 128
    tool_tail_chars: int = 128
    tool_max_chars: int = 1024
    tool_timing: bool = True        # tool responses end with the execution time (rollout.tool_response_timing)

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_response_tokens < 1:
            raise ValueError(f"RolloutLimits needs max_turns >= 1 and max_response_tokens >= 1 "
                             f"(got {self.max_turns}, {self.max_response_tokens})")

    @classmethod
    def from_config(cls, rollout_cfg: Any, max_turns: int, max_response_tokens: int,
                    temperature: float = 1.0, top_p: float | None = None) -> RolloutLimits:
        """Limits for a stage: `RolloutLimits.from_config(cfg.rollout, st.max_turns, st.max_response_tokens,
        cfg.rl.temperature)`; evaluation passes its own temperature/top_p."""
        return cls(max_turns, max_response_tokens, temperature,
                   rollout_cfg.top_p if top_p is None else top_p, rollout_cfg.tool_response_head_chars,
                   rollout_cfg.tool_response_tail_chars, rollout_cfg.tool_response_max_chars,
                   rollout_cfg.tool_response_timing)
