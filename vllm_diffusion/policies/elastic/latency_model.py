"""Step latency as a function of the rows a step computes (Optimus, section 5.2):
piecewise affine in three regimes (``fit_piecewise``), learned online (``OnlineLatency``)
or loaded from a ``LatencyProfile`` that ``tools/profile_latency.py`` measured for the
same model (a profile of another model is refused).
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


def binned(samples: list[tuple[float, float]], bins: int = 24) -> list[tuple[float, float]]:
    """At most ``bins`` points: the samples by rows in groups of equal size, each the mean
    rows and median seconds (a small input for ``fit_piecewise``, cubic in its points)."""
    ordered = sorted(samples)
    size = max(1, -(-len(ordered) // bins))
    points = []
    for start in range(0, len(ordered), size):
        group = ordered[start:start + size]
        times = sorted(s for _, s in group)
        points.append((sum(r for r, _ in group) / len(group), times[len(times) // 2]))
    return points


class OnlineLatency:
    """Step latency learned from the engine's own steps: (rows a step computed, wall time
    from its start to the next step's), refitted every ``refit_every`` observations over
    the last ``window`` (``_refit``); every ``holdout_every``-th is held out
    (``held_out_error``). An interval over ``outlier_factor`` times the median per-row
    time is dropped (the engine was idle in between). A warm-start profile answers until
    the first fit."""

    def __init__(self, model: dict[str, Any], warm_start: LatencyProfile | None = None,
                 window: int = 512, refit_every: int = 8, holdout_every: int = 5,
                 outlier_factor: float = 10.0) -> None:
        self.model = model
        self.profile = warm_start
        self.window = window
        self.refit_every = refit_every
        self.holdout_every = holdout_every
        self.outlier_factor = outlier_factor
        self.samples: list[tuple[float, float]] = []
        self.held_out: list[tuple[float, float]] = []
        self.observed = 0
        self.fitted = False
        self.span: tuple[float, float] | None = None  # the rows the fit has seen
        self.overall_slope = 0.0  # one affine fit's slope over them (>= 0)

    @property
    def ready(self) -> bool:
        return self.profile is not None

    def seconds(self, rows: float) -> float:
        """T(rows); beyond the rows the fit has seen, extended from its edge with one affine
        fit's slope (a fit on batch-1 steps must not forbid batch 4)."""
        assert self.profile is not None, "no latency model yet"
        if self.span is None:
            return self.profile.seconds(rows)
        low, high = self.span
        slope = self.overall_slope
        if rows > high:
            return self.profile.seconds(high) + slope * (rows - high)
        if rows < low:
            return max(self.profile.seconds(low) - slope * (low - rows), 1e-6)
        return self.profile.seconds(rows)

    def observe(self, rows: float, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        per_row = sorted(s / r for r, s in self.samples[-64:]) if self.samples else []
        if per_row and seconds / rows > self.outlier_factor * per_row[len(per_row) // 2]:
            return
        self.observed += 1
        if self.observed % self.holdout_every == 0:
            self.held_out = (self.held_out + [(rows, seconds)])[-self.window // 4:]
            return
        self.samples = (self.samples + [(rows, seconds)])[-self.window:]
        if len(self.samples) >= 8 and (self.observed % self.refit_every == 0
                                       or not self.fitted):
            self._refit()

    def _refit(self) -> None:
        """The three-regime fit where it predicts the held-out steps better than one affine
        fit (clustered row counts make degenerate regimes), else the affine one."""
        points = binned(self.samples)
        rows = [r for r, _ in self.samples]
        self.span = (min(rows), max(rows))
        slope, intercept, _ = _affine(self.samples)
        self.overall_slope = max(slope, 0.0)
        affine = LatencyProfile(self.model, (float("inf"), float("inf")), (slope, 0.0, 0.0),
                                (intercept, 0.0, 0.0))
        candidates = [affine]
        if len(points) >= 6:
            try:
                candidates.append(fit_piecewise(points, self.model, min_points=2))
            except ValueError:
                pass
        self.profile = min(candidates, key=lambda p: self._error(p, self.held_out)
                           if self.held_out else 0.0)
        self.fitted = True

    @staticmethod
    def _error(profile: LatencyProfile, samples: list[tuple[float, float]]) -> float:
        return sum(abs(profile.seconds(r) - s) / s for r, s in samples) / len(samples)

    def held_out_error(self) -> float | None:
        """Mean relative error of the current model on the held-out observations."""
        if self.profile is None or not self.held_out:
            return None
        return self._error(self.profile, self.held_out)
