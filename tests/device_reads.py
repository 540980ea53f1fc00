"""Counting the device-to-host reads of a runner step on a CPU-only machine.

``DeviceResident`` marks tensors that would live on the accelerator: the model's hidden
states are wrapped in it, and every tensor computed from them stays wrapped (torch's
default ``__torch_function__`` propagates a subclass through operations). An operation
that would copy such a tensor to the host or make the host wait for its values (``.cpu()``,
``.tolist()``, ``.item()``, ``bool()``, ``.nonzero()``, boolean-mask indexing, ...) is
counted once and returns plain host tensors, so what follows it is host work.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from vllm_diffusion.attention import backend
from vllm_diffusion.models.step_run import StepRun

_READS = {
    torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select,
    torch.masked_select, torch.Tensor.unique, torch.unique, torch.argwhere,
    torch.Tensor.argwhere, torch.Tensor.__array__,
}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.as_subclass(torch.Tensor)
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    return value


def _names_host(args: tuple, kwargs: dict) -> bool:
    """Whether a ``.to(...)`` call targets the host."""
    targets = [*args[1:], kwargs.get("device")]
    return any(str(t) == "cpu" or (isinstance(t, torch.device) and t.type == "cpu")
               for t in targets if isinstance(t, (str, torch.device)))


def _bool_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, DeviceResident) and p.dtype == torch.bool for p in parts)


class DeviceResident(torch.Tensor):
    reads: list[str] = []  # names of the reads since the last reset

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _READS or (func is torch.Tensor.to and _names_host(args, kwargs))
                or (func is torch.Tensor.__getitem__ and _bool_index(args))):
            cls.reads.append(getattr(func, "__name__", str(func)))
            with torch._C.DisableTorchFunctionSubclass():
                return _plain(func(*_plain(args), **_plain(kwargs)))
        return super().__torch_function__(func, types, args, kwargs)


class _ResidentModel:
    """The runner's model with its outputs (hidden states, logits) marked device-resident."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __call__(self, *, input_ids: torch.Tensor, positions: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
        # The inputs are device data as well, so reads inside the forward (a policy's
        # hooks) count too, wherever the layers' operations pass the mark on.
        return self._model(input_ids=input_ids.as_subclass(DeviceResident),
                           positions=positions.as_subclass(DeviceResident),
                           **kwargs).as_subclass(DeviceResident)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # vLLM's CPU matmul ops return plain tensors; the logits are device data too.
        return self._model.compute_logits(hidden_states).as_subclass(DeviceResident)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _marking(method, *marked: int):
    """``method`` with its positional arguments at the ``marked`` indices (after self)
    marked device-resident: the tensors a layer hands its hooks."""

    def marking(self, *args: Any) -> Any:
        args = tuple(a.as_subclass(DeviceResident) if i in marked else a
                     for i, a in enumerate(args))
        return method(self, *args)

    return marking


def _marking_function(function):
    """``function`` with its first argument (the layer's queries) marked device-resident;
    what it returns is the attention's output, plain again as the layer's would be."""

    def marking(query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return _plain(function(query.as_subclass(DeviceResident), *args, **kwargs))

    return marking


@contextlib.contextmanager
def count_device_reads(runner: Any):
    """Yields a list that gets, per ``execute_model`` call of ``runner`` with work, the
    names of the device reads it made."""
    per_step: list[list[str]] = []
    model, execute = runner.model, runner.execute_model

    def counted_execute(scheduler_output, *args, **kwargs):
        DeviceResident.reads = []
        output = execute(scheduler_output, *args, **kwargs)
        if scheduler_output.total_num_scheduled_tokens:
            per_step.append(list(DeviceResident.reads))
        return output

    runner.model, runner.execute_model = _ResidentModel(model), counted_execute
    # vLLM's CPU matmuls return plain tensors, so the mark is lost inside a layer; the
    # queries, keys and layer outputs the hooks read are marked where they enter.
    before, after = StepRun.before_attention, StepRun.after_output
    StepRun.before_attention = _marking(before, 2, 3)  # (layer, attention, q, k, ...)
    StepRun.after_output = _marking(after, 1)  # (layer, output, ...)
    # a key selection's attention (made before the forward, it runs inside the whole
    # model): its queries are marked where they enter the selection's two parts
    attend, score = backend.attend_with_key_selection, backend.score_prefixes
    backend.attend_with_key_selection = _marking_function(attend)
    backend.score_prefixes = _marking_function(score)
    try:
        yield per_step
    finally:
        runner.model = model
        del runner.execute_model  # the instance attribute; the class method again
        StepRun.before_attention, StepRun.after_output = before, after
        backend.attend_with_key_selection, backend.score_prefixes = attend, score
