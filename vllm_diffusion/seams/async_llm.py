"""``AsyncLLM``: in-flight requests told when the server shuts down (patches/README.md row
14). vLLM's ``AsyncLLM.shutdown`` stops the engine and cancels its output handler without
telling the requests still streaming, so each stream (and with it uvicorn's graceful
shutdown) waits until its client gives up. The wrapper ends every in-flight request with
a 503 error once the engine is down, and in vLLM's default abort mode
(``--shutdown-timeout 0``) before the engine aborts them, which would answer a plain request
with a 200 holding a partial output and finish_reason "abort": vLLM's error handling
answers it with HTTP 503 "the server is shutting down" (a stream gets it as its error
chunk), without the traceback an engine failure logs. In drain mode the requests finish
first; those the drain leaves get the 503.

A request the HTTP server accepted just before the signal but had not yet handed to the
engine would otherwise meet a renderer whose thread pool is shut down (HTTP 500 "cannot
schedule new futures after shutdown") or a dead engine: once shutdown begins, rendering
and ``add_request`` answer the same 503.

A normal stop is not an engine failure (patches/README.md row 23): the stock shutdown
stops the engine core and only then cancels the output handler, so the handler can read
the engine's death first and log "AsyncLLM output_handler failed" with an
``EngineDeadError`` traceback; once a diffusion engine's shutdown has begun, its core
client's ``get_output_async`` ends the handler as the cancellation that was coming
instead. And in abort mode vLLM gives the engine-core process no time between SIGTERM and
SIGKILL (it gives ROCm 15 s for the same reason: a process killed mid-teardown leaves its
resources behind), so on CPU the core and its worker died before unlinking their shared
memory and semaphores, which Python's resource tracker then reported as leaked; the
wrapper gives the process ``ENGINE_EXIT_GRACE_S`` to exit (it aborts its requests at once
either way, by its own configuration). Last, the API server froze its start-up heap
(``freeze_gc_heap``, so that collections skip it) and never unfreezes it: the frozen
reference cycles then outlive the interpreter's finalization, among them Triton's
bindings, and nanobind reported their types, functions and default arguments as leaked at
every exit; the wrapper unfreezes the heap once the engine is down."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import weakref

from vllm_diffusion.seams._wrapping import first_wrap, serves_diffusion_model


def shutting_down_error():
    """An exception vLLM's API server turns into HTTP 503 (a ``GracefulHTTPError``: raised
    through ``AsyncLLM.generate`` as is, answered with its status, no traceback)."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    return GracefulHTTPError("the server is shutting down; the request was not finished, "
                             "retry it on another instance", HTTPStatus.SERVICE_UNAVAILABLE)


# The diffusion engines, their renderers and their engine-core clients, whose shutdown has
# begun.
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
        ours = handler is not None and serves_diffusion_model(self.vllm_config)
        diffusion = serves_diffusion_model(getattr(self, "vllm_config", None))
        if diffusion:
            for part in (self, getattr(self, "renderer", None),
                         getattr(self, "engine_core", None)):
                if part is not None:
                    _SHUTTING_DOWN.add(part)
        if ours and not timeout:
            # Abort mode (vLLM's default, shutdown_timeout 0): answer 503 before the
            # engine aborts the requests, which would end them as a 200 with
            # finish_reason "abort".
            on_loop(self, handler)
        shutdown(self, timeout=ENGINE_EXIT_GRACE_S if diffusion and not timeout else timeout)
        if diffusion:
            # Collectable again, so that the process's exit frees what the server froze.
            gc.unfreeze()
        if ours:
            # What a drain left unfinished, and requests the cancelled handler never
            # told.
            on_loop(self, handler)

    AsyncLLM.shutdown = shutdown_and_end_in_flight_requests
