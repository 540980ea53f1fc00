"""Time the parts of an engine step by wrapping the callables that do them.

A ``StepClock`` replaces named attributes (bound methods of a live engine's objects,
methods of a class, functions of a module) with wrappers that add their wall time to a
category: in total, and, while a step is open, to that step. A wrapper marked ``step``
opens a step for the duration of its call (the engine's ``step``, the runner's
``execute_model``). Times are inclusive: a category nested in another is also counted in
it (``exclusive`` takes the nested ones out). The engine must run in this process
(``harness.engines_in_process``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass
class Step:
    seconds: collections.Counter
    note: Any = None  # what the step's ``note`` function said of its arguments


class StepClock:
    def __init__(self) -> None:
        self.totals: collections.Counter = collections.Counter()
        self.steps: list[Step] = []
        self._open: Step | None = None
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attribute: str, category: str, *, step: bool = False,
             note: Callable[..., Any] | None = None) -> None:
        """Time ``owner.attribute`` as ``category``; ``step``: each call is one step, and
        ``note(*args, **kwargs)`` is kept with it."""
        function = getattr(owner, attribute)
        clock = self

        @functools.wraps(function)
        def timed(*args, **kwargs):
            opens = step and clock._open is None
            if opens:
                clock._open = Step(collections.Counter(),
                                   note(*args, **kwargs) if note else None)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                clock.totals[category] += seconds
                if clock._open is not None:
                    clock._open.seconds[category] += seconds
                if opens:
                    clock.steps.append(clock._open)
                    clock._open = None

        own = attribute in vars(owner)
        setattr(owner, attribute, timed)
        self._undo.append(lambda: setattr(owner, attribute, function) if own
                          else delattr(owner, attribute))

    def clear(self) -> None:
        self.totals.clear()
        self.steps.clear()

    def restore(self) -> None:
        """Put every wrapped attribute back."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> StepClock:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def exclusive(inclusive: Mapping[str, float],
              nested: Mapping[str, tuple[str, Sequence[str]]]) -> collections.Counter:
    """Inclusive seconds per category (0 for one not timed) plus, for each
    ``parent: (rest, children)``, the parent's time outside its children as ``rest``."""
    out = collections.Counter(inclusive)
    for parent, (rest, children) in nested.items():
        out[rest] = out[parent] - sum(out[c] for c in children)
    return out


def model_runner(llm) -> Any:
    """The model runner of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def share_of_wall(llm, prompts: list, params, rounds: int, clock: StepClock) -> list[dict]:
    """After a warm-up, ``rounds`` generations of ``prompts``: per round the engine steps,
    the wall time, and the seconds ``clock`` collected, per step and as a share of the wall
    time."""
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    reports = []
    for _ in range(rounds):
        clock.clear()
        steps = llm.collective_rpc("diffusion_stats")[0]["engine_steps"]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = max(llm.collective_rpc("diffusion_stats")[0]["engine_steps"] - steps, 1)
        own = sum(clock.totals.values())
        reports.append({"engine_steps": steps, "wall_time_s": round(wall, 3),
                        "ms_per_step": {k: round(1000 * v / steps, 3)
                                        for k, v in clock.totals.items()},
                        "own_ms_per_step": 1000 * own / steps,
                        "share_of_wall_time": own / wall, "step_ms": 1000 * wall / steps})
    return reports


def share_report(setting: dict, reports: list[dict]) -> dict:
    """The setting, every round, and the median share of the wall time (the upper one of
    an even count)."""
    shares = sorted(r["share_of_wall_time"] for r in reports)
    return {**setting, "rounds": reports, "median_share_of_wall_time": shares[len(shares) // 2]}


def mean_ms(steps: Sequence[Mapping[str, float]], categories: Sequence[str]) -> dict[str, float]:
    """Mean milliseconds per step of each category."""
    return {c: 1e3 * statistics.mean(s.get(c, 0.0) for s in steps) for c in categories}
