"""The engine's per-step diffusion counters, and their one encoding for vLLM's stats path.

vLLM 0.32 declares no field for a plugin's per-step statistics, so the counters ride in
``SpecDecodingStats`` (patches/README.md row 20): denoising steps in ``num_drafts``, canvas
positions in ``num_draft_tokens``, committed tokens in ``num_accepted_tokens``, and the
plugin's own in ``num_draft_tokens_per_pos`` (unread by vLLM's loggers), laid out as::

    [-LAYOUT_VERSION, positions_after_eviction, matcher_fills, matcher_accepts,
     chosen_chunk, substitutions, deletions, splits, layer 0, layer 1, ...]

which ``encode_counters`` (the scheduler) and ``decode_counters`` (stat loggers) alone know."""

from __future__ import annotations

import dataclasses

from vllm.v1.spec_decode.metrics import SpecDecodingStats

# Raise with any change of the layout. Negative, so no list of counts (vLLM's own use of
# the field) can be mistaken for it.
LAYOUT_VERSION = 1
_TAG = -LAYOUT_VERSION
# StepCounters' single counts in num_draft_tokens_per_pos, in this order after the tag
_PLUGIN_COUNTS = ("positions_after_eviction", "matcher_fills", "matcher_accepts",
                  "chosen_chunk")
_EDIT_KINDS = 3  # substitutions, deletions, splits


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


def encode_counters(counters: StepCounters) -> SpecDecodingStats:
    """One step's counters as the ``SpecDecodingStats`` the scheduler reports."""
    if len(counters.token_edits) != _EDIT_KINDS:
        raise ValueError(f"token_edits holds {_EDIT_KINDS} counts (substitutions, "
                         f"deletions, splits), got {counters.token_edits!r}")
    return SpecDecodingStats(
        num_spec_tokens=0, num_drafts=counters.denoised_blocks,
        num_draft_tokens=counters.block_positions,
        num_accepted_tokens=counters.committed_tokens,
        num_draft_tokens_per_pos=[_TAG, *(getattr(counters, name) for name in _PLUGIN_COUNTS),
                                  *counters.token_edits, *counters.layer_positions])


def decode_counters(stats: SpecDecodingStats) -> StepCounters | None:
    """The step's counters in ``stats``; None where they carry none of the plugin's (an
    empty per-position list)."""
    counts = list(stats.num_draft_tokens_per_pos)
    if not counts:
        return None
    singles = 1 + len(_PLUGIN_COUNTS)
    if counts[0] != _TAG or len(counts) < singles + _EDIT_KINDS:
        raise ValueError(
            f"SpecDecodingStats.num_draft_tokens_per_pos does not hold vllm-diffusion's "
            f"counters of layout version {LAYOUT_VERSION} (tag {_TAG}, then at least "
            f"{singles + _EDIT_KINDS - 1} counts), got {counts[:12]}")
    return StepCounters(
        denoised_blocks=stats.num_drafts, block_positions=stats.num_draft_tokens,
        committed_tokens=stats.num_accepted_tokens,
        **dict(zip(_PLUGIN_COUNTS, counts[1:singles])),
        token_edits=tuple(counts[singles:singles + _EDIT_KINDS]),
        layer_positions=tuple(counts[singles + _EDIT_KINDS:]))
