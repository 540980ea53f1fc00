"""The diffusion model runner: one ``execute_model`` call is one denoising step.

``DiffusionRunnerMixin`` overrides only ``execute_model`` of vLLM's V1 model runner. It
keeps vLLM's request bookkeeping (``_update_states``: new, resumed and finished requests,
KV block tables), its model, KV cache and forward context, and replaces the autoregressive
input preparation and sampling with the block-diffusion step: plan the rows of every
request (``step_plan``), run the model once over all of them with block-causal attention
and the policy's forward hooks, propose tokens for the block rows that reached the last
layer, let the policy choose which to commit (one call for the whole batch), and return
the newly final tokens as this step's output. The runner never names a policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_diffusion.attention.backend import BlockDiffusionMetadata
from vllm_diffusion.config import engine_config_from_vllm, wants_step_map
from vllm_diffusion.models.step_run import StepRun
from vllm_diffusion.policies.joint_editing import ALTERNATIVES
from vllm_diffusion.step.failures import (Failure, RequestFailure, UnsatisfiableRequest,
                                          count_progress)
from vllm_diffusion.step.hooks import ForwardStep, StepHooks
from vllm_diffusion.step.plans import CommitBatch, EditBatch
from vllm_diffusion.step.request import DiffusionRequest, OutputBounds
from vllm_diffusion.step.rows import StepRows
from vllm_diffusion.worker.geometry import BlockGeometry
from vllm_diffusion.worker.outputs import (
    DiffusionRunnerOutput,
    DiffusionStats,
    EmittedTokens,
    StepDecisions,
    empty_output,
)
from vllm_diffusion.worker.bad_words import undo_completed_words
from vllm_diffusion.worker.constraints import (
    position_rules,
    unsatisfiable_blocks,
    unsatisfiable_message,
)
from vllm_diffusion.worker.grammar import GrammarCompiler, GrammarStep, advance
from vllm_diffusion.worker.logprobs import (
    asked_count,
    own_columns,
    to_vllm_lists,
    wants_logprobs,
)
from vllm_diffusion.worker.proposal import ProposalPipeline, chunk_rows
from vllm_diffusion.worker.proposal_grid import scatter_to_host
from vllm_diffusion.worker.row_context import RowContext
from vllm_diffusion.worker.sampling import ROW_VALID
from vllm_diffusion.worker.step_plan import (
    DenoisedBlock,
    KnownTokens,
    RequestRows,
    decode_steps,
    denoised_blocks,
    emit_final_tokens,
    forward_step,
    plan_request,
    step_inputs,
    stop_tokens,
    truncate_at_stop,
)

logger = init_logger(__name__)


class DiffusionRunnerMixin:
    """Mixed into vLLM's ``GPUModelRunner`` / ``CPUModelRunner``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.diffusion = engine_config_from_vllm(self.vllm_config)
        self.geometry = BlockGeometry(self.diffusion.block_size)
        self.policy = self.diffusion.make_policy()
        self.policy.bind_model(self.vllm_config.model_config.hf_config,
                               bool(self.cache_config.enable_prefix_caching))
        self.proposals = ProposalPipeline(
            self.diffusion.mask_token_id, self.policy.confidence_rule,
            chunk_rows(self.diffusion.logits_memory_mib,
                       self.vllm_config.model_config.get_vocab_size()),
            self.vllm_config.model_config.logprobs_mode,
            ranked=ALTERNATIVES if self.policy.rewrites_blocks() else 0)
        self.diffusion_requests: dict[str, DiffusionRequest] = {}
        self.num_layers = self.vllm_config.model_config.hf_config.num_hidden_layers
        self.diffusion_stats = DiffusionStats()
        self.grammars = GrammarCompiler(self.vllm_config, self.diffusion_stats)

    def worst_logits_chunk(self) -> list[int]:
        """Rows per request of the largest chunk of logits a step can make at once: whole
        blocks of ``max_num_seqs`` requests, as many as the logits budget holds (at least
        one block)."""
        block = self.diffusion.block_size
        requests = self.scheduler_config.max_num_seqs
        if self.proposals.max_rows is not None:
            requests = min(requests, max(1, self.proposals.max_rows // block))
        return [block] * requests

    def _dummy_sampler_run(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's profiling run ends with its sampler on one row per request; a diffusion
        step makes logits for every computed block position instead, a chunk of requests
        at a time. The largest chunk goes through the proposal pipeline's sampled path
        here, so that the peak memory vLLM measures at start-up (and, on CUDA, keeps free
        of KV cache) covers it."""
        from vllm import SamplingParams

        counts = self.worst_logits_chunk()
        hidden = torch.rand(sum(counts), hidden_states.shape[-1], dtype=hidden_states.dtype,
                            device=hidden_states.device)
        params = SamplingParams(temperature=0.5, top_p=0.9)
        return self.proposals.propose_from_hidden(
            self.model.compute_logits, hidden, counts, [params] * len(counts),
            [None] * len(counts)).tokens

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None):
        self._update_states(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self.diffusion_requests.pop(req_id, None)
        if not scheduler_output.total_num_scheduled_tokens:
            return empty_output()

        req_ids = [r for r in self.input_batch.req_ids if r is not None]
        # Host-side policy work of one request (planning here, unmasking after the
        # forward) that fails finishes only that request, with an error.
        failed: dict[str, str] = {}
        scheduled = []
        for req_id in req_ids:
            try:
                scheduled.append(self._request_state(req_id))
            except Exception as err:  # noqa: BLE001 - isolated to this request
                failed[req_id] = self._fail_request(req_id, "reading its options", err)
        self.policy.begin_step(scheduled)
        rows = []
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        for request in scheduled:
            try:
                rows.append(self._plan(request, scheduler_output,
                                       request.req_id in resumed))
            except Exception as err:  # noqa: BLE001 - isolated to this request
                failed[request.req_id] = self._fail_request(request.req_id,
                                                            "planning its step", err)
        stats = self.diffusion_stats
        before = (stats.block_positions_computed, stats.block_positions_after_eviction,
                  stats.grammar_fills, stats.grammar_accepts, stats.tokens_edited,
                  stats.tokens_deleted, stats.tokens_split)
        emitted: dict[str, EmittedTokens] = {}
        layer_rows: list[int] = []
        if rows:
            step = forward_step(rows, self.device)
            hooks = self.policy.forward_hooks(step)
            hidden_states, out_rows, layer_rows = self._forward(rows, step, hooks)
            emitted = self._denoise(rows, step, hidden_states, out_rows, failed)
        tokens_by_request = [emitted[r].tokens if r in emitted else [] for r in req_ids]
        stats.engine_steps += 1
        return DiffusionRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=tokens_by_request,
            logprobs=to_vllm_lists([emitted[r].logprobs if r in emitted else None
                                    for r in req_ids], tokens_by_request),
            block_positions=(stats.block_positions_computed - before[0],
                             stats.block_positions_after_eviction - before[1]),
            layer_block_positions=layer_rows,
            committed_prefix={r.req_id: r.committed for r in rows if r.req_id not in failed},
            denoised_blocks=sum(r.request is not None and r.req_id not in failed for r in rows),
            matcher_calls=(stats.grammar_fills - before[2], stats.grammar_accepts - before[3]),
            chosen_chunk=(self.policy.chosen_chunk() or 0) if rows else 0,
            token_edits=self._edit_counts(before[4:]),
            step_maps={r: e.step_map for r, e in emitted.items() if e.step_map is not None},
            failed_requests=failed,
        )

    def _edit_counts(self, before: tuple[int, int, int]) -> tuple[int, int, int]:
        """This step's (substitutions, deletions, splits), from the counters' values
        ``before`` it (edited, deleted, split)."""
        stats = self.diffusion_stats
        deleted, split = stats.tokens_deleted - before[1], stats.tokens_split - before[2]
        return stats.tokens_edited - before[0] - deleted - split, deleted, split

    def _fail_request(self, req_id: str, doing: str, err: Exception) -> str:
        """Forget a request whose step work raised; the scheduler finishes it with the
        returned ``stop_reason`` (``step.failures``)."""
        failure = Failure.of(err, doing)
        if isinstance(err, RequestFailure):  # the request's own doing: no traceback
            logger.warning("vllm-diffusion: request %s ended with an error: %s", req_id,
                           failure.message)
        else:
            logger.exception("vllm-diffusion: request %s failed while %s; finishing it "
                             "with an error (other requests continue)", req_id, doing)
        self.diffusion_requests.pop(req_id, None)
        self.diffusion_stats.count_failure(err)
        return failure.as_stop_reason()

    def _request_state(self, req_id: str) -> DiffusionRequest:
        """The request's diffusion state, made at its first step."""
        request = self.diffusion_requests.get(req_id)
        if request is None:
            extra_args = self.requests[req_id].sampling_params.extra_args
            config = self.diffusion.request_policy_config(extra_args)
            state = self.requests[req_id]
            params = state.sampling_params
            bounds = OutputBounds(stop_tokens(params), None if params.max_tokens is None
                                  else len(state.prompt_token_ids) + params.max_tokens)
            request = DiffusionRequest(req_id, config, self.policy.new_state(config),
                                       wants_step_map(extra_args), bounds=bounds,
                                       grammar=self.grammars.compile(params))
            self.diffusion_requests[req_id] = request
        return request

    def _plan(self, request: DiffusionRequest, scheduler_output: Any,
              resumed: bool) -> RequestRows:
        req_id = request.req_id
        state = self.requests[req_id]
        return plan_request(
            req_id, KnownTokens(state.prompt_token_ids, state.output_token_ids),
            state.num_computed_tokens, scheduler_output.num_scheduled_tokens[req_id],
            self.geometry, self.diffusion.mask_token_id, request, self.policy, resumed)

    def _forward(self, rows: list[RequestRows], step: ForwardStep, hooks: StepHooks | None
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Hidden states of the rows that reached the last layer, those rows, and the
        block rows each layer computed."""
        device = self.device
        inputs = step_inputs(rows, [self.requests[r.req_id].block_ids[0] for r in rows],
                             self.cache_config.block_size)
        positions = inputs.positions.to(device)
        step_rows = StepRows(query_positions=positions, slot_mapping=inputs.slots.to(device),
                             query_start_loc=inputs.query_start_loc, kv_lens=inputs.kv_lens)
        metadata = BlockDiffusionMetadata(rows=step_rows,
                                          block_table=inputs.block_table.to(device),
                                          diffusion_block_size=self.diffusion.block_size)
        token_ids = inputs.token_ids
        layer_names = [name for group in self.kv_cache_config.kv_cache_groups
                       for name in group.layer_names]
        # Steps without hooks run the model as vLLM built it (compiled unless eager);
        # steps with hooks run the layers between hook points as pieces compiled by the
        # model (``models/layer_segments.py``), the hooks eagerly between them.
        run = None
        if hooks is not None:
            block_rows = torch.zeros(step.num_rows, dtype=torch.bool)
            for s in step.requests:
                if s.block_rows is not None:
                    block_rows[s.block_rows] = True
            run = StepRun(hooks, block_rows, step_rows,
                          compiled=not self.model_config.enforce_eager,
                          row_buckets=self.diffusion.row_buckets)
        with set_forward_context({name: metadata for name in layer_names},
                                 self.vllm_config, num_tokens=len(positions),
                                 slot_mapping={}, skip_compiled=run is not None):
            if run is None:
                hidden_states = self.model(input_ids=token_ids.to(device), positions=positions)
            else:
                hidden_states = self.model(input_ids=token_ids.to(device),
                                           positions=positions, stack_run=run)
        stats = self.diffusion_stats
        stats.positions_computed += len(positions)
        stats.commits_reused += sum(r.reused_commit for r in rows)
        stats.bucket_padding_rows += run.padding_rows if run is not None else 0
        counts = (run.layer_block_rows if run is not None else
                  [sum(len(s.block_rows) for s in step.requests if s.block_rows is not None)]
                  * self.num_layers)
        stats.add_layer_rows(counts)
        out_rows = run.rows if run is not None else torch.arange(len(positions))
        return hidden_states, out_rows, counts

    def _denoise(self, rows: list[RequestRows], step: ForwardStep, hidden_states: torch.Tensor,
                 out_rows: torch.Tensor, failed: dict[str, str]) -> dict[str, EmittedTokens]:
        """Unmask every block of the step; a request whose unmasking raises is recorded in
        ``failed`` and outputs nothing. Returns what each request emits."""
        blocks, hidden_index, where = denoised_blocks(rows, step, out_rows)
        if not blocks:
            return {}
        block_size, mask_id = self.diffusion.block_size, self.diffusion.mask_token_id
        states = [self.requests[b.rows.req_id] for b in blocks]
        params = [s.sampling_params for s in states]
        context = RowContext.of([b.rows.canvas for b in blocks], states, where, mask_id)
        words = context.words
        requests = [b.rows.request for b in blocks]
        with_entropy = self.policy.wants_entropy(requests)
        masked = torch.stack([b.rows.canvas.masked(mask_id) for b in blocks])
        counts = [b.num_computed for b in blocks]
        grammar = GrammarStep(self.grammars, [r.grammar for r in requests],
                              [b.rows.req_id for b in blocks], masked)
        # The logits ([n, V]) are made and reduced a chunk of requests at a time; a
        # request whose grammar or proposals raise is failed alone (``errors``).
        errors: dict[int, tuple[str, Exception]] = {}
        grammar_rows = grammar.first_row_masks(where, counts) if grammar.active else None
        errors.update(grammar.take_errors("filling its grammar's mask"))
        raised: dict[int, Exception] = {}
        proposed = self.proposals.propose_from_hidden(
            self.model.compute_logits, hidden_states[hidden_index.to(self.device)],
            counts, params, [s.generator for s in states], context.output_index,
            context.seen_tokens, with_entropy, context.output_canvas, grammar_rows, raised)
        errors.update({i: ("proposing its tokens", err) for i, err in raised.items()})
        grid = scatter_to_host(proposed, where, len(blocks), block_size, mask_id,
                               [wants_logprobs(p) for p in params])
        proposals, full_confidence, computed = grid.tokens, grid.confidence, grid.computed
        rewrites = grid.ranked is not None  # the policy rewrites blocks (LLaDA2.2 editing)
        for i, position, code in unsatisfiable_blocks(grid.invalid, masked, computed,
                                                      rewrites):
            index = blocks[i].rows.canvas.start + position - len(states[i].prompt_token_ids)
            errors.setdefault(i, ("proposing its tokens", UnsatisfiableRequest(
                unsatisfiable_message(params[i], index, code))))
        self._fail_blocks(blocks, errors, failed)
        usable = computed & (grid.invalid == ROW_VALID)  # [R, B]: proposals to commit from
        if rewrites:
            return self._rewrite_blocks(blocks, states, proposals, full_confidence,
                                        grid.ranked, computed, failed)
        available = masked & usable
        if grammar.active:  # only a grammar-valid run from the leftmost undecided position
            grammar.constrain(proposals, full_confidence, available, usable, position_rules(
                [b.rows.canvas for b in blocks], states, context.output_canvas,
                [r.grammar is not None for r in requests]))
            self._fail_blocks(blocks, grammar.take_errors("walking its grammar"), failed)
        commit_inputs = (full_confidence, available)
        if with_entropy:
            commit_inputs = (*commit_inputs, grid.entropy)
        commits = self._ask_policy(self.policy.choose_commits, CommitBatch, requests,
                                   commit_inputs, failed, "choosing its commits")
        if grammar.active:
            grammar.include_first(commits)
        # The blocks after this step's commits and edits, for all requests at once.
        tokens_before = torch.stack([b.rows.canvas.tokens for b in blocks])
        tokens_after = torch.where(commits, proposals, tokens_before)
        filled = usable & torch.stack([b.rows.canvas.decoded_at >= 0 for b in blocks])
        edits = self._ask_policy(self.policy.choose_edits, EditBatch, requests,
                                 (full_confidence, proposals, tokens_before, filled), failed,
                                 "choosing its edits")
        if edits is not None:
            tokens_after = torch.where(edits, proposals, tokens_after)
        else:
            edits = torch.zeros_like(commits)
        for i, block_words in enumerate(words):
            if block_words:
                undo_completed_words(context.output_canvas[i], blocks[i].rows.canvas.start
                                     - len(states[i].prompt_token_ids), block_words,
                                     commits[i], edits[i], tokens_before[i], tokens_after[i],
                                     mask_id)
        if grammar.active:  # after the undo: the run from F holds no undone position
            grammar.restrict(commits)
            tokens_after = torch.where(commits | edits, proposals, tokens_before)
        decisions = StepDecisions(commits, edits, tokens_after, masked, computed,
                                  commits.sum(dim=1).tolist(), tokens_after.tolist(),
                                  (tokens_after != mask_id).all(dim=1).tolist(),
                                  edits.sum(dim=1).tolist(), (~masked.any(dim=1)).tolist())
        emitted: dict[str, EmittedTokens] = {}
        for i, (block, state) in enumerate(zip(blocks, states)):
            req_id = block.rows.req_id
            if req_id in failed:
                continue
            try:
                emitted[req_id] = self._unmask(
                    block, state, decisions, i,
                    None if grid.logprobs is None or not wants_logprobs(params[i])
                    else own_columns(grid.logprobs[i], asked_count(params[i])))
            except Exception as err:  # noqa: BLE001 - isolated to this request
                failed[req_id] = self._fail_request(req_id, "unmasking its block", err)
        return emitted

    def _fail_blocks(self, blocks: list[DenoisedBlock],
                     errors: dict[int, tuple[str, Exception]], failed: dict[str, str]) -> None:
        """Fail the requests of the step's blocks in ``errors`` (block -> (what it was
        doing, the exception)), each alone; the first failure of a request counts."""
        for i, (doing, err) in sorted(errors.items()):
            req_id = blocks[i].rows.req_id
            if req_id not in failed:
                failed[req_id] = self._fail_request(req_id, doing, err)

    def _ask_policy(self, method, batch_cls, requests: list[DiffusionRequest],
                    tensors: tuple[torch.Tensor, ...], failed: dict[str, str], doing: str):
        """``method(batch_cls(requests, *tensors))`` for all blocks at once ([R, B] bool or
        None); if it raises, each block is asked alone so that only the request it fails
        for is finished (its row is then all False)."""
        try:
            return method(batch_cls(requests, *tensors))
        except Exception:  # noqa: BLE001 - narrowed to the failing requests below
            rows = []
            for i, request in enumerate(requests):
                try:
                    row = method(batch_cls([request], *(t[i:i + 1] for t in tensors)))
                except Exception as err:  # noqa: BLE001 - isolated to this request
                    failed[request.req_id] = self._fail_request(request.req_id, doing, err)
                    row = None
                rows.append(torch.zeros(tensors[0][i].shape, dtype=torch.bool)
                            if row is None else row[0])
            return torch.stack(rows)

    def _rewrite_blocks(self, blocks: list[DenoisedBlock], states: list[Any],
                        proposals: torch.Tensor, confidence: torch.Tensor,
                        ranked: torch.Tensor, computed: torch.Tensor,
                        failed: dict[str, str]) -> dict[str, EmittedTokens]:
        """A step of blocks whose tokens may move (``policy.rewrite_block``): proposals and
        confidence [R, B], ranked [R, B, r], computed [R, B] (whole blocks)."""
        emitted: dict[str, EmittedTokens] = {}
        stats, mask_id = self.diffusion_stats, self.diffusion.mask_token_id
        for i, (block, state) in enumerate(zip(blocks, states)):
            req_id = block.rows.req_id
            if req_id in failed:
                continue
            try:
                request, canvas = block.rows.request, block.rows.canvas
                masked, old = canvas.masked(mask_id), canvas.tokens
                step = self.policy.rewrite_block(request, old, proposals[i], confidence[i],
                                                 ranked[i])
                canvas.commit(step.changed, step.tokens_written,
                              began_unmasked=not bool(masked.any()))
                canvas.rearrange(step.source, step.tokens)
                canvas.final_kv = step.ended and torch.equal(step.tokens, old)
                stats.tokens_deleted += step.deletions
                stats.tokens_split += step.splits
                emitted[req_id] = self._finish_step(
                    block, state, step.ended, masked, computed[i],
                    int((step.changed & masked).sum()),
                    int((step.changed & ~masked).sum()) + step.deletions + step.splits,
                    canvas.tokens.tolist())
            except Exception as err:  # noqa: BLE001 - isolated to this request
                failed[req_id] = self._fail_request(req_id, "rewriting its block", err)
        return emitted

    def _unmask(self, block: DenoisedBlock, state: Any, decisions: StepDecisions, i: int,
                logprobs: torch.Tensor | None) -> EmittedTokens:
        """Apply the commits and edits of block ``i`` of the step to its request and return
        its newly final tokens: the decoded run after its known tokens, or, when its tokens
        may still change (editing), the whole block once it ends. ``logprobs``: [B, C] the
        logprob columns of the block's positions this step (None: not asked for)."""
        request, canvas = block.rows.request, block.rows.canvas
        num_decoded = decisions.num_decoded[i]
        changed = decisions.commits[i] | decisions.edits[i]
        canvas.commit(changed, decisions.tokens_after[i],
                      began_unmasked=decisions.began_unmasked[i], logprobs=logprobs)
        block_done = (decisions.no_mask_left[i]
                      and self.policy.block_ends(request, decisions.num_edited[i] > 0,
                                                 decisions.began_unmasked[i]))
        canvas.final_kv = (block_done and not bool(changed.any())
                           and bool(decisions.computed[i].all()))
        return self._finish_step(block, state, block_done, decisions.masked[i],
                                 decisions.computed[i], num_decoded, decisions.num_edited[i],
                                 decisions.token_lists[i])

    def _finish_step(self, block: DenoisedBlock, state: Any, block_done: bool,
                     masked: torch.Tensor, computed: torch.Tensor, num_decoded: int,
                     num_edited: int, tokens: list[int]) -> EmittedTokens:
        """After a block's step (its canvas updated): tell the policy, emit the newly
        final tokens (``tokens``: the block now), count."""
        request, canvas = block.rows.request, block.rows.canvas
        self.policy.after_step(request, masked, computed, num_decoded)
        if block_done:
            self.policy.on_block_complete(request)
        num_known = len(state.prompt_token_ids) + len(state.output_token_ids)
        if not block_done and self.policy.edits_tokens(request):
            decoded = []  # its tokens may still change until the block ends
        else:
            decoded = emit_final_tokens(tokens, canvas.start, num_known,
                                        self.diffusion.mask_token_id)
        final = truncate_at_stop(decoded, state.sampling_params, len(state.output_token_ids))
        if request.wants_step_map:
            request.step_map.extend(decode_steps(canvas, num_known, len(final)))
        if request.grammar is not None:
            advance(self.grammars, request.grammar, request.req_id, final)
        state.output_token_ids.extend(final)
        stats = self.diffusion_stats
        stats.denoising_steps += 1
        stats.block_positions_computed += len(block.rows.block_positions)
        stats.block_positions_after_eviction += block.num_computed
        stats.tokens_committed += len(final)
        stats.blocks_completed += int(block_done)
        stats.tokens_edited += num_edited
        canvas.edits += num_edited
        stats.edited_blocks_completed += int(block_done and canvas.edits > 0)
        count_progress(request, bool(num_decoded or num_edited or block_done),
                       self.diffusion.max_steps_without_progress)
        offset = num_known - canvas.start
        return EmittedTokens(
            final,
            None if canvas.logprobs is None else canvas.logprobs[offset:offset + len(final)],
            list(request.step_map) if request.wants_step_map else None)

    def diffusion_stats_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.diffusion_stats), **self.policy.counters()}
