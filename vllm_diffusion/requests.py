"""Admission checks for requests to a block-diffusion model.

A sampling parameter the engine does not honour is rejected here, in the API process,
with an error naming it (HTTP 400 from the server); nothing is silently ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.exceptions import VLLMValidationError

from vllm_diffusion.config import DiffusionEngineConfig
from vllm_diffusion.options import OptionError

_EPS = 1e-5

# (attribute, predicate saying the value is in use, why it is not supported)
_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("presence_penalty", lambda v: abs(v) > _EPS, "penalties"),
    ("frequency_penalty", lambda v: abs(v) > _EPS, "penalties"),
    ("repetition_penalty", lambda v: abs(v - 1.0) > _EPS, "penalties"),
    ("min_p", lambda v: v > _EPS, "min_p sampling"),
    ("min_tokens", lambda v: v > 0, "min_tokens"),
    ("logprobs", lambda v: v is not None, "sample logprobs"),
    ("prompt_logprobs", lambda v: v is not None, "prompt logprobs"),
    ("logprob_token_ids", lambda v: v is not None, "logprob_token_ids"),
    ("structured_outputs", lambda v: v is not None, "guided/structured decoding"),
    ("logit_bias", lambda v: bool(v), "logit_bias"),
    ("allowed_token_ids", lambda v: v is not None, "allowed_token_ids"),
    ("bad_words", lambda v: bool(v), "bad_words"),
    ("thinking_token_budget", lambda v: v is not None, "thinking_token_budget"),
    ("trace_decode_token_ids", lambda v: v is not None, "trace_decode_token_ids"),
)


def validate_sampling_params(params: Any, config: DiffusionEngineConfig) -> None:
    for name, in_use, what in _UNSUPPORTED:
        value = getattr(params, name, None)
        if value is not None and in_use(value):
            raise VLLMValidationError(
                f"{name}={value!r} is not supported by block-diffusion decoding "
                f"({what} cannot be honoured by the vllm-diffusion engine); remove it",
                parameter=name, value=value,
            )
    try:
        config.request_policy_config(params.extra_args)
    except OptionError as err:
        raise VLLMValidationError(str(err), parameter="extra_args") from err


def validate_prompt_ids(prompt_ids: Sequence[int] | None,
                        config: DiffusionEngineConfig) -> None:
    if not prompt_ids:
        return  # vLLM itself rejects empty prompts
    if config.mask_token_id in prompt_ids:
        position = list(prompt_ids).index(config.mask_token_id)
        raise VLLMValidationError(
            f"the prompt contains the mask token (id {config.mask_token_id}) at position "
            f"{position}; block-diffusion models reserve it for undecoded positions",
            parameter="prompt",
        )
