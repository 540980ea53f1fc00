"""What one diffusion step returns to the scheduler (``DiffusionRunnerOutput``, vLLM's
``ModelRunnerOutput`` with declared fields; the scheduler accepts nothing else, so a vLLM
change dropping them fails loudly) and what each request emits (``EmittedTokens``).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm.v1.outputs import ModelRunnerOutput

from vllm_diffusion.metrics import StepCounters
from vllm_diffusion.step.failures import NoProgress, UnsatisfiableRequest


@dataclasses.dataclass
class DiffusionRunnerOutput(ModelRunnerOutput):
    # This step's work, as the stat loggers receive it (``metrics.StepCounters``).
    counters: StepCounters = dataclasses.field(
        default_factory=lambda: StepCounters(0, 0, 0, 0))
    # req_id -> its committed prefix (exact KV) once this step ran, for every request
    # the step planned; the scheduler rolls num_computed_tokens back to it.
    committed_prefix: dict[str, int] = dataclasses.field(default_factory=dict)
    # req_id -> the denoising step that unmasked each of its output tokens so far (only
    # for requests that asked for a step map and emitted tokens this step).
    step_maps: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # req_id -> why its host-side step work failed, as its ``stop_reason``
    # (``step.failures.Failure``); the scheduler finishes exactly these with an error.
    failed_requests: dict[str, str] = dataclasses.field(default_factory=dict)


def empty_output() -> DiffusionRunnerOutput:
    return DiffusionRunnerOutput(req_ids=[], req_id_to_index={})


def require_diffusion_output(output: object) -> DiffusionRunnerOutput:
    if not isinstance(output, DiffusionRunnerOutput):
        raise TypeError(
            f"the block-diffusion scheduler needs a DiffusionRunnerOutput from the model "
            f"runner, got {type(output).__name__}: is the vllm_diffusion runner in use?")
    return output


@dataclasses.dataclass
class DiffusionStats:
    """Counters since start-up (hardware-independent measures of the work done)."""

    engine_steps: int = 0
    denoising_steps: int = 0  # block-steps: one per request per step with a block
    positions_computed: int = 0  # model rows, prefill and commit rows included
    block_positions_computed: int = 0  # block rows entering the model
    block_positions_after_eviction: int = 0  # block rows reaching the last layer
    # per layer: block rows whose queries that layer computed
    block_positions_per_layer: list[int] = dataclasses.field(default_factory=list)
    tokens_committed: int = 0  # final tokens emitted
    blocks_completed: int = 0
    # edits of filled positions: substitutions (LLaDA2.1 and 2.2) and LLaDA2.2's DELETE /
    # SPLIT writes (also on masks), which are counted on their own too
    tokens_edited: int = 0
    edited_blocks_completed: int = 0  # completed blocks with at least one edit
    tokens_deleted: int = 0  # DELETE writes (edits that move tokens)
    tokens_split: int = 0  # SPLIT writes (edits that move tokens)
    bucket_padding_rows: int = 0  # rows added by 'diffusion_row_buckets' after drops
    commits_reused: int = 0  # blocks committed with their last forward's KV (stable end)
    # full attention under Fast-dLLM's prefix or dual cache: steps whose forward rewrote
    # every position's KV (each block's first step, and a step after a preemption)
    kv_refreshes: int = 0
    grammar_fills: int = 0  # structured output: matcher bitmask fills
    grammar_accepts: int = 0  # structured output: tokens advanced through a matcher
    requests_failed: int = 0  # requests the runner ended with an error (all causes)
    requests_unsatisfiable: int = 0  # of them: no token left where the output needed one
    requests_without_progress: int = 0  # of them: the no-progress limit reached

    def count_failure(self, err: Exception) -> None:
        """A request the runner ended with ``err`` (``step.failures``)."""
        self.requests_failed += 1
        self.requests_unsatisfiable += isinstance(err, UnsatisfiableRequest)
        self.requests_without_progress += isinstance(err, NoProgress)

    def add_layer_rows(self, counts: list[int]) -> None:
        """Add a step's block rows per layer (``counts[l]``: rows layer l computed)."""
        per_layer = self.block_positions_per_layer
        per_layer.extend([0] * (len(counts) - len(per_layer)))
        for layer, count in enumerate(counts):
            per_layer[layer] += count


@dataclasses.dataclass
class EmittedTokens:
    """What a request returns from a step."""

    tokens: list[int]  # newly final tokens
    logprobs: torch.Tensor | None  # [len(tokens), 2 + 2k] logprob columns, if asked for
    step_map: list[int] | None  # the step map so far, if asked for
