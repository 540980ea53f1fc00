"""Where vllm-diffusion attaches to vLLM outside its own subclasses: one module per vLLM
class it wraps (its row of ``patches/README.md``), each leaving other models untouched.
``install()`` runs them all (idempotent; every process calls it through ``register``)."""

from __future__ import annotations


def install() -> None:
    from vllm_diffusion.seams import (async_llm, engine_args, input_processor, log_filters,
                                      offline_llm, openai_serving, output_processor,
                                      stat_loggers)

    log_filters.install_startup_filters()
    engine_args.install()
    input_processor.install()
    stat_loggers.install()
    output_processor.install()
    offline_llm.install()
    async_llm.install()
    openai_serving.install()
