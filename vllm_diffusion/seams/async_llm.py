"""``AsyncLLM``: in-flight requests told when the server shuts down (patches/README.md row
14). vLLM's ``AsyncLLM.shutdown`` stops the engine and cancels its output handler without
telling the requests still streaming, so each stream (and with it uvicorn's graceful
shutdown) waits until its client gives up. The wrapper ends every in-flight request with
``EngineDeadError`` once the engine is down."""

from __future__ import annotations

from vllm_diffusion.seams._wrapping import first_wrap, serves_diffusion_model


def install() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    if not first_wrap(AsyncLLM):
        return
    shutdown = AsyncLLM.shutdown

    def fail_in_flight_requests(engine) -> None:
        # On the event loop's thread: the request queues are asyncio objects.
        if engine.output_processor.request_states:
            engine.output_processor.propagate_error(EngineDeadError(
                "the server is shutting down; the request was not finished"))

    def shutdown_and_end_in_flight_requests(self, *args, **kwargs):
        handler = getattr(self, "output_handler", None)
        shutdown(self, *args, **kwargs)
        if handler is None or not serves_diffusion_model(self.vllm_config):
            return
        loop = handler.get_loop()
        if not loop.is_closed():
            loop.call_soon_threadsafe(fail_in_flight_requests, self)

    AsyncLLM.shutdown = shutdown_and_end_in_flight_requests
