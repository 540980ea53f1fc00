"""Step latency as a function of the rows a step computes (Optimus, section 5.2).

T(x) for x = rows computed per step is piecewise affine with three regimes (memory-bound,
transition, compute-bound): T = slope_k * x + intercept_k on [breaks_k, breaks_{k+1}).
``fit_piecewise`` fits it by least squares over every pair of breakpoints taken from the
samples; ``tools/profile_latency.py`` measures the samples on the machine for a model and
writes a ``LatencyProfile`` as JSON, which the ``elastic`` policy loads at start-up. The
profile names the model it was measured for; a profile of another model is refused.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

MODEL_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "vocab_size")


def model_identity(hf_config: Any) -> dict[str, Any]:
    """What makes two models' step latencies comparable: their shape."""
    to_dict = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    return {k: to_dict.get(k) for k in MODEL_KEYS}


@dataclasses.dataclass(frozen=True)
class LatencyProfile:
    model: dict[str, Any]
    breaks: tuple[float, float]  # x where the 2nd and the 3rd regime begin
    slopes: tuple[float, float, float]  # seconds per row, per regime
    intercepts: tuple[float, float, float]  # seconds, per regime
    samples: tuple[tuple[float, float], ...] = ()  # (rows, seconds) it was fitted on

    def seconds(self, rows: float) -> float:
        regime = 0 if rows < self.breaks[0] else 1 if rows < self.breaks[1] else 2
        return max(self.slopes[regime] * rows + self.intercepts[regime], 1e-6)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def load(cls, path: str | pathlib.Path, hf_config: Any) -> LatencyProfile:
        try:
            data = json.loads(pathlib.Path(path).read_text())
            profile = cls(model=data["model"], breaks=tuple(data["breaks"]),
                          slopes=tuple(data["slopes"]), intercepts=tuple(data["intercepts"]),
                          samples=tuple(tuple(s) for s in data.get("samples", ())))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"latency profile {path} cannot be read: {err}; make one with "
                             f"tools/profile_latency.py --model <checkpoint>") from err
        expected = model_identity(hf_config)
        if profile.model != expected:
            raise ValueError(f"latency profile {path} was measured for another model "
                             f"({profile.model}), not this one ({expected}); profile this "
                             f"model with tools/profile_latency.py")
        return profile


def _affine(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares (slope, intercept, squared error) of y on x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = 0.0 if var == 0 else sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    intercept = mean_y - slope * mean_x
    return slope, intercept, sum((slope * x + intercept - y) ** 2 for x, y in points)


def fit_piecewise(samples: list[tuple[float, float]], model: dict[str, Any],
                  min_points: int = 2) -> LatencyProfile:
    """Three affine regimes over ``samples`` (rows, seconds), the breakpoints chosen among
    the sample positions to minimise the total squared error."""
    points = sorted(samples)
    xs = sorted({x for x, _ in points})
    if len(points) < 3 * min_points or len(xs) < 3:
        raise ValueError(f"need at least {3 * min_points} samples at 3 or more row counts, "
                         f"got {len(points)} at {len(xs)}")
    best = None
    for i, first in enumerate(xs[1:], start=1):
        for second in xs[i + 1:]:
            parts = ([p for p in points if p[0] < first],
                     [p for p in points if first <= p[0] < second],
                     [p for p in points if p[0] >= second])
            if min(len(p) for p in parts) < min_points:
                continue
            fits = [_affine(p) for p in parts]
            error = sum(f[2] for f in fits)
            if best is None or error < best[0]:
                best = (error, (first, second), fits)
    if best is None:
        raise ValueError("the samples cannot be split into three regimes of "
                         f"{min_points} points each")
    _, breaks, fits = best
    return LatencyProfile(model=model, breaks=breaks,
                          slopes=tuple(f[0] for f in fits),
                          intercepts=tuple(f[1] for f in fits), samples=tuple(points))
