"""A model family's needs against a policy's options, checked in one place, at start-up
(the engine's options) and per request (the request's effective options).

Today one need is declared: a model whose forward routes experts per block of tokens
(LLaDA2.2's block routing: ``ModelNeeds.whole_blocks``) needs every forward to compute
whole blocks, and decodes by its joint loop. A policy declares, for given options, why it
computes part of a block in some forward or does not unmask by the strategies
(``DecodingPolicy.partial_block_reason``; None where it does neither).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelNeeds:
    # every forward computes whole blocks (experts chosen per block of tokens)
    whole_blocks: bool = False
    family: str = "this model"  # named in refusals


def model_needs(routes_per_block: bool) -> ModelNeeds:
    """What the served model needs: ``routes_per_block`` for LLaDA2.2 (recognised by its
    DELETE / SPLIT edit tokens, ``DiffusionEngineConfig.edit_token_ids``)."""
    if routes_per_block:
        return ModelNeeds(whole_blocks=True, family="LLaDA2.2")
    return ModelNeeds()


def combination_refusal(needs: ModelNeeds, policy: Any, options: Mapping[str, Any]
                        ) -> str | None:
    """Why ``policy`` (a policy class) with ``options`` cannot serve the model, or None."""
    if not needs.whole_blocks:
        return None
    reason = policy.partial_block_reason(options)
    if reason is None:
        return None
    return (f"the {policy.name} policy cannot serve {needs.family}: {reason} "
            f"({needs.family}'s block routing chooses each routing block's experts from "
            f"all of its tokens, so every forward must compute whole blocks)")
