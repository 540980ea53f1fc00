"""Option parsing and FOCUS's budget on any value: fast, no engine."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_diffusion.options import OptionError, Rule
from vllm_diffusion.kernels.selection import token_budget

UNIT = Rule(float, low=0.0, high=1.0)
UNBOUNDED = Rule(float)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf", "-inf"])
@pytest.mark.parametrize("rule", [UNIT, UNBOUNDED], ids=["bounded", "unbounded"])
def test_non_finite_floats_are_rejected(rule, value):
    with pytest.raises(OptionError, match=r"option 'x' must be a finite float"):
        rule.check("x", value, "test")


def test_integer_too_large_for_a_float_is_an_option_error():
    with pytest.raises(OptionError, match="too large for a float"):
        UNBOUNDED.check("x", 10**400, "test")


@pytest.mark.parametrize("value, expected", [(0.5, 0.5), (1, 1.0), ("0.25", 0.25)])
def test_finite_floats_pass(value, expected):
    assert UNIT.check("x", value, "test") == expected


@pytest.mark.parametrize("alpha, mean_decoded", [
    (math.nan, 1.0), (1.5, math.nan), (math.inf, 1.0), (1e308, 1e308), (64.0, 0.0)])
def test_token_budget_is_a_count_in_range_for_any_float(alpha, mean_decoded):
    delta = torch.tensor([0.1, float("nan"), 0.3, 5.0])
    budget = token_budget(delta, mean_decoded, alpha, block_size=8)
    assert isinstance(budget, int) and 1 <= budget <= 8
