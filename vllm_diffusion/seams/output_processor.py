"""``OutputProcessor``: step maps cut with the output (patches/README.md row 10), and a
request the engine ended with an error answered with its reason (row 18): for requests
served through ``AsyncLLM``, the failure in ``stop_reason`` (``step.failures``) replaces
the output with a ``GracefulHTTPError`` of its status and message, which
``AsyncLLM.generate`` raises as is; the offline ``LLM`` keeps vLLM's output."""

from __future__ import annotations

from vllm_diffusion.seams._wrapping import first_wrap


def install() -> None:
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    from vllm_diffusion.config import STEP_MAP_KEY
    from vllm_diffusion.error_messages import capped
    from vllm_diffusion.step.failures import Failure

    if not first_wrap(OutputProcessor):
        return
    trim_surplus_tokens = OutputProcessor._trim_surplus_tokens
    process_outputs = OutputProcessor.process_outputs

    def trim_surplus_tokens_and_step_map(req_state, output, num_prev_tokens):
        trim_surplus_tokens(req_state, output, num_prev_tokens)
        params = output.kv_transfer_params
        if params and STEP_MAP_KEY in params:
            num_tokens = req_state.detokenizer.num_output_tokens()
            params[STEP_MAP_KEY] = params[STEP_MAP_KEY][:num_tokens]

    def process_outputs_answering_failures(self, engine_core_outputs, *args, **kwargs):
        failures = []
        for output in engine_core_outputs:
            if output.finish_reason != FinishReason.ERROR:
                continue
            failure = Failure.from_stop_reason(output.stop_reason)
            state = self.request_states.get(output.request_id)
            if failure is not None and state is not None and state.queue is not None:
                failures.append((state.queue, failure))
        result = process_outputs(self, engine_core_outputs, *args, **kwargs)
        for queue, failure in failures:
            queue.put(GracefulHTTPError(capped(failure.message), HTTPStatus(failure.status)))
        return result

    OutputProcessor._trim_surplus_tokens = staticmethod(trim_surplus_tokens_and_step_map)
    OutputProcessor.process_outputs = process_outputs_answering_failures
