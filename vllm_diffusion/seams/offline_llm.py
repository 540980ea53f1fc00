"""``OfflineInferenceMixin`` (``LLM``): a failed call's unfinished requests aborted, so the
next call starts clean (patches/README.md row 13)."""

from __future__ import annotations

from vllm_diffusion.seams._wrapping import first_wrap, serves_diffusion_model


def install() -> None:
    from vllm.entrypoints.common.offline import OfflineInferenceMixin

    if not first_wrap(OfflineInferenceMixin):
        return
    run_engine = OfflineInferenceMixin._run_engine

    def run_engine_and_abort_on_failure(self, *args, **kwargs):
        try:
            return run_engine(self, *args, **kwargs)
        except BaseException:
            engine = self.llm_engine
            if serves_diffusion_model(engine.vllm_config):
                unfinished = list(engine.output_processor.request_states)
                if unfinished:
                    engine.abort_request(unfinished, internal=True)
            raise

    OfflineInferenceMixin._run_engine = run_engine_and_abort_on_failure
