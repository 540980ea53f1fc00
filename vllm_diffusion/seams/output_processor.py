"""``OutputProcessor``: step maps cut with the output (patches/README.md row 10). When a
stop string ends the output inside a step, the detokenizer drops the surplus tokens; the
request's step map (``kv_transfer_params["diffusion_step_map"]``, one entry per output
token) is cut to match."""

from __future__ import annotations

from vllm_diffusion.seams._wrapping import first_wrap


def install() -> None:
    from vllm.v1.engine.output_processor import OutputProcessor

    from vllm_diffusion.config import STEP_MAP_KEY

    if not first_wrap(OutputProcessor):
        return
    trim_surplus_tokens = OutputProcessor._trim_surplus_tokens

    def trim_surplus_tokens_and_step_map(req_state, output, num_prev_tokens):
        trim_surplus_tokens(req_state, output, num_prev_tokens)
        params = output.kv_transfer_params
        if params and STEP_MAP_KEY in params:
            num_tokens = req_state.detokenizer.num_output_tokens()
            params[STEP_MAP_KEY] = params[STEP_MAP_KEY][:num_tokens]

    OutputProcessor._trim_surplus_tokens = staticmethod(trim_surplus_tokens_and_step_map)
