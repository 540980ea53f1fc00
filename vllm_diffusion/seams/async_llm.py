"""``AsyncLLM``: in-flight requests answered with HTTP 503 when the server shuts down
(patches/README.md row 14), and a normal stop kept quiet (row 23 (c)-(e)): in abort mode
before the stock shutdown (which would end a plain request as a 200 with finish_reason
"abort") and in every mode after it, each request still streaming gets
``shutting_down_error``; once shutdown has begun, rendering and ``add_request`` answer the
same 503, the core client's ``EngineDeadError`` ends the output handler as a cancellation,
the engine core gets ``ENGINE_EXIT_GRACE_S`` to exit, and the frozen heap is unfrozen."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import weakref

from vllm_diffusion.seams._wrapping import first_wrap, serves_diffusion_model


def shutting_down_error():
    """A ``GracefulHTTPError``: ``AsyncLLM.generate`` raises it as is, the server answers 503."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    return GracefulHTTPError("the server is shutting down; the request was not finished, "
                             "retry it on another instance", HTTPStatus.SERVICE_UNAVAILABLE)


# The diffusion engines, their renderers and engine-core clients whose shutdown has begun.
_SHUTTING_DOWN: weakref.WeakSet = weakref.WeakSet()

# Seconds the engine-core process gets to exit after SIGTERM in abort mode (vLLM's ROCm
# grace); it exits as soon as its teardown is done.
ENGINE_EXIT_GRACE_S = 15.0


def _stop_is_not_death(get_output_async):
    """``get_output_async`` of an engine-core client: the engine's death read after its
    shutdown began ends the reader as a cancellation, not as an engine failure."""
    from vllm.v1.engine.exceptions import EngineDeadError

    @functools.wraps(get_output_async)
    async def reading(self):
        try:
            return await get_output_async(self)
        except EngineDeadError:
            if self in _SHUTTING_DOWN:
                raise asyncio.CancelledError from None
            raise

    return reading


def _refuse_after_shutdown(method):
    """``method`` (async, on an engine or renderer) answers 503 once shutdown has begun,
    also when it fails half-way because shutdown began meanwhile."""

    @functools.wraps(method)
    async def refusing(self, *args, **kwargs):
        if self in _SHUTTING_DOWN:
            raise shutting_down_error()
        try:
            return await method(self, *args, **kwargs)
        except Exception as error:
            if self in _SHUTTING_DOWN:
                raise shutting_down_error() from error
            raise

    return refusing


def install() -> None:
    from vllm.renderers.base import BaseRenderer
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import AsyncMPClient

    if not first_wrap(AsyncLLM):
        return
    AsyncMPClient.get_output_async = _stop_is_not_death(AsyncMPClient.get_output_async)
    shutdown = AsyncLLM.shutdown
    AsyncLLM.add_request = _refuse_after_shutdown(AsyncLLM.add_request)
    BaseRenderer.render_chat_async = _refuse_after_shutdown(BaseRenderer.render_chat_async)
    BaseRenderer.render_cmpl_async = _refuse_after_shutdown(BaseRenderer.render_cmpl_async)

    def fail_in_flight_requests(engine) -> None:
        # On the event loop's thread: the request queues are asyncio objects.
        if engine.output_processor.request_states:
            engine.output_processor.propagate_error(shutting_down_error())

    def on_loop(engine, handler) -> None:
        """``fail_in_flight_requests`` on the handler's loop, done when this returns."""
        loop = handler.get_loop()
        if loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fail_in_flight_requests(engine)
            return

        async def fail() -> None:
            fail_in_flight_requests(engine)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(fail(), loop).result(timeout=5)

    def shutdown_and_end_in_flight_requests(self, timeout: float | None = None):
        handler = getattr(self, "output_handler", None)
        diffusion = serves_diffusion_model(getattr(self, "vllm_config", None))
        ours = diffusion and handler is not None
        if diffusion:
            for part in (self, getattr(self, "renderer", None),
                         getattr(self, "engine_core", None)):
                if part is not None:
                    _SHUTTING_DOWN.add(part)
        if ours and not timeout:
            # Abort mode (shutdown_timeout 0): 503 before the engine aborts the requests.
            on_loop(self, handler)
        shutdown(self, timeout=ENGINE_EXIT_GRACE_S if diffusion and not timeout else timeout)
        if diffusion:
            # Collectable again, so that the process's exit frees what the server froze.
            gc.unfreeze()
        if ours:
            # What a drain left unfinished, and requests the cancelled handler never told.
            on_loop(self, handler)

    AsyncLLM.shutdown = shutdown_and_end_in_flight_requests
