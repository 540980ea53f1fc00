"""Why one request ended with an error in a diffusion step, as it travels to its client: the
scheduler ends it as ``FINISHED_ERROR`` with ``"vllm-diffusion error <HTTP status>:
<message>"`` as its ``stop_reason``, the per-request field vLLM carries to the
``RequestOutput`` (``seams/output_processor.py``; docs/limits.md, "Failure handling").
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from vllm_diffusion.error_messages import capped

_PREFIX = "vllm-diffusion error "
_PATTERN = re.compile(rf"^{_PREFIX}(\d{{3}}): (.*)$", re.DOTALL)


class RequestFailure(Exception):
    """Raised by one request's step work when it cannot go on; ``status``: its HTTP status."""

    status = 500


class UnsatisfiableRequest(RequestFailure):
    """No token satisfies the request's constraints at a position its output needs, or its
    logits there are non-finite: a client error."""

    status = 400


# vLLM's ``StructuredOutputOptions`` names -> what the request's field is called
_GRAMMAR_KINDS = {"JSON": "JSON schema", "JSON_OBJECT": "JSON object grammar",
                  "STRUCTURAL_TAG": "structural tag"}


class UncompilableGrammar(RequestFailure):
    """The structured-output backend could not compile the grammar vLLM's admission (which
    only parses it) passed: a client error naming the grammar's kind and the reason."""

    status = 400

    def __init__(self, kind: Any, err: Exception) -> None:
        """kind: vLLM's ``StructuredOutputOptions`` of the request (``REGEX``, ...)."""
        name = getattr(kind, "name", str(kind))
        what = _GRAMMAR_KINDS.get(name, name.lower().replace("_", " "))
        super().__init__(f"structured_outputs: the {what} could not be compiled: "
                         f"{type(err).__name__}: {err}")


class NoProgress(RequestFailure):
    """No token written, no block ended, for ``diffusion_max_steps_without_progress``
    consecutive denoising steps (steps its commit schedule leaves empty not counted)."""


@dataclasses.dataclass(frozen=True)
class Failure:
    status: int  # the HTTP status the client gets
    message: str

    def as_stop_reason(self) -> str:
        return f"{_PREFIX}{self.status}: {capped(self.message)}"

    @staticmethod
    def from_stop_reason(value: object) -> Failure | None:
        """The failure a ``stop_reason`` carries, or None where it carries none."""
        match = _PATTERN.match(value) if isinstance(value, str) else None
        return None if match is None else Failure(int(match.group(1)), match.group(2))

    @staticmethod
    def of(err: Exception, doing: str) -> Failure:
        """The failure of an exception raised while ``doing`` one request's step work."""
        if isinstance(err, RequestFailure):
            return Failure(err.status, str(err))
        return Failure(500, f"{type(err).__name__} while {doing}: {err}")


def count_progress(request: Any, progressed: bool, limit: int,
                   scheduled_idle: bool = False) -> None:
    """After a denoising step of ``request`` (a ``DiffusionRequest``): raise
    ``NoProgress`` after ``limit`` consecutive steps without progress. A step its commit
    schedule left empty by design (``scheduled_idle``, ``StepDecision.idle``) neither
    counts nor resets: the schedule itself bounds such steps."""
    if progressed:
        request.steps_without_progress = 0
        return
    if scheduled_idle:
        return
    request.steps_without_progress += 1
    if request.steps_without_progress >= limit:
        raise NoProgress(
            f"no progress in {limit} consecutive denoising steps (no token written, no "
            f"block ended; the engine's diffusion_max_steps_without_progress): the "
            f"decoding found no token it may commit")
