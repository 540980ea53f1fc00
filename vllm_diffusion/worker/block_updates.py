"""What a step does to its blocks once their proposals are made: the policy's decision for
all blocks (``decide``, held within grammars and bad words), then each block's canvas (its
slot's row, written in place) takes it and emits its newly final tokens (``apply``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_diffusion.policies.base import DecodingPolicy
from vllm_diffusion.policies.rules.token_editing import block_ends
from vllm_diffusion.step.failures import count_progress
from vllm_diffusion.step.plans import StepBlocks, StepDecision
from vllm_diffusion.step.request import DiffusionRequest
from vllm_diffusion.worker.bad_words import undo_completed_words
from vllm_diffusion.worker.constraints import position_rules
from vllm_diffusion.worker.grammar import GrammarCompiler, GrammarStep, advance
from vllm_diffusion.worker.logprobs import asked_count, own_columns, wants_logprobs
from vllm_diffusion.worker.outputs import DiffusionStats, EmittedTokens
from vllm_diffusion.worker.proposal_grid import ProposalGrid
from vllm_diffusion.worker.row_context import RowContext
from vllm_diffusion.worker.sampling import ROW_VALID
from vllm_diffusion.worker.failure_isolation import StepFailures
from vllm_diffusion.worker.step_plan import (RequestRows, decode_steps, emit_final_tokens,
                                             truncate_at_stop)


@dataclasses.dataclass
class ProposedBlocks:
    blocks: list[RequestRows]  # the denoised blocks' requests
    num_computed: list[int]  # each block's positions that reached the model output
    states: list[Any]  # vLLM's CachedRequestState of each block's request
    context: RowContext  # output canvases, bad words, seen tokens
    grammar: GrammarStep
    grid: ProposalGrid  # [R, B] proposals, confidence, computed, invalid, ...
    tokens: torch.Tensor  # [R, B] int64: the blocks before the step
    masked: torch.Tensor  # [R, B] bool: masked before the step
    filled: torch.Tensor  # [R, B] bool: changed by an earlier step of the block
    with_entropy: bool  # the commit choice reads each proposal's entropy

    @property
    def requests(self) -> list[DiffusionRequest]:
        return [b.request for b in self.blocks]

    @property
    def req_ids(self) -> list[str]:
        return [b.req_id for b in self.blocks]


@dataclasses.dataclass
class BlockChanges:
    """The policy's decision for the step's R blocks, held within grammars and bad words:
    [R, B] host tensors and per-block summaries (empty where the decision rewrites)."""

    decision: StepDecision
    commits: torch.Tensor  # [R, B] bool: positions unmasked
    edits: torch.Tensor  # [R, B] bool: filled positions given a new token
    tokens_after: torch.Tensor  # [R, B] int64: the blocks after commits and edits
    num_decoded: list[int]
    token_lists: list[list[int]]  # tokens_after as lists
    no_mask_left: list[bool]
    num_edited: list[int]  # filled positions given a new token, per block
    began_unmasked: list[bool]  # the step started with no masked position
    # left empty by design (``StepDecision.idle``): not a step without progress
    scheduled_idle: list[bool]


class BlockUpdates:
    """The block updates of one runner. The policy is given at each call (the warm-up
    decodes with a policy instance of its own)."""

    def __init__(self, mask_token_id: int, max_steps_without_progress: int,
                 stats: DiffusionStats, grammars: GrammarCompiler) -> None:
        self.mask_token_id = mask_token_id
        self.max_steps_without_progress = max_steps_without_progress
        self.stats = stats
        self.grammars = grammars

    def decide(self, step: ProposedBlocks, policy: DecodingPolicy,
               failures: StepFailures) -> BlockChanges:
        """The policy's decision for every block at once, within grammars and bad words."""
        grid, grammar, masked, context = step.grid, step.grammar, step.masked, step.context
        requests, blocks = step.requests, step.blocks
        proposals, confidence = grid.tokens, grid.confidence
        usable = grid.computed & (grid.invalid == ROW_VALID)  # [R, B]: proposals to commit
        available = masked & usable
        if grammar.active:  # only a grammar-valid run from the leftmost undecided position
            grammar.constrain(proposals, confidence, available, usable, position_rules(
                [b.canvas for b in blocks], step.states, context.output_canvas,
                [r.grammar is not None for r in requests]))
            failures.fail_each(step.req_ids, grammar.take_errors("walking its grammar"))
        tokens_before = step.tokens
        decision = _ask_policy(policy, StepBlocks(
            requests, confidence, available, proposals, tokens_before, usable & step.filled,
            grid.entropy if step.with_entropy else None, grid.ranked), failures)
        if decision.rewrites is not None:  # each block's rewriting is its own
            none = torch.zeros_like(masked)
            return BlockChanges(decision, none, none, tokens_before, [], [], [], [], [], [])
        commits = decision.commits
        scheduled_idle = [decision.is_idle(i) for i in range(len(blocks))]
        forced = [b.commit_candidates for b in blocks]  # ``RequestRows``
        if any(forced):
            commits = commits | (available & torch.tensor(forced)[:, None])
            scheduled_idle = [idle and not f for idle, f in zip(scheduled_idle, forced)]
        if grammar.active:
            grammar.include_first(commits)
        edits = decision.edits if decision.edits is not None else torch.zeros_like(commits)
        tokens_after = torch.where(commits | edits, proposals, tokens_before)
        for i, block_words in enumerate(context.words):
            if block_words:
                undo_completed_words(context.output_canvas[i], blocks[i].canvas.start
                                     - len(step.states[i].prompt_token_ids), block_words,
                                     commits[i], edits[i], tokens_before[i], tokens_after[i],
                                     self.mask_token_id)
        if grammar.active:  # after the undo: the run from F holds no undone position
            grammar.restrict(commits)
            tokens_after = torch.where(commits | edits, proposals, tokens_before)
        # the per-block counts from one host list each (a few values per block)
        token_lists = tokens_after.tolist()
        return BlockChanges(decision, commits, edits, tokens_after,
                            [sum(row) for row in commits.tolist()], token_lists,
                            [self.mask_token_id not in row for row in token_lists],
                            [sum(row) for row in edits.tolist()],
                            [not any(row) for row in masked.tolist()], scheduled_idle)

    def apply(self, step: ProposedBlocks, changes: BlockChanges, policy: DecodingPolicy,
              failures: StepFailures) -> dict[str, EmittedTokens]:
        """Each block takes its changes; returns what each request emits."""
        emitted: dict[str, EmittedTokens] = {}
        logprobs = step.grid.logprobs
        rewrites = changes.decision.rewrites
        for i, (block, state) in enumerate(zip(step.blocks, step.states)):
            req_id, params = block.req_id, state.sampling_params
            if req_id in failures:
                continue
            with failures.isolated(req_id, "taking its step"):
                if rewrites is not None:
                    emitted[req_id] = self._rewrite(policy, step, changes.decision, i)
                else:
                    emitted[req_id] = self._unmask(
                        policy, step, changes, i,
                        None if logprobs is None or not wants_logprobs(params)
                        else own_columns(logprobs[i], asked_count(params)))
        return emitted

    def _rewrite(self, policy: DecodingPolicy, step: ProposedBlocks,
                 decision: StepDecision, i: int) -> EmittedTokens:
        """Block ``i`` takes its rewriting (``decision.rewrites[i]``, a ``JointStep``)."""
        canvas, stats = step.blocks[i].canvas, self.stats
        masked, old = step.masked[i], step.tokens[i]
        rewritten = decision.rewrites[i]
        canvas.commit(rewritten.changed, rewritten.tokens_written,
                      began_unmasked=not bool(masked.any()))
        canvas.rearrange(rewritten.source, rewritten.tokens)
        canvas.final_kv = rewritten.ended and torch.equal(rewritten.tokens, old)
        stats.tokens_deleted += rewritten.deletions
        stats.tokens_split += rewritten.splits
        moved = rewritten.deletions + rewritten.splits
        return self._finish_step(
            policy, step, i, rewritten.ended, int((rewritten.changed & masked).sum()),
            int((rewritten.changed & ~masked).sum()) + moved,
            canvas.tokens.tolist(), scheduled_idle=False, final_when_filled=False)

    def _unmask(self, policy: DecodingPolicy, step: ProposedBlocks, changes: BlockChanges,
                i: int, logprobs: torch.Tensor | None) -> EmittedTokens:
        """Block ``i`` takes its commits and edits. ``logprobs``: [B, C] the logprob
        columns of its positions this step (None: not asked for)."""
        canvas, computed = step.blocks[i].canvas, step.grid.computed[i]
        changed = changes.commits[i] | changes.edits[i]
        canvas.commit(changed, changes.tokens_after[i],
                      began_unmasked=changes.began_unmasked[i], logprobs=logprobs)
        post_steps = changes.decision.post_steps_of(i)
        block_done = changes.no_mask_left[i] and block_ends(
            post_steps, changes.num_edited[i] > 0, changes.began_unmasked[i],
            canvas.post_steps)
        canvas.final_kv = (block_done and not (changes.num_decoded[i]
                                               or changes.num_edited[i])
                           and bool(computed.all()))
        return self._finish_step(policy, step, i, block_done, changes.num_decoded[i],
                                 changes.num_edited[i],
                                 changes.token_lists[i], changes.scheduled_idle[i],
                                 final_when_filled=post_steps is None)

    def _finish_step(self, policy: DecodingPolicy, step: ProposedBlocks, i: int,
                     block_done: bool, num_decoded: int, num_edited: int, tokens: list[int],
                     scheduled_idle: bool, final_when_filled: bool) -> EmittedTokens:
        """After block ``i``'s step (its canvas updated, ``tokens`` the block now): tell the
        policy, emit the decoded run after the known tokens (where its tokens may still
        change, not ``final_when_filled``, nothing until the block ends), count."""
        block, state = step.blocks[i], step.states[i]
        request, canvas = block.request, block.canvas
        policy.after_step(request, step.masked[i], step.grid.computed[i], num_decoded,
                          block_done)
        num_known = len(state.prompt_token_ids) + len(state.output_token_ids)
        if not block_done and not final_when_filled:
            decoded = []
        else:
            decoded = emit_final_tokens(tokens, canvas.start, num_known, self.mask_token_id)
        final = truncate_at_stop(decoded, state.sampling_params, len(state.output_token_ids))
        if request.wants_step_map:
            request.step_map.extend(decode_steps(canvas, num_known, len(final)))
        if request.grammar is not None:
            advance(self.grammars, request.grammar, request.req_id, final)
        state.output_token_ids.extend(final)
        stats = self.stats
        stats.denoising_steps += 1
        stats.block_positions_computed += len(block.block_positions)
        stats.block_positions_after_eviction += step.num_computed[i]
        stats.tokens_committed += len(final)
        stats.blocks_completed += int(block_done)
        stats.tokens_edited += num_edited
        canvas.edits += num_edited
        stats.edited_blocks_completed += int(block_done and canvas.edits > 0)
        count_progress(request, bool(num_decoded or num_edited or block_done),
                       self.max_steps_without_progress, scheduled_idle)
        offset = num_known - canvas.start
        return EmittedTokens(
            final,
            None if canvas.logprobs is None else canvas.logprobs[offset:offset + len(final)],
            list(request.step_map) if request.wants_step_map else None)


def _ask_policy(policy: DecodingPolicy, blocks: StepBlocks,
                failures: StepFailures) -> StepDecision:
    """``policy.decide(blocks)`` for all blocks at once; if it raises, each block is asked
    alone so that only the request it fails for is finished (its block then unchanged)."""
    try:
        return policy.decide(blocks)
    except Exception:  # noqa: BLE001 - narrowed to the failing requests below
        parts = []
        for i, request in enumerate(blocks.requests):
            alone = blocks.rows([i])
            part = None
            with failures.isolated(request.req_id, "deciding its step"):
                part = policy.decide(alone)
            parts.append(StepDecision.nothing(alone) if part is None else part)
        return StepDecision.stack(parts)
