"""Scheduler for block-diffusion requests: one engine step = one denoising step. Every
step schedules a request's committed prefix's end through its current block's end (the
block's undecided positions as placeholder spec tokens), or, under full attention, its
whole sequence. See docs/architecture.md, "Scheduler".
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_diffusion.config import STEP_MAP_KEY, engine_config_from_vllm
from vllm_diffusion.metrics import encode_counters
from vllm_diffusion.step.failures import Failure, UncompilableGrammar
from vllm_diffusion.worker.geometry import CanvasGeometry, step_geometry
from vllm_diffusion.worker.outputs import require_diffusion_output

logger = init_logger(__name__)


def attach_step_maps(outputs: dict[int, Any], step_maps: dict[str, list[int]]) -> None:
    """Put each asking request's step map so far into its output's
    ``kv_transfer_params["diffusion_step_map"]`` (the one free-form per-request field vLLM
    carries); every output carries the whole map, so the one that ends the request (also
    at a stop string) has it all."""
    if not step_maps:
        return
    for engine_outputs in outputs.values():
        for output in engine_outputs.outputs:
            steps = step_maps.get(output.request_id)
            if steps is not None:
                output.kv_transfer_params = {**(output.kv_transfer_params or {}),
                                             STEP_MAP_KEY: steps}


class BlockDiffusionScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = engine_config_from_vllm(self.vllm_config)
        self.diffusion_block_size = block = config.block_size
        self.geometry = step_geometry(config.model.attention, block, config.canvas_tokens,
                                      self.max_model_len, config.cache_mode)
        self.mask_token_id = config.mask_token_id
        # No token is sampled "after" the scheduled ones; a new request's first step reaches
        # up to B positions past its prompt (the canvas's reach under full attention).
        self.num_sampled_tokens_per_step = 0
        self._step_stats: SpecDecodingStats | None = None
        if isinstance(self.geometry, CanvasGeometry):
            if self.max_num_scheduled_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_scheduled_tokens}) must be at "
                    f"least max_model_len ({self.max_model_len}): a full-attention step "
                    f"computes a request's whole sequence")
            self.num_lookahead_tokens = config.canvas_tokens
            return
        if self.block_size % block:
            raise ValueError(
                f"the KV page size (--block-size {self.block_size}) must be a multiple of "
                f"the diffusion block size ({block}): a page's KV is final only once its "
                f"last diffusion block is committed")
        needed = 2 * block * self.scheduler_config.max_num_seqs
        if self.max_num_scheduled_tokens < needed:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_scheduled_tokens}) must be at "
                f"least 2 * diffusion block size * max_num_seqs = {needed}: a step can "
                f"commit one block and denoise the next for every running request")
        self.num_lookahead_tokens = block

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        for request in self.running:
            step_end = self.geometry.step_end(request.num_prompt_tokens, request.num_tokens,
                                              request.max_tokens)
            request.spec_token_ids = [self.mask_token_id] * max(step_end - request.num_tokens, 0)
        output = super().schedule(throttle_prefills)
        # The placeholders only sized the step; the runner owns the block's contents.
        output.scheduled_spec_decode_tokens.clear()
        for request in self.running:
            request.spec_token_ids = []
        return output

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """No core bitmask: the runner keeps its own matchers (``worker/grammar.py``;
        docs/architecture.md, "Scheduler"). The core's acceptance check stays on."""
        return None

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any):
        runner_output = require_diffusion_output(model_runner_output)
        self._step_stats = encode_counters(runner_output.counters)
        # Finished before the stock bookkeeping, which then skips them (as it skips
        # requests aborted during the step); their error outputs are added after it.
        failed = {**self._take_uncompiled_grammars(), **runner_output.failed_requests}
        errored = self._finish_failed(failed)
        outputs = super().update_from_output(scheduler_output, runner_output)
        for request in errored:
            client_outputs = outputs.setdefault(request.client_index, EngineCoreOutputs())
            client_outputs.outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                stop_reason=failed[request.request_id],
                events=request.take_events(), trace_headers=request.trace_headers))
        attach_step_maps(outputs, runner_output.step_maps)
        for req_id, committed in runner_output.committed_prefix.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.num_computed_tokens > 0:  # 0 after a preemption in this step
                request.num_computed_tokens = committed
        return outputs

    def _take_uncompiled_grammars(self) -> dict[str, str]:
        """The requests in ``grammar_compile_error_reqs`` (vLLM would end them with a bare
        HTTP 500), each with its ``stop_reason``: a client error naming the grammar's kind
        and the backend's reason (``UncompilableGrammar``)."""
        failed = {}
        for req_id in self.grammar_compile_error_reqs:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():  # aborted meanwhile
                continue
            grammar_request = request.structured_output_request
            kind, _ = grammar_request.structured_output_key
            failure = Failure.of(UncompilableGrammar(kind, grammar_request.grammar),
                                 "compiling its grammar")
            failed[req_id] = failure.as_stop_reason()
        self.grammar_compile_error_reqs.clear()
        return failed

    def _finish_failed(self, failed: dict[str, str]) -> list[Any]:
        """Finish the requests whose step work failed in the runner (req_id -> its
        ``stop_reason``); their KV pages are freed here."""
        if not failed:
            return []
        for req_id, why in failed.items():
            logger.error("vllm-diffusion: request %s finished with an error: %s", req_id, why)
        return self.finish_requests(failed, RequestStatus.FINISHED_ERROR)

    def make_stats(self, spec_decoding_stats: SpecDecodingStats | None = None, *args: Any,
                   **kwargs: Any):
        step_stats, self._step_stats = self._step_stats, None
        return super().make_stats(step_stats or spec_decoding_stats, *args, **kwargs)
