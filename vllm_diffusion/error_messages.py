"""Every error message a request to the plugin's models gets is at most ``MESSAGE_LIMIT``
bytes, whoever wrote it (patches/README.md row 3). Echoed client values are already cut
(``options.shown``, ``options.listed``); the cap here is the guarantee at the exits
(``seams/input_processor.py``, ``seams/output_processor.py``, ``step/failures.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

MESSAGE_LIMIT = 1024  # bytes of UTF-8 in one error message


def capped(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """``message`` when it fits in ``limit`` bytes, else its beginning and its length."""
    data = message.encode()
    if len(data) <= limit:
        return message
    tail = f"... (message cut: {len(data)} bytes)"
    return data[:max(limit - len(tail), 0)].decode(errors="ignore") + tail


def capped_error(err: Exception) -> Exception:
    """``err`` when its message fits; else an exception the server answers with the same
    status, its message cut: other subclasses of ``ValueError``, ``TypeError`` and
    ``OverflowError`` (answered 400) become a ``VLLMValidationError``, other exceptions
    outside vLLM's typed errors a ``VLLMServerError`` (500) naming their type."""
    from vllm.exceptions import (GracefulHTTPError, VLLMError, VLLMServerError,
                                 VLLMValidationError)

    if len(str(err).encode()) <= MESSAGE_LIMIT:
        return err
    if isinstance(err, VLLMValidationError):
        base = str(err.args[0]) if err.args else ""
        parameter = None if err.parameter is None else capped(str(err.parameter), 80)
        value = None if err.value is None else capped(str(err.value), 100)
        extras = len(str(VLLMValidationError("", parameter=parameter, value=value)).encode())
        return VLLMValidationError(capped(base, MESSAGE_LIMIT - extras),
                                   parameter=parameter, value=value)
    if isinstance(err, GracefulHTTPError):
        return GracefulHTTPError(capped(err.message), err.http_status)
    if type(err) in (ValueError, TypeError, OverflowError, NotImplementedError):
        return type(err)(capped(str(err)))
    if isinstance(err, (ValueError, TypeError, OverflowError)):
        return VLLMValidationError(capped(str(err)))
    if not isinstance(err, VLLMError):
        return VLLMServerError(capped(f"{type(err).__name__}: {err}"))
    return err


@contextlib.contextmanager
def errors_capped() -> Iterator[None]:
    """Re-raise an exception of the block as ``capped_error`` makes it, from the original."""
    try:
        yield
    except Exception as err:
        cut = capped_error(err)
        if cut is err:
            raise
        raise cut from err
