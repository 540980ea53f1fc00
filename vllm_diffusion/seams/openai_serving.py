"""The OpenAI endpoints' handlers: what parsing a request loses, checked for the plugin's
models before it becomes ``SamplingParams`` (patches/README.md row 22). A non-finite
``logit_bias`` (which ``SamplingParams`` would clamp to +-100) is refused with HTTP 400;
the JSON booleans of ``vllm_xargs`` (which its ``str | int | float`` schema turns into 1)
are put back, so the options parser refuses a boolean where a number is expected.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from typing import Any

from vllm_diffusion.seams._wrapping import first_wrap, is_diffusion_model

logger = logging.getLogger(__name__)


def _holds_boolean(value: Any) -> bool:
    return isinstance(value, bool) or (
        isinstance(value, list) and any(isinstance(item, bool) for item in value))


def restore_booleans(xargs: dict[str, Any] | None, body: Any) -> None:
    """Put back into ``xargs`` (the parsed ``vllm_xargs``, in place) each value the JSON
    ``body`` gave as a boolean, or a list holding one, where the parsed value is that value
    coerced (a body not this request's own, e.g. an Anthropic one, changes nothing)."""
    given = body.get("vllm_xargs") if isinstance(body, Mapping) else None
    if not xargs or not isinstance(given, Mapping):
        return
    for key, value in given.items():
        if key in xargs and _holds_boolean(value) and xargs[key] == value:
            xargs[key] = value


async def _request_body(raw_request: Any) -> Any:
    """The request's JSON body (FastAPI has already read and kept it), or None."""
    if raw_request is None:
        return None
    try:
        return await raw_request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, RuntimeError) as error:
        logger.debug("request body not readable again: %s", error)
        return None


def _checking(method):
    """``method`` (an endpoint's handler) with the request checked first, for the
    plugin's models; a refused request is answered with the handler's error response."""

    @functools.wraps(method)
    async def checking(self, request, raw_request=None, *args, **kwargs):
        if is_diffusion_model(getattr(self, "model_config", None)):
            from vllm.exceptions import VLLMValidationError

            from vllm_diffusion.requests import check_logit_bias

            try:
                check_logit_bias(getattr(request, "logit_bias", None))
            except VLLMValidationError as error:
                return self.create_error_response(error)
            restore_booleans(getattr(request, "vllm_xargs", None),
                             await _request_body(raw_request))
        return await method(self, request, raw_request, *args, **kwargs)

    return checking


def install() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    for cls, name in ((OpenAIServingChat, "create_chat_completion"),
                      (OpenAIServingCompletion, "create_completion"),
                      (OpenAIServingResponses, "create_responses")):
        if first_wrap(cls):
            setattr(cls, name, _checking(getattr(cls, name)))
