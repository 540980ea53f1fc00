"""``InputProcessor``: request admission for the plugin's models (patches/README.md row
3). Unsupported sampling parameters, invalid per-request policy options, prompts
containing the mask token and constraints that leave no token for the output (checked
once vLLM has resolved the stop tokens and bad words) are rejected with a
``VLLMValidationError`` (HTTP 400), before the request reaches the engine."""

from __future__ import annotations

import weakref
from typing import Any

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


def install() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_diffusion.requests import (validate_prompt_ids, validate_sampling_params,
                                         validate_satisfiable)

    if not first_wrap(InputProcessor):
        return
    original_validate_params = InputProcessor._validate_params
    original_validate_model_input = InputProcessor._validate_model_input
    original_process_inputs = InputProcessor.process_inputs

    def _validate_params(self, params, supported_tasks):
        result = original_validate_params(self, params, supported_tasks)
        config = diffusion_config(self)
        if config is not None and isinstance(params, SamplingParams):
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
            validate_satisfiable(request.sampling_params, config,
                                 self.vllm_config.model_config.get_vocab_size())
        return request

    InputProcessor._validate_params = _validate_params
    InputProcessor.process_inputs = process_inputs
    InputProcessor._validate_model_input = _validate_model_input
