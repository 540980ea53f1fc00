"""The real model's evaluation helpers (``real_model/evaluation.py``, ``evaluation_set.py``):
scoring, degenerate answers, paired intervals, and the evaluation set kept out of the
training prompts."""

from __future__ import annotations

import math

from vllm_diffusion_lab.real_model.evaluation import (degenerate, paired_accuracy_interval,
                                                      paired_mean_interval,
                                                      repeated_fourgrams)
from vllm_diffusion_lab.real_model.evaluation_set import (DEFINITE_QUESTIONS, OPEN_REQUESTS,
                                                          DefiniteQuestion,
                                                          evaluation_prompts,
                                                          score_definite)
from vllm_diffusion_lab.real_model.training_prompts import training_prompts


def test_set_sizes_and_no_duplicates():
    assert len(DEFINITE_QUESTIONS) >= 200 and len(OPEN_REQUESTS) >= 200
    folded = [" ".join(p.lower().split()) for p in evaluation_prompts()]
    assert len(set(folded)) == len(folded)


def test_scoring_matches_whole_words_only():
    seven = DefiniteQuestion("What is 3 plus 4?", ("7", "seven"), "arithmetic")
    assert score_definite(seven, "3 + 4 is 7.") and score_definite(seven, "Seven!")
    assert not score_definite(seven, "It is 17.")
    gold = DefiniteQuestion("Symbol for gold?", ("Au",), "science")
    assert not score_definite(gold, "In August") and score_definite(gold, "It is Au.")


def test_training_prompts_exclude_the_evaluation_set():
    excluded = evaluation_prompts()
    prompts = training_prompts(400, seed=3, excluded=excluded + ["Define brave."])
    folded = {" ".join(p.lower().split()) for p in prompts}
    assert len(prompts) == 400
    assert not folded & {" ".join(p.lower().split()) for p in excluded}
    assert "define brave." not in folded


def test_degenerate_and_repeats():
    loop = [5, 6, 7, 8] * 20
    assert repeated_fourgrams(loop) > 0.9 and degenerate(loop, 192)
    assert degenerate([], 192)
    varied = list(range(100))
    assert repeated_fourgrams(varied) == 0 and not degenerate(varied, 192)


def test_paired_intervals():
    diff, low, high = paired_accuracy_interval([True] * 10 + [False] * 10,
                                               [True] * 12 + [False] * 8)
    assert diff == -0.1 and low < diff < high
    assert paired_accuracy_interval([True, False], [True, False]) == (0.0, 0.0, 0.0)
    mean, low, high = paired_mean_interval([1.0, 2.0, 3.0], [0.5, 1.5, 2.0])
    assert math.isclose(mean, 2 / 3, abs_tol=1e-4) and low < mean < high
