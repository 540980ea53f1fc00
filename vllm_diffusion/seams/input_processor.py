"""``InputProcessor``: request admission for the plugin's models (patches/README.md row 3):
the request limits (``request_limits.py``, before vLLM builds a grammar or tokenizes bad
words), then sampling parameters, policy options, prompts and constraints (``requests.py``)
refused with HTTP 400, every error message capped at 1 KB (``error_messages.py``)."""

from __future__ import annotations

import functools
import weakref
from typing import Any

from vllm_diffusion.error_messages import errors_capped
from vllm_diffusion.seams._wrapping import first_wrap, serves_diffusion_model

# processor -> its resolved diffusion configuration (None: not one of the plugin's models)
_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def diffusion_config(processor: Any):
    """The processor's resolved diffusion configuration, or None for other models."""
    if processor not in _CONFIGS:
        from vllm_diffusion.config import engine_config_from_vllm

        vllm_config = processor.vllm_config
        _CONFIGS[processor] = (engine_config_from_vllm(vllm_config)
                               if serves_diffusion_model(vllm_config) else None)
    return _CONFIGS[processor]


def _capping_errors(method):
    """``method`` of an ``InputProcessor``, its errors for the plugin's models capped at
    1 KB of message (``error_messages.errors_capped``)."""

    @functools.wraps(method)
    def capping(self, *args, **kwargs):
        if diffusion_config(self) is None:
            return method(self, *args, **kwargs)
        with errors_capped():
            return method(self, *args, **kwargs)

    return capping


def install() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_diffusion.request_limits import check_bad_word_tokens, check_request_limits
    from vllm_diffusion.requests import (validate_prompt_ids, validate_sampling_params,
                                         validate_satisfiable)

    if not first_wrap(InputProcessor):
        return
    original_validate_params = InputProcessor._validate_params
    original_validate_model_input = InputProcessor._validate_model_input
    original_process_inputs = InputProcessor.process_inputs

    def _validate_params(self, params, supported_tasks):
        config = diffusion_config(self)
        ours = config is not None and isinstance(params, SamplingParams)
        if ours:  # before vLLM's own checks build the request's grammar
            check_request_limits(params, config.limits)
        result = original_validate_params(self, params, supported_tasks)
        if ours:
            validate_sampling_params(params, config)
        return result

    def _validate_model_input(self, prompt_input, prompt_type):
        original_validate_model_input(self, prompt_input, prompt_type)
        config = diffusion_config(self)
        if config is not None and prompt_input.get("type") != "embeds":
            validate_prompt_ids(prompt_input.get("prompt_token_ids"), config)

    def process_inputs(self, *args, **kwargs):
        request = original_process_inputs(self, *args, **kwargs)
        config = diffusion_config(self)
        if config is not None and request.sampling_params is not None:
            check_bad_word_tokens(request.sampling_params, config.limits)
            validate_satisfiable(request.sampling_params, config,
                                 self.vllm_config.model_config.get_vocab_size())
        return request

    InputProcessor._validate_params = _capping_errors(_validate_params)
    InputProcessor.process_inputs = _capping_errors(process_inputs)
    InputProcessor._validate_model_input = _capping_errors(_validate_model_input)
