"""The engine's per-step diffusion counters, encoded once for vLLM's stats path.

vLLM carries diffusion counters in ``SpecDecodingStats`` (as its native diffusion models
do): denoising steps in ``num_drafts``, canvas positions evaluated in
``num_draft_tokens``, committed tokens in ``num_accepted_tokens``. What is specific to
this plugin -- the block positions that reach the last layer (fewer when a policy drops
rows), the structured-output matcher calls (bitmask fills, tokens accepted), the chunk
size an adaptive policy chose, the token edits (substitutions, deletions, splits) and the
block positions through each layer -- travels in
``num_draft_tokens_per_pos``, which vLLM's own loggers do not read. ``encode`` (the
scheduler) and ``plugin_counters`` (the front end's loggers) are the only two places that
know that layout.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.spec_decode.metrics import SpecDecodingStats


@dataclasses.dataclass(frozen=True)
class StepCounters:
    denoised_blocks: int  # one per request with a block this step
    block_positions: int  # block positions entering the model
    positions_after_eviction: int  # block positions reaching the last layer
    committed_tokens: int
    layer_positions: tuple[int, ...] = ()  # block positions through each layer
    matcher_fills: int = 0  # structured output: grammar bitmask fills
    matcher_accepts: int = 0  # structured output: tokens advanced through matchers
    chosen_chunk: int = 0  # the chunk size the policy chose for the step (0: none)
    token_edits: tuple[int, int, int] = (0, 0, 0)  # substitutions, deletions, splits


@dataclasses.dataclass(frozen=True)
class PluginCounters:
    """The counters vLLM has no field for."""

    positions_after_eviction: int
    matcher_fills: int
    matcher_accepts: int
    chosen_chunk: int
    token_edits: tuple[int, int, int]
    layer_positions: tuple[int, ...]


def encode(counters: StepCounters) -> SpecDecodingStats:
    return SpecDecodingStats(
        num_spec_tokens=0, num_drafts=counters.denoised_blocks,
        num_draft_tokens=counters.block_positions,
        num_accepted_tokens=counters.committed_tokens,
        num_draft_tokens_per_pos=[counters.positions_after_eviction, counters.matcher_fills,
                                  counters.matcher_accepts, counters.chosen_chunk,
                                  *counters.token_edits, *counters.layer_positions])


def plugin_counters(stats: SpecDecodingStats) -> PluginCounters | None:
    """The plugin's counters in ``stats`` (None: a step that carried none)."""
    counts = stats.num_draft_tokens_per_pos
    if not counts:
        return None
    return PluginCounters(counts[0], counts[1], counts[2], counts[3], tuple(counts[4:7]),
                          tuple(counts[7:]))
