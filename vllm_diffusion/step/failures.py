"""Why one request ended with an error in a diffusion step, as it travels to its client.

The runner finishes a request alone when its host-side step work fails (the others go
on); the scheduler ends it as vLLM ends a failed request (``FINISHED_ERROR``, its KV
freed) and puts the reason in the output's ``stop_reason`` -- the declared per-request
field vLLM carries from the engine core to the ``RequestOutput`` -- as
``"vllm-diffusion error <HTTP status>: <message>"``. The offline ``LLM`` returns it as the
choice's ``stop_reason`` (``finish_reason`` "error"); the API server answers with that
status and message (``seams/output_processor.py``; a stream gets it as its error event).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from vllm_diffusion.error_messages import capped

_PREFIX = "vllm-diffusion error "
_PATTERN = re.compile(rf"^{_PREFIX}(\d{{3}}): (.*)$", re.DOTALL)


class RequestFailure(Exception):
    """Raised by one request's step work when the request cannot go on; ``status`` is the
    HTTP status its client gets."""

    status = 500


class UnsatisfiableRequest(RequestFailure):
    """No token satisfies the request's constraints at a position its output needs, or
    its sampling parameters make the logits there non-finite: the request asked for
    something that cannot be decoded (a client error)."""

    status = 400


# vLLM's ``StructuredOutputOptions`` names -> what the request's field is called
_GRAMMAR_KINDS = {"JSON": "JSON schema", "JSON_OBJECT": "JSON object grammar",
                  "STRUCTURAL_TAG": "structural tag"}


class UncompilableGrammar(RequestFailure):
    """The structured-output backend could not compile the request's grammar (an error
    in it, or compilation past the backend's time limit) although vLLM's admission
    check, which only parses it, passed it: a client error naming the grammar's kind
    and the backend's reason."""

    status = 400

    def __init__(self, kind: Any, err: Exception) -> None:
        """kind: vLLM's ``StructuredOutputOptions`` of the request (``REGEX``, ...)."""
        name = getattr(kind, "name", str(kind))
        what = _GRAMMAR_KINDS.get(name, name.lower().replace("_", " "))
        super().__init__(f"structured_outputs: the {what} could not be compiled: "
                         f"{type(err).__name__}: {err}")


class NoProgress(RequestFailure):
    """The request wrote no token and ended no block for the engine's limit of
    consecutive denoising steps (``diffusion_max_steps_without_progress``; steps its
    commit schedule leaves empty by design are not counted)."""

    status = 500


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
    """After one of the request's denoising steps (``request``: its ``DiffusionRequest``):
    raise ``NoProgress`` once it has written no token and ended no block for ``limit``
    consecutive steps. A step its commit schedule left empty by design
    (``scheduled_idle``, ``StepDecision.idle``) neither counts nor resets:
    the schedule itself bounds such steps."""
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
