"""Scheduler for block-diffusion requests: one engine step = one denoising step.

State of a request, as the scheduler sees it (B = diffusion block size):

- ``request.num_tokens`` (F): prompt plus the output tokens emitted so far. Emitted tokens
  are final (a decoded token never changes), but the KV of the block holding them is not.
- the current block is ``[F // B * B, F // B * B + B)``: the runner computes it each step.
- ``num_computed_tokens`` (C): the committed prefix, whose KV is exact. It is always a
  multiple of B and at most the current block's start; between steps it is rolled back
  to the block start, so every step schedules ``[C, block end)``.

Each step therefore schedules, per running request, the commit of any block that was
completed at the previous step (the prefill of ``[C, block start)``) fused with one
denoising step of the current block. To make vLLM's scheduler ask for exactly that, the
block's undecided positions are presented as placeholder "spec" tokens (and dropped from
the output before the runner sees them: there are no drafts to verify). A new request's
first step is its prompt's full blocks fused with the first denoising step of the block
holding the prompt tail; ``num_lookahead_tokens = B`` makes vLLM allocate KV pages for it.
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
from vllm_diffusion.worker.outputs import DiffusionRunnerOutput, require_diffusion_output

logger = init_logger(__name__)


def committed_after_step(num_computed: int, num_scheduled: int, num_tokens: int,
                         block_size: int) -> int:
    """Committed prefix once a step scheduled ``[num_computed, num_computed + num_scheduled)``.

    If the step reaches the request's known tokens, everything before the current block is
    committed; a partial prefill chunk commits its whole blocks only.
    """
    end = num_computed + num_scheduled
    if end >= num_tokens:
        return num_tokens // block_size * block_size
    return end // block_size * block_size


def attach_step_maps(outputs: dict[int, Any], requests: dict[str, Any]) -> None:
    """Put each asking request's step map so far (one entry per output token) into its
    output's ``kv_transfer_params["diffusion_step_map"]``, the one free-form per-request
    field vLLM carries from the engine to the response. The whole map rides on every
    output, so the one that ends the request (also at a stop string) carries it all."""
    if not requests:
        return
    for engine_outputs in outputs.values():
        for output in engine_outputs.outputs:
            request = requests.get(output.request_id)
            if request is None:
                continue
            steps = getattr(request, STEP_MAP_KEY)[:request.num_output_tokens]
            output.kv_transfer_params = {**(output.kv_transfer_params or {}),
                                         STEP_MAP_KEY: steps}


class BlockDiffusionScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = engine_config_from_vllm(self.vllm_config)
        self.diffusion_block_size = block = config.block_size
        self.mask_token_id = config.mask_token_id
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
        # No token is sampled "after" the scheduled ones, and the first block of a new
        # request reaches up to B positions past its prompt.
        self.num_sampled_tokens_per_step = 0
        self.num_lookahead_tokens = block
        self._committed: dict[str, int] = {}
        self._denoised: set[str] = set()  # requests whose block is denoised this step
        self._step_stats: SpecDecodingStats | None = None

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        block = self.diffusion_block_size
        # Per-step entries: cleared here, so a step whose execution raised (and never
        # reached update_from_output) leaves nothing behind.
        self._committed.clear()
        self._denoised.clear()
        for request in self.running:
            block_end = request.num_tokens // block * block + block
            request.spec_token_ids = [self.mask_token_id] * (block_end - request.num_tokens)
        output = super().schedule(throttle_prefills)
        for req_id, num_scheduled in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            num_computed = request.num_computed_tokens - num_scheduled
            self._committed[req_id] = committed_after_step(
                num_computed, num_scheduled, request.num_tokens, block)
            if num_computed + num_scheduled >= request.num_tokens:
                self._denoised.add(req_id)
        # The placeholders only sized the step; the runner owns the block's contents.
        output.scheduled_spec_decode_tokens.clear()
        for request in self.running:
            request.spec_token_ids = []
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any):
        runner_output = require_diffusion_output(model_runner_output)
        self._step_stats = self._diffusion_step_stats(scheduler_output, runner_output)
        step_map_requests = self._extend_step_maps(runner_output)
        # Finished before the stock bookkeeping, which then skips them (as it skips
        # requests aborted during the step); their error outputs are added after it.
        errored = self._finish_failed(runner_output.failed_requests)
        outputs = super().update_from_output(scheduler_output, runner_output)
        for request in errored:
            client_outputs = outputs.setdefault(request.client_index, EngineCoreOutputs())
            client_outputs.outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[],
                finish_reason=request.get_finished_reason(), events=request.take_events(),
                trace_headers=request.trace_headers))
        attach_step_maps(outputs, step_map_requests)
        for req_id in scheduler_output.num_scheduled_tokens:
            committed = self._committed.pop(req_id, None)
            request = self.requests.get(req_id)
            if committed is None or request is None or request.is_finished():
                continue
            if request.num_computed_tokens > 0:  # 0 after a preemption in this step
                request.num_computed_tokens = committed
        return outputs

    def _finish_failed(self, failed: dict[str, str]) -> list[Any]:
        """Finish the requests whose policy work failed in the runner: their KV pages are
        freed here and the runner forgets them at the next step."""
        if not failed:
            return []
        for req_id, why in failed.items():
            logger.error("vllm-diffusion: request %s finished with an error: %s", req_id, why)
        return self.finish_requests(failed, RequestStatus.FINISHED_ERROR)

    def _extend_step_maps(self, runner_output: DiffusionRunnerOutput) -> dict[str, Any]:
        """Append this step's decode steps to the requests that asked for a step map."""
        requests = {}
        for req_id, steps in runner_output.step_maps.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            if not hasattr(request, STEP_MAP_KEY):
                setattr(request, STEP_MAP_KEY, [])
            getattr(request, STEP_MAP_KEY).extend(steps)
            requests[req_id] = request
        return requests

    def _diffusion_step_stats(self, scheduler_output: SchedulerOutput,
                              runner_output: DiffusionRunnerOutput) -> SpecDecodingStats:
        """This step's work, in the counters vLLM reports for diffusion models:
        denoising steps (one per denoised block), canvas positions evaluated (block
        positions through layers 0-1), and committed (final) tokens; the positions that
        reach the later layers (fewer when a policy evicts) ride in the per-position list.
        """
        denoised = [r for r in scheduler_output.num_scheduled_tokens if r in self._denoised]
        committed = sum(len(t) for t in runner_output.sampled_token_ids)
        positions = runner_output.block_positions
        return SpecDecodingStats(
            num_spec_tokens=0, num_drafts=len(denoised), num_draft_tokens=positions[0],
            num_accepted_tokens=committed, num_draft_tokens_per_pos=[positions[1]])

    def make_stats(self, spec_decoding_stats: SpecDecodingStats | None = None, *args: Any,
                   **kwargs: Any):
        step_stats, self._step_stats = self._step_stats, None
        return super().make_stats(step_stats or spec_decoding_stats, *args, **kwargs)
