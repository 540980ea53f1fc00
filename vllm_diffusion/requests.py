"""Admission checks for requests to a block-diffusion model: a sampling parameter the engine
does not honour is rejected in the API process with an error naming it (HTTP 400)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from vllm.exceptions import VLLMValidationError

from vllm_diffusion.capabilities import refusal, request_refusal
from vllm_diffusion.config import ROLLBACK_BACKENDS, DiffusionEngineConfig, wants_step_map
from vllm_diffusion.options import OptionError, listed, shown

# torch.Generator.manual_seed accepts exactly this range; a seed outside it would raise
# in the worker when the request's generator is built.
_SEED_RANGE = (-(2**63), 2**64 - 1)

# (attribute, predicate saying the value is in use, why it is not supported)
_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("prompt_logprobs", lambda v: v is not None,
     "a masked-prediction model has no next-token distribution over its prompt. A chat "
     "request with echo=true asks for them too (vLLM sets prompt_logprobs to top_logprobs "
     "when echo is set): remove prompt_logprobs, or echo"),
    ("thinking_token_budget", lambda v: v is not None,
     "a thinking budget needs a reasoning parser's token-by-token end marker"),
    ("trace_decode_token_ids", lambda v: v is not None,
     "decode traces are autoregressive; use the diffusion step map (return_step_map)"),
)


def _check_numbers(params: Any) -> None:
    """Every float sampling value is finite (NaN passes any range check) and the seed fits
    the generator."""
    for name in params.__struct_fields__:
        value = getattr(params, name, None)
        if isinstance(value, float) and not math.isfinite(value):
            raise VLLMValidationError(f"{name} must be a finite number, got {shown(value)}",
                                      parameter=name, value=shown(value))
    check_logit_bias(params.logit_bias)
    seed = params.seed
    if seed is not None and not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
        raise VLLMValidationError(
            f"seed must be an integer in [{_SEED_RANGE[0]}, {_SEED_RANGE[1]}], got {seed}",
            parameter="seed", value=seed)


def _token_shown(token: Any) -> str:
    """A token id as the client wrote it: an OpenAI request's ids are JSON object keys."""
    text = str(token)
    return text if text.lstrip("-").isdigit() and len(text) <= 20 else shown(token)


def check_logit_bias(logit_bias: Mapping[Any, Any] | None) -> None:
    """Every bias is a finite number. Token ids may still be the strings of an OpenAI
    request's ``logit_bias``."""
    for token, bias in (logit_bias or {}).items():
        if not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise VLLMValidationError(
                f"logit_bias must map token ids to finite numbers, got {shown(bias)} for "
                f"token {_token_shown(token)}",
                parameter="logit_bias", value=shown(bias))


def validate_sampling_params(params: Any, config: DiffusionEngineConfig) -> None:
    _check_numbers(params)
    for name, in_use, what in _UNSUPPORTED:
        value = getattr(params, name, None)
        if value is not None and in_use(value):
            raise VLLMValidationError(
                f"{name}={shown(value)} is not supported by block-diffusion decoding: {what}",
                parameter=name, value=shown(value))
    allowed = params.allowed_token_ids
    if allowed is not None and set(allowed) <= {config.mask_token_id}:
        raise VLLMValidationError(
            f"allowed_token_ids holds only the mask token ({config.mask_token_id}), which a "
            "block-diffusion model never proposes; allow at least one other token",
            parameter="allowed_token_ids", value=shown(allowed))
    try:
        policy_config = config.request_policy_config(params.extra_args)
    except OptionError as err:
        raise VLLMValidationError(str(err), parameter="extra_args") from err
    model = config.model
    refused = refusal(model, config.policy, dataclasses.asdict(policy_config),
                      given=params.extra_args or {}, cache_mode=config.cache_mode)
    if refused is not None:
        raise VLLMValidationError(f"extra_args: {refused}", parameter="extra_args")
    _refuse_for_model(params, config)
    _check_structured_outputs(params, config, policy_config)
    if params.n > 1 and wants_step_map(params.extra_args):
        # vLLM's responses keep only the first choice's kv_transfer_params, which carry
        # the step map: the other choices' maps would be lost.
        raise VLLMValidationError(
            f"return_step_map requires n=1 (got n={params.n}): the step map travels in "
            "kv_transfer_params, which the response carries for one choice only",
            parameter="n", value=params.n)


def _refuse_for_model(params: Any, config: DiffusionEngineConfig) -> None:
    """What the served family's decoding cannot give (``capabilities.request_refusal``)."""
    refused = request_refusal(config.model, params, config.block_size)
    if refused is not None:
        parameter, why = refused
        raise VLLMValidationError(why, parameter=parameter)


def _check_structured_outputs(params: Any, config: DiffusionEngineConfig,
                              policy_config: Any) -> None:
    """Structured output runs with a backend that can roll back, without token editing
    or logprobs."""
    wanted = params.structured_outputs
    if wanted is None or wanted.all_constraints_none():
        return
    backend = getattr(wanted, "_backend", None)

    def refuse(why: str) -> None:
        raise VLLMValidationError(f"structured_outputs: {why}", parameter="structured_outputs")

    if backend not in ROLLBACK_BACKENDS:
        refuse(f"the {backend!r} backend cannot roll back a matcher, which block decoding "
               f"needs to check a block's proposals; use one of {', '.join(ROLLBACK_BACKENDS)} "
               "(--structured-outputs-config.backend)")
    if getattr(policy_config, "editing_threshold", None) is not None:
        refuse("token editing (editing_threshold) changes emitted tokens, which a grammar "
               "cannot follow; remove editing_threshold from this request")
    if params.logprobs is not None or params.logprob_token_ids:
        refuse("logprobs of grammar-forced tokens are not defined yet; remove logprobs")


def validate_satisfiable(params: Any, config: DiffusionEngineConfig, vocab_size: int) -> None:
    """After vLLM resolved the request's stop tokens, bad words' tokenizations and an unset
    ``max_tokens``: refuse what the family's decoding cannot give for the resolved values,
    and what leaves no token for the first output position whatever the model proposes
    (docs/limits.md, "Failure handling"; what a grammar bars is known only in the step)."""
    _refuse_for_model(params, config)
    allowed = None if params.allowed_token_ids is None else set(params.allowed_token_ids)
    barred = {config.mask_token_id}
    why = ["the mask token"]
    one_token_words = {word[0] for word in params.bad_words_token_ids or () if len(word) == 1}
    if one_token_words:
        barred |= one_token_words
        why.append("bad_words")
    if params.min_tokens and params.all_stop_token_ids:
        barred |= set(params.all_stop_token_ids)
        why.append(f"min_tokens={params.min_tokens} (its stop tokens "
                   f"{listed(sorted(params.all_stop_token_ids))})")
    # barred ids are vocabulary ids (vLLM checks them), so the whole vocabulary has one left
    # unless every id is barred
    if (allowed - barred) if allowed is not None else len(barred) < vocab_size:
        return
    named = ("allowed_token_ids" if params.allowed_token_ids is not None else "the vocabulary")
    raise VLLMValidationError(
        f"no token is left for the output: {named} minus {', '.join(why)} is empty",
        parameter="allowed_token_ids" if params.allowed_token_ids is not None else "bad_words",
        value=shown(params.allowed_token_ids))


def validate_prompt_ids(prompt_ids: Sequence[int] | None,
                        config: DiffusionEngineConfig) -> None:
    if not prompt_ids:
        return  # vLLM itself rejects empty prompts
    if config.mask_token_id in prompt_ids:
        position = list(prompt_ids).index(config.mask_token_id)
        raise VLLMValidationError(
            f"the prompt contains the mask token (id {config.mask_token_id}) at position "
            f"{position}; block-diffusion models reserve it for undecoded positions",
            parameter="prompt")
