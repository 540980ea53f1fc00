"""The diffusion model runner: one ``execute_model`` call is one denoising step
(prepare -> forward -> propose -> decide -> emit). ``DiffusionRunnerMixin`` overrides only
``execute_model`` of vLLM's V1 model runner; see docs/architecture.md, "Runner".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_diffusion.config import engine_config_from_vllm, wants_step_map
from vllm_diffusion.metrics import StepCounters
from vllm_diffusion.step.failures import UnsatisfiableRequest
from vllm_diffusion.step.hooks import ForwardStep
from vllm_diffusion.step.request import DiffusionRequest, OutputBounds
from vllm_diffusion.step.slots import BlockSlots, slot_index
from vllm_diffusion.worker.block_updates import BlockUpdates, ProposedBlocks
from vllm_diffusion.worker.constraints import unsatisfiable_blocks, unsatisfiable_message
from vllm_diffusion.worker.forward import ModelForward
from vllm_diffusion.worker.canvas_plan import row_planner
from vllm_diffusion.worker.geometry import step_geometry
from vllm_diffusion.worker.grammar import GrammarCompiler, GrammarStep
from vllm_diffusion.worker.logprobs import to_vllm_lists, wants_logprobs
from vllm_diffusion.worker.outputs import (DiffusionRunnerOutput, DiffusionStats,
                                           EmittedTokens, empty_output)
from vllm_diffusion.worker.proposal import ProposalPipeline, chunk_rows
from vllm_diffusion.worker.proposal_grid import scatter_to_host
from vllm_diffusion.worker.row_context import RowContext
from vllm_diffusion.worker.sampling import argmax_params
from vllm_diffusion.worker.failure_isolation import StepFailures
from vllm_diffusion.worker.step_plan import (KnownTokens, RequestRows, denoised_blocks,
                                             gather_step, stop_tokens)


class DiffusionRunnerMixin:
    """Mixed into vLLM's ``GPUModelRunner`` / ``CPUModelRunner``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.diffusion = engine_config_from_vllm(self.vllm_config)
        # what a step computes under the model's attention regime (``geometry.py``)
        self.planner = row_planner(step_geometry(
            self.diffusion.model.attention, self.diffusion.block_size,
            self.diffusion.canvas_tokens, self.vllm_config.model_config.max_model_len,
            self.diffusion.cache_mode),
            self.diffusion.mask_token_id, self.diffusion.model)
        self.policy = self.diffusion.make_policy()
        hf_config = self.vllm_config.model_config.hf_config
        self.policy.bind(self.diffusion.model, hf_config,
                         bool(self.cache_config.enable_prefix_caching))
        self.proposals = ProposalPipeline(
            self.diffusion.mask_token_id, self.policy.confidence_rule,
            chunk_rows(self.diffusion.logits_memory_mib,
                       self.vllm_config.model_config.get_vocab_size()),
            self.vllm_config.model_config.logprobs_mode,
            ranked=self.policy.proposal_ranks)
        self.diffusion_requests: dict[str, DiffusionRequest] = {}
        # every live request's current block, one row per slot (grown past max_num_seqs
        # when preempted requests hold slots too)
        self.block_slots = BlockSlots(self.diffusion.block_size,
                                      self.scheduler_config.max_num_seqs)
        self.diffusion_stats = DiffusionStats()
        self.grammars = GrammarCompiler(self.vllm_config, self.diffusion_stats)
        self.model_forward: ModelForward | None = None  # built at the first step
        self.updates = BlockUpdates(self.diffusion.mask_token_id,
                                    self.diffusion.max_steps_without_progress,
                                    self.diffusion_stats, self.grammars)

    def worst_logits_chunk(self) -> list[int]:
        """Rows per request of the largest chunk of logits a step can make at once (whole
        blocks, as many as the logits budget holds, at least one)."""
        block = self.diffusion.block_size
        requests = self.scheduler_config.max_num_seqs
        if self.proposals.max_rows is not None:
            requests = min(requests, max(1, self.proposals.max_rows // block))
        return [block] * requests

    def _dummy_sampler_run(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's profiling run ends with its sampler on one row per request; a diffusion
        step's largest chunk of logits goes through the sampled path instead, so that the
        peak memory vLLM measures at start-up (kept free of KV cache on CUDA) covers it."""
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
        for req_id in scheduler_output.finished_req_ids:  # finished or aborted
            self._forget(req_id)
        if not scheduler_output.total_num_scheduled_tokens:
            return empty_output()
        req_ids = [r for r in self.input_batch.req_ids if r is not None]
        failures = StepFailures(self.diffusion_stats, self._forget)
        stats = self.diffusion_stats
        before = dataclasses.replace(stats)
        rows = self._prepare(req_ids, scheduler_output, failures)
        emitted: dict[str, EmittedTokens] = {}
        layer_rows: list[int] = []
        chunk = None  # the chunk size the policy chose for the step, where it chooses one
        computed = [r for r in rows if r.positions]  # a part-scheduled sequence waits
        if computed:
            step = gather_step(computed, self.device)
            if self.model_forward is None:  # the KV cache is configured by now
                self.model_forward = ModelForward(self.vllm_config, self.kv_cache_config,
                                                self.device, self.diffusion,
                                                self.diffusion_stats)
            hidden_states, out_rows, layer_rows = self.model_forward.run(
                self.model, computed, step, self.policy.forward_hooks(step),
                [self.requests[r.req_id].block_ids[0] for r in computed])
            proposed = self._propose(computed, step, hidden_states, out_rows, failures)
            if proposed is not None:
                changes = self.updates.decide(proposed, self.policy, failures)
                emitted = self.updates.apply(proposed, changes, self.policy, failures)
                chunk = changes.decision.chunk
        stats.engine_steps += 1
        return self._output(req_ids, rows, emitted, layer_rows, before, failures, chunk)

    def _prepare(self, req_ids: list[str], scheduler_output: Any,
                 failures: StepFailures) -> list[RequestRows]:
        """Each scheduled request's diffusion state and its rows as its policy plans them."""
        scheduled = []
        for req_id in req_ids:
            with failures.isolated(req_id, "reading its options"):
                scheduled.append(self._request_state(req_id))
        self.policy.begin_step(scheduled)
        rows = []
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        for request in scheduled:
            req_id = request.req_id
            state = self.requests[req_id]
            with failures.isolated(req_id, "planning its step"):
                rows.append(self.planner.plan(
                    req_id, KnownTokens(state.prompt_token_ids, state.output_token_ids),
                    state.num_computed_tokens, scheduler_output.num_scheduled_tokens[req_id],
                    request, self.policy, req_id in resumed, state.sampling_params.max_tokens))
        return rows

    def _request_state(self, req_id: str) -> DiffusionRequest:
        """The request's diffusion state, made at its first step."""
        request = self.diffusion_requests.get(req_id)
        if request is None:
            state = self.requests[req_id]
            params = state.sampling_params
            config = self.diffusion.request_policy_config(params.extra_args)
            bounds = OutputBounds(stop_tokens(params), None if params.max_tokens is None
                                  else len(state.prompt_token_ids) + params.max_tokens)
            grammar = self.grammars.compile(params)
            request = DiffusionRequest(req_id, config, self.policy.new_state(config),
                                       wants_step_map(params.extra_args), bounds=bounds,
                                       grammar=grammar, keep_all_rows=grammar is not None,
                                       block_slots=self.block_slots,
                                       slot=self.block_slots.acquire())
            self.diffusion_requests[req_id] = request
        return request

    def _forget(self, req_id: str) -> None:
        """Drop a request's diffusion state, give its slot back (finished, failed, aborted)."""
        request = self.diffusion_requests.pop(req_id, None)
        if request is not None:
            self.block_slots.release(request.slot)

    def _propose(self, rows: list[RequestRows], step: ForwardStep, hidden_states: torch.Tensor,
                 out_rows: torch.Tensor, failures: StepFailures) -> ProposedBlocks | None:
        """Proposals for every computed position of the step's blocks ([R, B] grids on the
        host); a request whose grammar or proposals raise, or that is unsatisfiable, fails."""
        blocks, counts, hidden_index, where = denoised_blocks(rows, step, out_rows)
        if not blocks:
            return None
        mask_id = self.diffusion.mask_token_id
        states = [self.requests[b.req_id] for b in blocks]
        params = [argmax_params(s.sampling_params) if b.argmax_proposals
                  else s.sampling_params for b, s in zip(blocks, states)]
        context = RowContext.of([b.canvas for b in blocks], states, where, mask_id)
        requests = [b.request for b in blocks]
        with_entropy = any(r.policy_config.needs_entropy for r in requests)
        slots = slot_index(requests)  # [R]
        tokens = self.block_slots.tokens[slots]  # [R, B] the blocks before the step
        masked = tokens == mask_id
        grammar = GrammarStep(self.grammars, [r.grammar for r in requests],
                              [b.req_id for b in blocks], masked)
        # The logits ([n, V]) are made and reduced a chunk of requests at a time.
        errors: dict[int, tuple[str, Exception]] = {}
        grammar_rows = grammar.first_row_masks(where, counts) if grammar.active else None
        errors.update(grammar.take_errors("filling its grammar's mask"))
        raised: dict[int, Exception] = {}
        proposed = self.proposals.propose_from_hidden(
            self.model.compute_logits, hidden_states[hidden_index.to(self.device)],
            counts, params, [s.generator for s in states], context.output_index,
            context.seen_tokens, with_entropy, context.output_canvas, grammar_rows, raised)
        errors.update({i: ("proposing its tokens", err) for i, err in raised.items()})
        grid = scatter_to_host(proposed, where, len(blocks), self.diffusion.block_size,
                               mask_id, [wants_logprobs(p) for p in params])
        for i, position, code in unsatisfiable_blocks(grid.invalid, masked, grid.computed,
                                                      grid.ranked is not None):
            index = blocks[i].canvas.start + position - len(states[i].prompt_token_ids)
            errors.setdefault(i, ("proposing its tokens", UnsatisfiableRequest(
                unsatisfiable_message(params[i], index, code))))
        failures.fail_each([b.req_id for b in blocks], errors)
        return ProposedBlocks(blocks, counts, states, context, grammar, grid, tokens, masked,
                              self.block_slots.decoded_at[slots] >= 0, with_entropy)

    def _output(self, req_ids: list[str], rows: list[RequestRows],
                emitted: dict[str, EmittedTokens], layer_rows: list[int],
                before: DiffusionStats, failures: StepFailures,
                chunk: int | None) -> DiffusionRunnerOutput:
        """The step's output: each request's newly final tokens, and this step's counts
        (the counters' change since ``before``)."""
        stats, failed = self.diffusion_stats, failures.reasons
        tokens_by_request = [emitted[r].tokens if r in emitted else [] for r in req_ids]
        deleted = stats.tokens_deleted - before.tokens_deleted
        split = stats.tokens_split - before.tokens_split
        return DiffusionRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=tokens_by_request,
            logprobs=to_vllm_lists([emitted[r].logprobs if r in emitted else None
                                    for r in req_ids], tokens_by_request),
            counters=StepCounters(
                denoised_blocks=sum(r.request is not None and r.req_id not in failed
                                    for r in rows),
                block_positions=stats.block_positions_computed
                - before.block_positions_computed,
                positions_after_eviction=stats.block_positions_after_eviction
                - before.block_positions_after_eviction,
                committed_tokens=sum(len(t) for t in tokens_by_request),
                layer_positions=tuple(layer_rows),
                matcher_fills=stats.grammar_fills - before.grammar_fills,
                matcher_accepts=stats.grammar_accepts - before.grammar_accepts,
                chosen_chunk=chunk or 0,
                token_edits=(stats.tokens_edited - before.tokens_edited - deleted - split,
                             deleted, split)),
            committed_prefix={r.req_id: r.committed for r in rows if r.req_id not in failed},
            step_maps={r: e.step_map for r, e in emitted.items() if e.step_map is not None},
            failed_requests=failed,
        )

    def diffusion_stats_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.diffusion_stats), **self.policy.counters()}
