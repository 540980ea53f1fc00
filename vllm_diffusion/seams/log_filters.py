"""Logging filters on vLLM's loggers (patches/README.md row 23 (a), (b)), and the plugin's
loggers routed through vLLM's handlers."""

from __future__ import annotations

import importlib.util
import logging

# vLLM's loggers that log an exception with its traceback before answering it.
CLIENT_ERROR_LOGGERS = (
    "vllm.entrypoints.openai.chat_completion.serving",  # chat completion stream generator
    "vllm.entrypoints.openai.completion.serving",  # completion stream generator
    "vllm.entrypoints.anthropic.api_router",  # /v1/messages, /v1/messages/count_tokens
    "vllm.entrypoints.anthropic.serving",  # Messages stream converter
)
CPU_PLATFORM_LOGGER = "vllm.platforms.cpu"
TRITON_NOT_INSTALLED = "Triton is not installed."


class TritonNotInstalledFilter(logging.Filter):
    """Drops the CPU platform's "Triton is not installed" while Triton is importable."""

    def __init__(self) -> None:
        super().__init__()
        self.triton_installed = importlib.util.find_spec("triton") is not None

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.triton_installed
                    and str(record.msg).startswith(TRITON_NOT_INSTALLED))


def client_error_status(error: BaseException) -> int | None:
    """The HTTP status vLLM gives ``error`` (``create_error_response``), where it is a
    declared client error or a graceful answer; None for every other exception."""
    from vllm.exceptions import GracefulHTTPError, VLLMClientError

    if isinstance(error, GracefulHTTPError):
        return int(error.http_status)
    if isinstance(error, VLLMClientError):
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response)

        return create_error_response(error).error.code
    return None


class ClientErrorFilter(logging.Filter):
    """Rewrites a record that logs a client error's traceback into one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        status = client_error_status(error) if error is not None else None
        if status is None:
            return True
        level = logging.INFO if status < 500 else logging.WARNING
        if not logging.getLogger(record.name).isEnabledFor(level):
            return False
        text = record.getMessage().rstrip(".")
        reason = " ".join(str(error).split())
        if reason.rstrip(".") not in text:
            text = f"{text}: {reason}"
        record.msg, record.args = "%s (%s, HTTP %d)", (text, type(error).__name__, status)
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _add_once(logger: logging.Logger, kind: type[logging.Filter]) -> None:
    if not any(isinstance(f, kind) for f in logger.filters):
        logger.addFilter(kind())


PLUGIN_LOGGER = "vllm_diffusion"


def route_plugin_logs() -> None:
    """The plugin's loggers print through vLLM's handlers at vLLM's level (once): vLLM
    configures its ``vllm`` logger only, so they printed nothing below WARNING."""
    ours, theirs = logging.getLogger(PLUGIN_LOGGER), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def install_startup_filters() -> None:
    """At the plugin's registration (every process), before vLLM builds its config."""
    _add_once(logging.getLogger(CPU_PLATFORM_LOGGER), TritonNotInstalledFilter)
    route_plugin_logs()


def install_client_error_filters() -> None:
    """In a process that serves a model of the plugin's (from its config hook)."""
    for name in CLIENT_ERROR_LOGGERS:
        _add_once(logging.getLogger(name), ClientErrorFilter)
