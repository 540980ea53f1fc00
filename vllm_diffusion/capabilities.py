"""What a model family's forward and decoding need (``ModelCapabilities``, declared in
``models/configs.py``) and what a policy does with given options (``PolicyTraits``, from
``PolicyConfig.traits``), compared by one check: ``refusal``, at start-up and for every
request; ``request_refusal`` adds what a family's decoding rules out for a request's
sampling parameters. Nothing here names a family (docs/extending.md, "A new model family").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


# Full attention's KV between a block's steps: the published loop, or Fast-dLLM's caches
# (docs/models.md, "Fast-dLLM's caches")
CACHE_MODES = ("recompute", "prefix", "dual")


@dataclasses.dataclass(frozen=True)
class ModelCapabilities:
    """What serving a model family needs (the defaults: SDAR's block diffusion)."""

    family: str  # named in refusals
    attention: str = "block_causal"  # "block_causal" (prefix and own block) or "full"
    exact_kv: bool = True  # the committed prefix's KV is what a recomputation would give
    shifted_logits: bool = False  # position i's logits predict token i + 1
    whole_canvas: bool = False  # the published loop decodes the whole canvas as one block
    # (DELETE, SPLIT) ids where the model's edits move tokens within a block (the block
    # then decodes by a loop that can rewrite it); None where positions are fixed
    edit_tokens: tuple[int, int] | None = None
    # experts chosen per routing block of this many tokens, from all of them: every forward
    # computes whole blocks (None: per-token routing or dense)
    routing_block_size: int | None = None
    # the family's published decoding settings, as policy option defaults
    option_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # those of its published block loop under Fast-dLLM's caches (above option_defaults)
    cached_option_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # config.json 'diffusion_option_defaults' (above both, below the engine's options)
    checkpoint_option_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def under_cache(self, cache_mode: str) -> ModelCapabilities:
        """The declaration the engine serves under ``cache_mode``: under Fast-dLLM's caches
        the family decodes by its block loop, block by block (never the whole canvas as
        one block), with its cached option defaults."""
        if cache_mode == "recompute":
            return self
        return dataclasses.replace(self, whole_canvas=False, option_defaults={
            **self.option_defaults, **self.cached_option_defaults})

    @property
    def moves_tokens(self) -> bool:
        return self.edit_tokens is not None

    @property
    def needs_whole_blocks(self) -> bool:
        """Every forward computes whole blocks (``whole_blocks_reason``)."""
        return self.whole_blocks_reason is not None

    @property
    def whole_blocks_reason(self) -> str | None:
        """Why every forward must compute whole blocks (None: it need not)."""
        if self.routing_block_size is not None:
            return f"{self.family} chooses each routing block's experts from all of its tokens"
        if self.attention == "full":
            return (f"every position of {self.family} attends to the whole sequence, which "
                    f"each step recomputes")
        if self.shifted_logits:
            return (f"{self.family}'s logits are shifted: each position's token is read from "
                    f"the row before it")
        return None

    def attention_span(self, block_size: int, max_model_len: int) -> int:
        """The size of the aligned spans whose rows attend to each other and to every
        earlier span: the diffusion block, or (full attention) the whole sequence."""
        if self.attention == "full":
            return -(-max_model_len // block_size) * block_size
        return block_size


@dataclasses.dataclass(frozen=True)
class PolicyTraits:
    """What a policy does with given options."""

    # why some forward computes part of a block or a commit follows another rule than
    # the unmasking strategies (None: every forward computes whole blocks)
    partial_blocks: str | None = None
    # why it cannot decode a block whose tokens move (None: it runs the rewriting loop)
    fixed_positions_only: str | None = "it does not run a loop whose edits move tokens"
    # whether it may drop rows inside the forward (grammar requests are never dropped)
    skips_rows: bool = False
    # the attention regimes (``ModelCapabilities.attention``) it decodes under
    attention_regimes: tuple[str, ...] = ("block_causal",)
    # under full attention: the cache modes (``CACHE_MODES``) it decodes under, and why
    # not the others (it acts on the cached KV of the positions outside the block)
    cache_modes: tuple[str, ...] = CACHE_MODES
    cache_modes_reason: str = ""
    # whether it decodes models whose logits are shifted (the planner reads a block's
    # logits one row earlier than the rows the policy plans)
    shifted_logits: bool = False
    # whether, where logits are shifted, its partial-block forwards keep the row before
    # every masked position they decode (so the shift alone needs no whole blocks)
    shifted_partial_blocks: bool = False
    # why some forward computes only a run of a block's positions from a known one (the
    # active sub-block; served under shifted logits), or None
    sub_block_rows: str | None = None


# The attention regimes the engine's backend computes (over an exact committed prefix).
SERVED_ATTENTION = ("block_causal", "full")


def model_refusal(model: ModelCapabilities) -> str | None:
    """Why the engine cannot serve ``model`` whatever the policy, or None."""
    if model.attention not in SERVED_ATTENTION:
        return (f"{model.family} attends {model.attention!r}; the engine serves "
                f"{', '.join(map(repr, SERVED_ATTENTION))} attention")
    if not model.exact_kv:
        return f"{model.family} declares an approximate committed KV; not served"
    return None


def refusal(model: ModelCapabilities, policy: Any, options: Mapping[str, Any],
            given: Mapping[str, Any] | None = None, block_size: int | None = None,
            cache_mode: str = "recompute") -> str | None:
    """Why ``policy`` (a policy class) with ``options`` (absent ones: defaults) cannot serve
    ``model``, or None. ``given``: the options the user set (default ``options``), where
    one for other models is refused; ``block_size``: checked where known (start-up)."""
    traits = policy.config_cls.traits(options)
    if model.attention not in traits.attention_regimes:
        return (f"the {policy.name} policy cannot serve {model.family}, which attends "
                f"{model.attention!r}: it decodes under "
                f"{', '.join(map(repr, traits.attention_regimes))} attention only; use the "
                f"standard policy")
    if (model.attention == "full" and cache_mode in CACHE_MODES
            and cache_mode not in traits.cache_modes):
        remedy = (f"; serve with 'diffusion_cache_mode' "
                  f"{' or '.join(map(repr, traits.cache_modes))}" if traits.cache_modes else "")
        return (f"the {policy.name} policy cannot serve {model.family} with "
                f"'diffusion_cache_mode' {cache_mode!r}: {traits.cache_modes_reason}{remedy}")
    if model.shifted_logits and not traits.shifted_logits:
        return (f"the {policy.name} policy cannot serve {model.family}, whose logits are "
                f"shifted (position i predicts i + 1): it plans its forwards for logits "
                f"read at their own rows; use the standard policy")
    if traits.sub_block_rows is not None and (model.routing_block_size is not None
                                              or model.attention == "full"):
        return (f"the {policy.name} policy cannot serve {model.family}: "
                f"{traits.sub_block_rows} ({model.whole_blocks_reason}, so every forward "
                f"must compute whole blocks)")
    # a model that needs whole blocks only for its shifted logits, and a policy whose
    # partial blocks keep every decoded position's row before it
    shifted_only = (model.shifted_logits and model.routing_block_size is None
                    and model.attention != "full")
    if model.needs_whole_blocks and not (shifted_only and traits.shifted_partial_blocks):
        routing = model.routing_block_size
        if traits.partial_blocks is not None:
            return (f"the {policy.name} policy cannot serve {model.family}: "
                    f"{traits.partial_blocks} ({model.whole_blocks_reason}, so every "
                    f"forward must compute whole blocks)")
        if traits.skips_rows and model.attention != "full":
            return (f"the {policy.name} policy cannot serve {model.family}: it drops rows "
                    f"inside the forward ({model.whole_blocks_reason}, so every row of a "
                    f"block goes through every layer)")
        if routing is not None and block_size is not None and block_size % routing:
            return (f"{model.family} routes experts per block of {routing} tokens (config "
                    f"block_size); the diffusion block size ({block_size}) must be a "
                    f"multiple of it")
    if model.moves_tokens and traits.fixed_positions_only is not None:
        return (f"the {policy.name} policy cannot serve {model.family}, whose edits move "
                f"tokens within a block: {traits.fixed_positions_only}; use the standard "
                f"policy")
    if not model.moves_tokens:
        named = [name for name in policy.config_cls.token_moving_options
                 if name in (options if given is None else given)]
        if named:
            return (f"option '{named[0]}' applies to decoding whose edits move tokens "
                    f"within a block; {model.family} does not decode that way, remove the "
                    f"option")
    return None


# Request features that need each output token at a fixed position, refused where a
# model's edits move tokens: (parameter, is it asked for, why it needs fixed positions)
_FIXED_POSITION_FEATURES = (
    ("logprobs", lambda p: p.logprobs is not None or bool(p.logprob_token_ids),
     "a token's logprob under moving positions is not defined yet"),
    ("bad_words", lambda p: bool(p.bad_words), "bad words are barred at fixed positions"),
    ("min_tokens", lambda p: bool(p.min_tokens),
     "min_tokens bars stop tokens at fixed output positions"),
    ("structured_outputs", lambda p: p.structured_outputs is not None
     and not p.structured_outputs.all_constraints_none(),
     "a grammar follows tokens at fixed positions"),
)


def request_refusal(model: ModelCapabilities, params: Any, block_size: int | None = None
                    ) -> tuple[str, str] | None:
    """(parameter, why) where ``params`` asks for what the model's decoding cannot give, or
    None. ``block_size``: the diffusion block size (a whole-canvas family's canvas)."""
    if (model.whole_canvas and block_size is not None and params.max_tokens is not None
            and params.max_tokens > block_size):
        return ("max_tokens", (
            f"max_tokens ({params.max_tokens}) is larger than the diffusion block size "
            f"({block_size}): {model.family} decodes the whole canvas of max_tokens "
            f"positions as one block, as its published loop does (decoding a longer canvas "
            f"block by block is not served yet); ask for at most {block_size} tokens, or "
            f"serve a larger diffusion_block_size (with diffusion_canvas_tokens a multiple "
            f"of it). An unset max_tokens is the model length minus the prompt"))
    if not model.moves_tokens:
        return None
    why = f"{model.family}'s edits move tokens within a block"
    if params.temperature >= 1e-5:
        return ("temperature", f"temperature is not supported where {why}: its published "
                "loop samples mask-to-token writes but edits greedily; only its greedy "
                "path (temperature 0) is implemented")
    for parameter, asked, reason in _FIXED_POSITION_FEATURES:
        if asked(params):
            return parameter, f"{parameter} is not supported where {why}: {reason}"
    return None
