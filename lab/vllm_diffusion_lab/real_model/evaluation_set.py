"""The evaluation set for SmolLM2-135M-Instruct (the autoregressive original) and its
block-diffusion conversion: prompts on which the two models' answers are compared.

Written by hand for this project; the prompts are data (``evaluation_set.json``). It has
two parts:

* ``DEFINITE_QUESTIONS``: questions with one short, definite answer, pitched at what a
  135M-parameter chat model can know (capitals of well-known countries, colours, opposites,
  plurals, animals, basic science, calendar facts, single-digit arithmetic, famous authors
  and inventors, languages, units, simple spelling). Each carries the accepted answer
  strings; ``score_definite`` counts an answer correct when any accepted string occurs in
  it, case-insensitively, as a whole word or phrase (so "7" does not match "17" and "Au"
  does not match "August"). No accepted string occurs in its own prompt, so echoing the
  question scores nothing.
* ``OPEN_REQUESTS``: open requests (advice, explanation, opinion, short creative writing,
  planning, how-to, description, brainstorming, rewriting a given sentence, everyday
  conversation), not scored here; they are for side-by-side reading and for judged or
  reference-based comparison.

The prompts are disjoint from the training prompts: they were written without the
templates of ``training_prompts`` (advice as "How can I ...", "Explain ...", "Write a poem
/ story / email ...", "List five ...", summaries, arithmetic word problems, JSON and bullet
conversions, "What does the word X mean?", comparisons) and avoid those phrasings. They are
also disjoint from the chat benchmark set (``quality.chat_set.OTHER_KIND_PROMPTS``): none
equals or closely paraphrases one of its prompts.
"""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DefiniteQuestion:
    """A question with one definite short answer; ``answers`` are the accepted strings."""

    prompt: str
    answers: tuple[str, ...]
    kind: str


_DATA = json.loads(pathlib.Path(__file__).with_suffix(".json").read_text())
DEFINITE_QUESTIONS: tuple[DefiniteQuestion, ...] = tuple(
    DefiniteQuestion(q["prompt"], tuple(q["answers"]), q["kind"]) for q in _DATA["definite"])
OPEN_REQUESTS: tuple[str, ...] = tuple(_DATA["open"])


def evaluation_prompts() -> list[str]:
    """Every prompt of the set: the definite questions first, then the open requests."""
    return [q.prompt for q in DEFINITE_QUESTIONS] + list(OPEN_REQUESTS)


def _occurs(accepted: str, text: str) -> bool:
    """Whether ``accepted`` occurs in ``text`` ignoring case; an end of ``accepted`` that is
    a letter or digit must not run on into another letter or digit of ``text``."""
    needle = accepted.strip().lower()
    if not needle:
        return False
    pattern = re.escape(needle)
    if re.match(r"\w", needle):
        pattern = r"(?<!\w)" + pattern
    if re.search(r"\w$", needle):
        pattern = pattern + r"(?!\w)"
    return re.search(pattern, text.lower()) is not None


def score_definite(question: DefiniteQuestion, answer: str) -> bool:
    """True when any of ``question.answers`` occurs in ``answer`` (case-insensitive, as a
    whole word or phrase: "7" does not match "17", "Au" does not match "August")."""
    return any(_occurs(accepted, answer) for accepted in question.answers)
