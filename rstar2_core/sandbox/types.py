"""Request/result types of the Python tool (the contract between the sandbox, the chat format and RL).

`ExecutionResult.status` is structured: GRPO-RoC's error penalty counts failures from it, never by
searching the text for "error".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum


class Status(str, Enum):
    OK = "ok"
    ERROR = "error"                      # non-zero exit or exception; stderr holds type, line, message
    TIMEOUT = "timeout"                  # wall (or CPU) limit hit; the whole process tree was killed
    MEMORY = "memory"                    # address-space limit hit (MemoryError or allocation failure)
    OUTPUT_LIMIT = "output_limit"        # output over the cap with output_mode = "reject"
    KILLED = "killed"                    # died from a signal that is not one of ours
    INTERNAL = "internal"                # the service's own fault, never the program's
    INVALID_REQUEST = "invalid_request"  # the request itself was malformed

    @property
    def is_failure(self) -> bool:
        """A failed tool call for the RoC error penalty (the program's fault)."""
        return self not in (Status.OK, Status.INTERNAL)

    @property
    def is_infra(self) -> bool:
        """The service failed, not the program: the trajectory is excluded from group statistics."""
        return self is Status.INTERNAL


@dataclass(frozen=True)
class ExecutionRequest:
    code: str
    stdin: str = ""
    id: str = ""


@dataclass(frozen=True)
class ExecutionResult:
    id: str
    status: Status
    stdout: str
    stderr: str
    exit_code: int | None
    duration_s: float
    truncated: bool = False
    cpu_s: float | None = None   # user + system CPU seconds of the program's process tree (None: not measured)

    def to_json(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_json(cls, d: dict) -> ExecutionResult:
        """The result `to_json` wrote (the tool service's wire format)."""
        return cls(id=d["id"], status=Status(d["status"]), stdout=d["stdout"], stderr=d["stderr"],
                   exit_code=d["exit_code"], duration_s=d["duration_s"], truncated=d.get("truncated", False),
                   cpu_s=d.get("cpu_s"))


def invalid_result(req: object, why: str) -> ExecutionResult:
    """Status `invalid_request` for `req` (its `id` echoed when it is a string): the request, not the program."""
    rid = getattr(req, "id", "")
    return ExecutionResult(id=rid if isinstance(rid, str) else "", status=Status.INVALID_REQUEST, stdout="",
                           stderr=why, exit_code=None, duration_s=0.0)


def internal_results(reqs: list[ExecutionRequest], why: str) -> list[ExecutionResult]:
    """Status `internal` for each of `reqs`: the service failed them, not the programs."""
    return [ExecutionResult(id=r.id, status=Status.INTERNAL, stdout="", stderr=why, exit_code=None, duration_s=0.0)
            for r in reqs]

