"""The diffusion model runner: one ``execute_model`` call is one denoising step.

``DiffusionRunnerMixin`` overrides only ``execute_model`` of vLLM's V1 model runner. It
keeps vLLM's request bookkeeping (``_update_states``: new, resumed and finished requests,
KV block tables), its model, KV cache and forward context, and replaces the autoregressive
input preparation and sampling with the block-diffusion step: build the rows of every
request (``step_plan``), run the model once over all of them with block-causal attention
(FOCUS steps evict after layer 1), propose tokens for the surviving block rows, let the
policy choose which to commit, and return the newly final tokens as this step's output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm.forward_context import set_forward_context
from vllm.sampling_params import SamplingType
from vllm.logger import init_logger

from vllm_diffusion.attention.backend import BlockDiffusionMetadata
from vllm_diffusion.attention.eviction import EvictionStep
from vllm_diffusion.attention.importance import ImportanceProbe
from vllm_diffusion.config import engine_config_from_vllm, wants_step_map
from vllm_diffusion.policies.focus import FocusPolicy, FocusRequestState
from vllm_diffusion.worker.focus_step import candidate_rows, eviction_step, hidden_rows
from vllm_diffusion.worker.outputs import DiffusionRunnerOutput, empty_output
from vllm_diffusion.worker.sampling import propose_tokens
from vllm_diffusion.worker.step_plan import (
    BlockCanvas,
    RequestRows,
    decode_steps,
    emit_final_tokens,
    plan_request,
)

logger = init_logger(__name__)


@dataclasses.dataclass
class DiffusionStats:
    """Counters since start-up (hardware-independent measures of the work done)."""

    engine_steps: int = 0
    denoising_steps: int = 0  # block-steps: one per request per step with a block
    positions_computed: int = 0  # model rows, prefill and commit rows included
    block_positions_computed: int = 0  # block rows through layers 0-1
    block_positions_after_eviction: int = 0  # block rows through the last layers
    tokens_committed: int = 0  # final tokens emitted
    blocks_completed: int = 0


def truncate_at_stop(tokens: list[int], params: Any, num_output: int) -> list[int]:
    """Cut newly final tokens after a stop token or at max_tokens (as vLLM's stop check)."""
    stops = set(params.stop_token_ids or ())
    if params.eos_token_id is not None:
        stops.add(params.eos_token_id)
    tokens = tokens[:max(params.max_tokens - num_output, 0)]
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i + 1]
    return tokens


class DiffusionRunnerMixin:
    """Mixed into vLLM's ``GPUModelRunner`` / ``CPUModelRunner``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.diffusion = engine_config_from_vllm(self.vllm_config)
        self.focus = self.diffusion.policy is FocusPolicy
        self.block_canvases: dict[str, BlockCanvas] = {}
        self.focus_states: dict[str, FocusRequestState] = {}
        self.diffusion_stats = DiffusionStats()
        # When a list: one entry per (request, step) with the absolute position, importance
        # delta, raw layer-1 importance and decoded flag of every masked position (the
        # decodability study).
        self.importance_records: list[dict[str, list]] | None = None

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None):
        self._update_states(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self._drop_request_state(req_id)
        if not scheduler_output.total_num_scheduled_tokens:
            return empty_output()

        req_ids = [r for r in self.input_batch.req_ids if r is not None]
        # Host-side policy work of one request (planning here, unmasking after the
        # forward) that fails finishes only that request, with an error.
        failed: dict[str, str] = {}
        rows = []
        for req_id in req_ids:
            try:
                rows.append(self._plan(req_id, scheduler_output))
            except Exception as err:  # noqa: BLE001 - isolated to this request
                failed[req_id] = self._fail_request(req_id, "planning its step", err)
        stats = self.diffusion_stats
        before = (stats.block_positions_computed, stats.block_positions_after_eviction)
        sampled_by_id: dict[str, list[int]] = {}
        step_maps: dict[str, list[int]] = {}
        if rows:
            mask_id, device = self.diffusion.mask_token_id, self.device
            eviction = (eviction_step(rows, self.focus_states, mask_id,
                                      self.diffusion.block_size, device)
                        if self.focus else None)
            probe = eviction.probe if eviction is not None else (
                ImportanceProbe(candidate_rows(rows, mask_id, device))
                if self.importance_records is not None else None)
            hidden_states = self._forward(rows, probe, eviction)
            sampled, step_maps = self._denoise(rows, hidden_states, probe, eviction, failed)
            sampled_by_id = {r.req_id: tokens for r, tokens in zip(rows, sampled)}
        stats.engine_steps += 1
        return DiffusionRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled_by_id.get(r, []) for r in req_ids],
            block_positions=(stats.block_positions_computed - before[0],
                             stats.block_positions_after_eviction - before[1]),
            step_maps=step_maps,
            failed_requests=failed,
        )

    def _drop_request_state(self, req_id: str) -> None:
        self.block_canvases.pop(req_id, None)
        self.focus_states.pop(req_id, None)

    def _fail_request(self, req_id: str, doing: str, err: Exception) -> str:
        """Forget a request whose policy work raised; the scheduler finishes it."""
        logger.exception("vllm-diffusion: request %s failed while %s; finishing it with "
                         "an error (other requests continue)", req_id, doing)
        self._drop_request_state(req_id)
        return f"{type(err).__name__} while {doing}: {err}"

    def _plan(self, req_id: str, scheduler_output: Any) -> RequestRows:
        state = self.requests[req_id]
        canvas = self.block_canvases.get(req_id)
        policy_config = (canvas.policy_config if canvas is not None else
                         self.diffusion.request_policy_config(
                             state.sampling_params.extra_args))
        processing = commit_positions = None
        if self.focus:
            focus_state = self.focus_states.setdefault(
                req_id, FocusRequestState(self.diffusion.block_size))
            commit_positions = focus_state.commit_positions(
                state.num_computed_tokens, policy_config)

            def processing(block: BlockCanvas) -> torch.Tensor:
                # Recomputing the committed prefix (a resumed preemption) means the block's
                # KV pages were freed: its frozen positions must be computed again.
                focus_state.start_block(block.start,
                                        kv_lost=state.num_computed_tokens < block.start)
                return focus_state.processing_set(block.policy_config)

        plan = plan_request(
            req_id, list(state.prompt_token_ids) + state.output_token_ids,
            state.num_computed_tokens, scheduler_output.num_scheduled_tokens[req_id],
            self.diffusion.block_size, self.diffusion.mask_token_id, canvas, policy_config,
            processing, commit_positions)
        if plan.canvas is not None:
            self.block_canvases[req_id] = plan.canvas
        return plan

    def _forward(self, rows: list[RequestRows], probe: ImportanceProbe | None,
                 eviction: EvictionStep | None) -> torch.Tensor:
        device = self.device
        page_size = self.cache_config.block_size
        positions = torch.tensor([p for r in rows for p in r.positions], dtype=torch.long)
        token_ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.long)
        page_tables = [torch.tensor(self.requests[r.req_id].block_ids[0], dtype=torch.long)
                       for r in rows]
        slots = torch.cat([table[torch.tensor(r.positions, dtype=torch.long) // page_size]
                           * page_size + torch.tensor(r.positions, dtype=torch.long) % page_size
                           for r, table in zip(rows, page_tables)])
        query_start_loc = [0]
        for r in rows:
            query_start_loc.append(query_start_loc[-1] + len(r.positions))
        metadata = BlockDiffusionMetadata(
            num_actual_tokens=len(positions),
            query_positions=positions.to(device),
            slot_mapping=slots.to(device),
            block_table=torch.nn.utils.rnn.pad_sequence(page_tables, batch_first=True)
            .to(device),
            query_start_loc=query_start_loc,
            kv_lens=[r.kv_len for r in rows],
            diffusion_block_size=self.diffusion.block_size,
            importance=probe,
            eviction=eviction,
        )
        layer_names = [name for group in self.kv_cache_config.kv_cache_groups
                       for name in group.layer_names]
        with set_forward_context({name: metadata for name in layer_names},
                                 self.vllm_config, num_tokens=len(positions),
                                 slot_mapping={}):
            hidden_states = self.model(input_ids=token_ids.to(device),
                                       positions=positions.to(device))
        self.diffusion_stats.positions_computed += len(positions)
        return hidden_states

    def _denoise(self, rows: list[RequestRows], hidden_states: torch.Tensor,
                 probe: ImportanceProbe | None, eviction: EvictionStep | None,
                 failed: dict[str, str]) -> tuple[list[list[int]], dict[str, list[int]]]:
        """Unmask each request's block from its rows' logits; a request whose unmasking
        raises is recorded in ``failed`` and outputs nothing."""
        mask_id = self.diffusion.mask_token_id
        num_rows = sum(len(r.positions) for r in rows)
        surviving, out_rows = hidden_rows(rows, eviction, num_rows)
        if not len(out_rows):
            return [[] for _ in rows], {}
        logits = self.model.compute_logits(hidden_states[out_rows.to(self.device)])
        # Greedy requests' proposals for all rows at once; sampled requests per request.
        greedy_tokens, greedy_confidence = (
            t.cpu() for t in propose_tokens(logits, mask_id, 0.0, 0, 1.0, None))
        sampled: list[list[int]] = []
        step_maps: dict[str, list[int]] = {}
        offset = 0
        for request_index, (r, positions) in enumerate(zip(rows, surviving)):
            if positions is None:
                sampled.append([])
                continue
            rows_of_request = slice(offset, offset + len(positions))
            offset += len(positions)
            try:
                final, step_map = self._unmask(request_index, r, positions,
                                               logits[rows_of_request],
                                               greedy_tokens[rows_of_request],
                                               greedy_confidence[rows_of_request], probe)
            except Exception as err:  # noqa: BLE001 - isolated to this request
                failed[r.req_id] = self._fail_request(r.req_id, "unmasking its block", err)
                sampled.append([])
                continue
            if step_map is not None:
                step_maps[r.req_id] = step_map
            sampled.append(final)
        return sampled, step_maps

    def _unmask(self, request_index: int, r: RequestRows, positions: torch.Tensor,
                logits: torch.Tensor, greedy_tokens: torch.Tensor,
                greedy_confidence: torch.Tensor,
                probe: ImportanceProbe | None) -> tuple[list[int], list[int] | None]:
        """One request's unmasking for this step. positions: [n] surviving block positions,
        logits / greedy_tokens / greedy_confidence: their [n, V] / [n] / [n] rows.
        Returns the newly final tokens and, if asked for, their decode steps."""
        block, mask_id = self.diffusion.block_size, self.diffusion.mask_token_id
        state = self.requests[r.req_id]
        params = state.sampling_params
        if params.sampling_type == SamplingType.GREEDY:
            tokens, confidence = greedy_tokens, greedy_confidence
        else:
            tokens, confidence = propose_tokens(logits, mask_id, params.temperature,
                                                params.top_k, params.top_p, state.generator)
        canvas = r.canvas
        masked = canvas.tokens == mask_id
        eligible = torch.zeros(block, dtype=torch.bool)
        eligible[positions] = True
        full_confidence = torch.full((block,), float("-inf"))
        full_confidence[positions] = confidence.cpu()
        proposals = torch.full((block,), mask_id, dtype=torch.long)
        proposals[positions] = tokens.cpu()
        commit = self.diffusion.policy.choose_commits(
            full_confidence, masked & eligible, canvas.steps, block, canvas.policy_config)
        if probe is not None and self.importance_records is not None:
            self._record_importance(probe, request_index, r, masked, commit)
        canvas.commit(commit, proposals)
        if self.focus:
            self.focus_states[r.req_id].after_step(masked, eligible, int(commit.sum()))
        num_known = len(state.prompt_token_ids) + len(state.output_token_ids)
        final = truncate_at_stop(emit_final_tokens(canvas, num_known, mask_id),
                                 params, len(state.output_token_ids))
        step_map = (decode_steps(canvas, num_known, len(final))
                    if wants_step_map(params.extra_args) else None)
        state.output_token_ids.extend(final)
        stats = self.diffusion_stats
        stats.denoising_steps += 1
        stats.block_positions_computed += len(r.block_positions)
        stats.block_positions_after_eviction += len(positions)
        stats.tokens_committed += len(final)
        stats.blocks_completed += int(not bool((canvas.tokens == mask_id).any()))
        return final, step_map

    def _record_importance(self, probe: ImportanceProbe, request_index: int, r: RequestRows,
                           masked: torch.Tensor, commit: torch.Tensor) -> None:
        scores = probe.delta(request_index)
        if scores is None:
            return
        delta, layer1 = scores
        self.importance_records.append({
            "req_id": r.req_id,
            "positions": (r.canvas.start + torch.nonzero(masked).flatten()).tolist(),
            "delta": delta.tolist(), "layer1": layer1.tolist(),
            "decoded": commit[masked].tolist()})

    def diffusion_stats_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self.diffusion_stats)
