"""Engine-wide diffusion configuration, resolved once at start-up, and per-request options.

Engine-wide options come from ``--additional-config`` or ``--diffusion-policy``
(``ENGINE_KEYS`` and the policy's options; docs/usage.md, "Engine-wide options"); per-request
overrides of the policy's options from ``SamplingParams.extra_args`` (OpenAI ``vllm_xargs``).
They are validated once, where vLLM builds its configuration (``engine_setup.py``): the
``DiffusionEngineConfig`` replaces ``vllm_config.additional_config`` (typed ``dict |
SupportsHash``, hashed through ``compute_hash``) and reaches the engine core and the workers
in the pickled ``VllmConfig`` (``engine_config_from_vllm``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from vllm_diffusion.architectures import ARCHITECTURES
from vllm_diffusion.capabilities import CACHE_MODES, ModelCapabilities
from vllm_diffusion.compact_json import ANY_WHITESPACE_KEY, parse_any_whitespace
from vllm_diffusion.options import (OptionError, Rule, option_names, parse_options,
                                    refuse_unknown, shown)
from vllm_diffusion.policies import POLICIES
from vllm_diffusion.request_limits import LIMIT_KEYS, RequestLimits, parse_request_limits

DEFAULT_BLOCK_SIZE = 4  # SDAR's default
DEFAULT_LOGITS_MEMORY_MIB = 256
# Every decoding writes a token in each step that computes a block's leftmost undecided
# position; 64 leaves room far above a run of steps computing none (docs/limits.md).
DEFAULT_MAX_STEPS_WITHOUT_PROGRESS = 64
# Full attention: the canvas past the current block's start (LLaDA's and Dream's gen_length)
DEFAULT_CANVAS_TOKENS = 256
ENGINE_KEYS = ("diffusion_policy", "diffusion_block_size", "mask_token_id",
               "diffusion_logits_memory_mib", "diffusion_row_buckets",
               "diffusion_max_steps_without_progress", "diffusion_canvas_tokens",
               "diffusion_cache_mode", *LIMIT_KEYS, ANY_WHITESPACE_KEY)
# Per-request keys that are not policy options; ``diffusion_policy`` is checked separately.
REQUEST_KEYS = ("diffusion_policy", "return_step_map")
_REQUEST_RULES = {"return_step_map": Rule(bool)}
# Where a request's step map travels to the client (kv_transfer_params of its outputs).
STEP_MAP_KEY = "diffusion_step_map"
# Structured-output backends whose matchers can roll back, which block decoding needs to
# check a block's proposals (checked at start-up and per request, used by the worker).
ROLLBACK_BACKENDS = ("xgrammar", "guidance")


@dataclasses.dataclass(frozen=True)
class DiffusionEngineConfig:
    policy_name: str
    block_size: int
    mask_token_id: int
    policy_config: Any  # the policy's config dataclass, engine defaults
    logits_memory_mib: int = DEFAULT_LOGITS_MEMORY_MIB
    # After a policy drops rows inside the forward, the rows that continue are padded up to
    # the smallest of these counts that holds them (for CUDA graphs; None: never padded)
    row_buckets: tuple[int, ...] | None = None
    # consecutive denoising steps without progress after which a request ends with an error
    max_steps_without_progress: int = DEFAULT_MAX_STEPS_WITHOUT_PROGRESS
    # what the served model's family declares it needs (``models/configs.py``)
    model: ModelCapabilities = ModelCapabilities(family="an unnamed model")
    # full attention: the canvas's reach past the current block's start (``CanvasGeometry``)
    canvas_tokens: int = DEFAULT_CANVAS_TOKENS
    limits: RequestLimits = RequestLimits()  # ``request_limits.py``
    json_any_whitespace: bool = False  # ``compact_json.py``
    # full attention: the KV between a block's steps (``capabilities.CACHE_MODES``)
    cache_mode: str = "recompute"

    @property
    def policy(self) -> type:
        return POLICIES[self.policy_name]

    def make_policy(self):
        """The engine's policy instance (one per runner)."""
        return self.policy(self.block_size, self.mask_token_id, self.policy_config)

    def compute_hash(self) -> str:
        """vLLM's hash of ``additional_config`` (part of its compilation cache key)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """The options as ``additional_config`` keys (``parse_engine_options`` takes them)."""
        return {"diffusion_policy": self.policy_name, "diffusion_block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "diffusion_logits_memory_mib": self.logits_memory_mib,
                "diffusion_row_buckets": self.row_buckets,
                "diffusion_max_steps_without_progress": self.max_steps_without_progress,
                "diffusion_canvas_tokens": self.canvas_tokens,
                "diffusion_cache_mode": self.cache_mode, **self.limits.to_options(),
                ANY_WHITESPACE_KEY: self.json_any_whitespace,
                **dataclasses.asdict(self.policy_config)}

    def request_policy_config(self, extra_args: Mapping[str, Any] | None) -> Any:
        """The policy options for one request: engine defaults overridden by extra_args."""
        if not extra_args:
            return self.policy_config
        source = "request extra_args (vllm_xargs)"
        if not isinstance(extra_args, Mapping):
            raise OptionError(f"{source} must be a mapping of option names to values, "
                              f"got {type(extra_args).__name__}")
        overrides = dict(extra_args)
        if overrides.get("kv_transfer_params"):  # set by a request's top-level field
            raise OptionError(
                "kv_transfer_params: KV-cache transfer between engines (disaggregated "
                "prefill and decode) is not supported by the vllm-diffusion engine; remove "
                "it (the engine returns its step map in the response's kv_transfer_params "
                "when asked with return_step_map)")
        overrides.pop("kv_transfer_params", None)  # an empty one asks for nothing
        for name, rule in _REQUEST_RULES.items():
            if name in overrides:
                rule.check(name, overrides.pop(name), source)
        requested = overrides.pop("diffusion_policy", self.policy_name)
        if requested != self.policy_name:
            raise OptionError(
                f"{source}: option 'diffusion_policy' must be the server's policy "
                f"{self.policy_name!r} (per-request policy switching is not supported), "
                f"got {shown(requested)}")
        refuse_unknown(overrides, {*option_names(self.policy.config_cls), *REQUEST_KEYS},
                       source, f" for policy {self.policy_name!r}")
        config = parse_options(self.policy.config_cls, overrides, source=source,
                               base=self.policy_config)
        for name in getattr(self.policy.config_cls, "engine_only", ()):
            if getattr(config, name) != getattr(self.policy_config, name):
                raise OptionError(
                    f"{source}: option '{name}' is engine-wide (set it at start-up); the "
                    f"server uses {getattr(self.policy_config, name)!r}")
        config.validate_for_block(self.block_size, source)
        return config


def wants_step_map(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether a request asked for the decode step of each output token."""
    if not extra_args or "return_step_map" not in extra_args:
        return False
    return _REQUEST_RULES["return_step_map"].check(
        "return_step_map", extra_args["return_step_map"], "request extra_args (vllm_xargs)")


def checked_checkpoint_defaults(model: ModelCapabilities, policy: type) -> dict[str, Any]:
    """The checkpoint's option defaults (config.json 'diffusion_option_defaults') that
    ``policy`` takes, checked; a name no policy takes raises ``OptionError``."""
    declared = model.checkpoint_option_defaults
    if not declared:
        return {}
    source = "config.json 'diffusion_option_defaults'"
    options = set(option_names(policy.config_cls))
    taken = {name: value for name, value in declared.items() if name in options}
    others = set(declared) - set(taken)
    if others:
        known = set().union(*(option_names(POLICIES[name].config_cls) for name in POLICIES))
        if others - known:
            raise OptionError(f"{source}: {', '.join(map(repr, sorted(others - known)))} "
                              f"is no policy's option")
    parse_options(policy.config_cls, taken, source=source)
    return taken


def parse_engine_options(values: Mapping[str, Any], *, config_block_size: int | None,
                         config_mask_token_id: int | None, vocab_size: int,
                         model: ModelCapabilities | None = None
                         ) -> DiffusionEngineConfig:
    """Validate ``additional_config`` and resolve block size and mask token. ``model``'s
    ``option_defaults`` lie below what ``additional_config`` sets."""
    source = "additional_config"
    values = dict(values)
    policy_name = values.pop("diffusion_policy", "standard")
    if policy_name not in POLICIES:
        raise OptionError(f"{source}: unknown diffusion policy {shown(policy_name)}; "
                          f"valid policies are {', '.join(sorted(POLICIES))}")
    policy = POLICIES[policy_name]
    block_size = values.pop("diffusion_block_size", None)
    if block_size is None:
        block_size = config_block_size or DEFAULT_BLOCK_SIZE
    block_size = Rule(int, low=1, high=1024).check("diffusion_block_size", block_size, source)
    mask_token_id = values.pop("mask_token_id", None)
    if mask_token_id is None:
        mask_token_id = config_mask_token_id
    if mask_token_id is None:
        raise OptionError(
            "the model has no mask token: its config.json has no 'mask_token_id' and its "
            "tokenizer no mask_token; set additional_config 'mask_token_id'")
    mask_token_id = Rule(int, low=0, high=vocab_size - 1).check(
        "mask_token_id", mask_token_id, source)

    def positive(key: str, default: int) -> int:
        return Rule(int, low=1, high=1 << 20).check(key, values.pop(key, default), source)

    logits_memory_mib = positive("diffusion_logits_memory_mib", DEFAULT_LOGITS_MEMORY_MIB)
    row_buckets = values.pop("diffusion_row_buckets", None)
    if row_buckets is not None:
        if not isinstance(row_buckets, (list, tuple)) or not row_buckets:
            raise OptionError(f"{source}: option 'diffusion_row_buckets' must be a non-empty "
                              f"list of row counts, got {shown(row_buckets)}")
        row_buckets = tuple(Rule(int, low=1, high=1 << 20).check(
            "diffusion_row_buckets", count, source) for count in row_buckets)
        if list(row_buckets) != sorted(set(row_buckets)):
            raise OptionError(f"{source}: option 'diffusion_row_buckets' must be increasing, "
                              f"got {list(row_buckets)}")
    max_steps_without_progress = positive("diffusion_max_steps_without_progress",
                                          DEFAULT_MAX_STEPS_WITHOUT_PROGRESS)
    canvas_tokens = positive("diffusion_canvas_tokens", DEFAULT_CANVAS_TOKENS)
    cache_mode = values.pop("diffusion_cache_mode", "recompute")
    limits = parse_request_limits(values, source)
    json_any_whitespace = parse_any_whitespace(values, source)
    options = set(option_names(policy.config_cls))
    model = model or ModelCapabilities(family="an unnamed model")
    if model.attention == "full" and canvas_tokens % block_size:
        raise OptionError(f"{source}: option 'diffusion_canvas_tokens' must be a multiple of "
                          f"the diffusion block size ({block_size}), got {canvas_tokens}")
    check_cache_mode(cache_mode, model, source)
    model = model.under_cache(cache_mode)
    defaults = {**model.option_defaults, **checked_checkpoint_defaults(model, policy)}
    values = {**{k: v for k, v in defaults.items() if k in options}, **values}
    refuse_unknown(values, {*ENGINE_KEYS, *options}, source, f" for policy {policy_name!r}")
    policy_config = parse_options(policy.config_cls, values, source=source)
    policy_config.validate_for_block(block_size, source)
    return DiffusionEngineConfig(policy_name, block_size, mask_token_id, policy_config,
                                 logits_memory_mib, row_buckets,
                                 max_steps_without_progress, model, canvas_tokens, limits,
                                 json_any_whitespace=json_any_whitespace,
                                 cache_mode=cache_mode)


def check_cache_mode(cache_mode: Any, model: ModelCapabilities, source: str) -> None:
    """One of ``CACHE_MODES``; an approximate cache needs a full-attention model."""
    if cache_mode not in CACHE_MODES:
        raise OptionError(f"{source}: option 'diffusion_cache_mode' must be one of "
                          f"{', '.join(CACHE_MODES)}, got {shown(cache_mode)}")
    if cache_mode != "recompute" and model.attention != "full":
        raise OptionError(f"{source}: option 'diffusion_cache_mode' {cache_mode!r} is for "
                          f"full-attention models; {model.family} attends block-causally "
                          "and keeps exact KV of its committed blocks")


def engine_config_from_vllm(vllm_config: Any) -> DiffusionEngineConfig:
    """The configuration resolved at start-up (``store_resolved``), as it was stored."""
    config = vllm_config.additional_config
    if isinstance(config, DiffusionEngineConfig):
        return config
    raise RuntimeError(
        "vllm-diffusion configuration was not resolved at start-up; is the model one of "
        f"the plugin's architectures ({', '.join(sorted(ARCHITECTURES))}) and the "
        "vllm_diffusion plugin loaded?")


def store_resolved(vllm_config: Any, config: DiffusionEngineConfig) -> None:
    """Keep the resolved configuration in the ``VllmConfig`` every process receives."""
    vllm_config.additional_config = config
