"""Quiet, truthful start-up and shutdown logs: the logging filters on vLLM's loggers and
the shutdown wrapper's handling of a normal stop (patches/README.md row 23). Unit tests,
no engine; the whole log of a server's start and normal stop is checked in
tests/test_server.py."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import io
import logging
from http import HTTPStatus
from types import SimpleNamespace

import pytest
from vllm.exceptions import GracefulHTTPError, VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_diffusion.architectures import ARCHITECTURES
from vllm_diffusion.seams import async_llm, log_filters
from vllm_diffusion.seams.log_filters import (CLIENT_ERROR_LOGGERS, ClientErrorFilter,
                                              TritonNotInstalledFilter)


def logged(kind: type[logging.Filter], emit) -> tuple[str, list[logging.LogRecord]]:
    """What a logger with the filter ``kind`` prints when ``emit(logger)`` logs, and the
    records it passed."""
    logger = logging.getLogger(f"test_log_filters.{kind.__name__}.{id(emit)}")
    logger.propagate, logger.level = False, logging.DEBUG
    stream, records = io.StringIO(), []
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.emit = lambda record, emit_=handler.emit: (records.append(record), emit_(record))
    logger.addHandler(handler)
    logger.addFilter(kind())
    emit(logger)
    return stream.getvalue(), records


def raising(error: Exception, message: str = "Error in chat completion stream generator."):
    def emit(logger):
        try:
            raise error
        except Exception:
            logger.exception(message)
    return emit


def test_triton_not_installed_is_dropped_while_triton_is_importable(monkeypatch):
    monkeypatch.setattr(log_filters.importlib.util, "find_spec", lambda name: object())
    text, _ = logged(TritonNotInstalledFilter, lambda logger: (
        logger.warning("Triton is not installed. triton-cpu is expected on x86 CPUs."),
        logger.warning("Reset SSM cache type to float32.")))
    assert text == "WARNING Reset SSM cache type to float32.\n"


def test_triton_not_installed_stays_where_it_is_true(monkeypatch):
    monkeypatch.setattr(log_filters.importlib.util, "find_spec", lambda name: None)
    text, _ = logged(TritonNotInstalledFilter, lambda logger: logger.warning(
        "Triton is not installed. triton-cpu is expected on x86 CPUs."))
    assert "Triton is not installed" in text


def test_a_client_error_is_one_info_line_without_traceback():
    text, records = logged(ClientErrorFilter, raising(
        VLLMValidationError("unknown option(s) 'x';\nvalid options are a, b",
                            parameter="extra_args")))
    assert text == ("INFO Error in chat completion stream generator: unknown option(s) 'x'; "
                    "valid options are a, b (parameter=extra_args) "
                    "(VLLMValidationError, HTTP 400)\n")
    assert records[0].exc_info is None and records[0].levelno == logging.INFO


def test_a_message_naming_the_error_is_not_repeated():
    text, _ = logged(ClientErrorFilter, raising(
        VLLMValidationError("top_k must be at least 1."),
        "Error in create_messages: top_k must be at least 1."))
    assert text == ("INFO Error in create_messages: top_k must be at least 1 "
                    "(VLLMValidationError, HTTP 400)\n")


def test_a_graceful_5xx_answer_is_one_warning_line():
    text, _ = logged(ClientErrorFilter, raising(
        GracefulHTTPError("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE)))
    assert text.startswith("WARNING ") and text.endswith("(GracefulHTTPError, HTTP 503)\n")
    assert "Traceback" not in text


@pytest.mark.parametrize("error", [RuntimeError("boom"), ValueError("a server bug"),
                                   EngineDeadError()])
def test_a_server_fault_keeps_its_error_and_traceback(error):
    text, records = logged(ClientErrorFilter, raising(error))
    assert text.startswith("ERROR Error in chat completion stream generator.")
    assert "Traceback" in text and records[0].exc_info is not None


def test_a_client_error_below_the_loggers_level_is_not_printed():
    def emit(logger):
        logger.level = logging.WARNING
        raising(VLLMValidationError("bad"))(logger)
    text, _ = logged(ClientErrorFilter, emit)
    assert text == ""


def test_the_filtered_loggers_are_vllms_that_log_tracebacks():
    """Each logger the client-error filter is put on belongs to a vLLM module that logs
    exceptions with their tracebacks; the CPU platform logs the Triton line filtered."""
    for name in CLIENT_ERROR_LOGGERS:
        assert "logger.exception(" in inspect.getsource(importlib.import_module(name)), name
    cpu = inspect.getsource(importlib.import_module(log_filters.CPU_PLATFORM_LOGGER))
    assert f'"{log_filters.TRITON_NOT_INSTALLED} triton-cpu' in cpu


def test_the_plugins_loggers_print_through_vllms_handlers(monkeypatch):
    ours, theirs = logging.getLogger("vllm_diffusion"), logging.getLogger("vllm")
    handler = logging.StreamHandler(io.StringIO())
    monkeypatch.setattr(theirs, "handlers", [handler])
    monkeypatch.setattr(theirs, "level", logging.INFO)
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(ours, "propagate", True)
    log_filters.route_plugin_logs()
    log_filters.route_plugin_logs()  # once
    assert ours.handlers == [handler] and not ours.propagate and ours.level == logging.INFO
    logging.getLogger("vllm_diffusion.worker.warm_up").info("warmed up")
    assert handler.stream.getvalue() == "warmed up\n"


def test_filters_are_installed_once():
    log_filters.install_startup_filters()
    log_filters.install_startup_filters()
    log_filters.install_client_error_filters()
    log_filters.install_client_error_filters()
    cpu = logging.getLogger(log_filters.CPU_PLATFORM_LOGGER)
    assert sum(isinstance(f, TritonNotInstalledFilter) for f in cpu.filters) == 1
    for name in CLIENT_ERROR_LOGGERS:
        filters = logging.getLogger(name).filters
        assert sum(isinstance(f, ClientErrorFilter) for f in filters) == 1


class DyingClient:
    async def get_output_async(self):
        raise EngineDeadError()


def test_engine_death_read_after_shutdown_began_ends_the_reader_as_a_cancellation():
    read = async_llm._stop_is_not_death(DyingClient.get_output_async)
    running, stopping = DyingClient(), DyingClient()
    async_llm._SHUTTING_DOWN.add(stopping)
    with pytest.raises(EngineDeadError):
        asyncio.run(read(running))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(read(stopping))


def test_core_client_reads_through_the_wrapper():
    import vllm_diffusion
    from vllm.v1.engine.core_client import AsyncMPClient

    vllm_diffusion.register()
    assert AsyncMPClient.get_output_async.__wrapped__ is not None
    assert inspect.iscoroutinefunction(AsyncMPClient.get_output_async.__wrapped__)


class CoreClient:
    def __init__(self, timeouts: list):
        self.timeouts = timeouts

    def shutdown(self, timeout=None):
        self.timeouts.append(timeout)


@pytest.mark.parametrize("timeout, expected", [(0, async_llm.ENGINE_EXIT_GRACE_S),
                                               (None, async_llm.ENGINE_EXIT_GRACE_S),
                                               (30, 30)])
def test_abort_mode_gives_the_engine_process_time_to_exit(timeout, expected):
    """vLLM's abort mode (shutdown_timeout 0) SIGKILLs the engine core right after its
    SIGTERM; a diffusion engine's process gets ENGINE_EXIT_GRACE_S to exit (and unlink its
    shared memory); a drain's own timeout is kept."""
    import vllm_diffusion
    from vllm.v1.engine.async_llm import AsyncLLM

    vllm_diffusion.register()
    given = []
    engine = object.__new__(AsyncLLM)
    engine.vllm_config = SimpleNamespace(model_config=SimpleNamespace(
        architecture=next(iter(ARCHITECTURES))))
    engine.engine_core = CoreClient(given)
    engine.renderer, engine.output_handler = None, None
    engine.shutdown(timeout=timeout)
    assert given == [expected]
    assert engine.engine_core in async_llm._SHUTTING_DOWN


def test_shutdown_unfreezes_the_heap_the_server_froze():
    """The API server freezes its start-up heap; frozen reference cycles outlive the
    interpreter's finalization (nanobind then reports Triton's bindings as leaked)."""
    import gc

    import vllm_diffusion
    from vllm.v1.engine.async_llm import AsyncLLM

    vllm_diffusion.register()
    engine = object.__new__(AsyncLLM)
    engine.vllm_config = SimpleNamespace(model_config=SimpleNamespace(
        architecture=next(iter(ARCHITECTURES))))
    engine.engine_core = CoreClient([])
    engine.renderer, engine.output_handler = None, None
    gc.freeze()
    try:
        engine.shutdown(timeout=0)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
