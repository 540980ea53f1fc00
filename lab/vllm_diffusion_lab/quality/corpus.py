"""Seeded chat corpus of small tasks whose answers can be checked exactly.

Every example is one user prompt and the full expected assistant response.
Families with worked steps (``arithmetic``, ``count``) end with the line
``The answer is N.`` and are scored on that number; the other checked
families are scored by exact match. ``filler`` is templated narrative used
only for training.

Train/eval separation: each problem is assigned to a split by a stable hash
of its family and expected response, so a prompt (and even a re-worded
prompt with the same answer) can never be in both splits, whatever the
number of examples drawn from either.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Callable

CHECKED_FAMILIES: tuple[str, ...] = (
    "arithmetic", "repeat", "count", "range", "sort", "reverse", "json",
)
TRAIN_FAMILIES: tuple[str, ...] = CHECKED_FAMILIES + ("filler",)
NUMERIC_FAMILIES: frozenset[str] = frozenset({"arithmetic", "count"})

TRAIN_SEED = 20240611
EVAL_SEED = 777
TRAIN_SIZE = 60_000
# Relative sampling weights; arithmetic is the hardest family, filler the least useful.
FAMILY_WEIGHTS: dict[str, float] = {
    "arithmetic": 3.0, "repeat": 1.0, "count": 1.5, "range": 1.0,
    "sort": 1.5, "reverse": 1.5, "json": 1.0, "filler": 0.75,
}
# One problem in _EVAL_BUCKETS is reserved for evaluation.
_EVAL_BUCKETS = 16


@dataclass(frozen=True)
class Example:
    family: str
    prompt: str
    answer: str


# ----------------------------------------------------------------- word pools
_NAMES = ("Ana", "Ben", "Mia", "Leo", "Sara", "Tom", "Eva", "Omar", "Lily", "Sam",
          "Nora", "Ivan", "Zoe", "Max", "Rosa", "Kai", "Emma", "Jack", "Lena", "Noah")
_PRONOUN = {name: ("she" if name in {"Ana", "Mia", "Sara", "Eva", "Lily", "Nora", "Zoe",
                                     "Rosa", "Emma", "Lena"} else "he") for name in _NAMES}
_ITEMS = ("apples", "coins", "books", "pens", "stickers", "marbles", "cards", "shells",
          "cookies", "stamps", "candles", "buttons", "pencils", "rocks", "flowers")
_WORDS = ("apple", "river", "planet", "garden", "window", "yellow", "orange", "silver",
          "rabbit", "turtle", "castle", "bridge", "pocket", "candle", "forest", "winter",
          "summer", "spring", "autumn", "dragon", "pirate", "rocket", "basket", "circle",
          "jungle", "mirror", "puzzle", "shadow", "guitar", "island", "tiger", "horse",
          "cloud", "stone", "music", "bread", "table", "chair", "light", "water", "green",
          "house", "mouse", "plant", "sugar", "smile", "ocean", "night", "paper", "lemon",
          "sun", "cat", "dog", "hat", "cup", "box", "map", "key", "egg", "owl", "fox", "bee",
          "moon", "star", "tree", "bird", "fish", "frog", "lamp", "door", "boat", "kite",
          "banana", "tomato", "pepper", "carrot", "cheese", "butter", "muffin", "cactus",
          "violet", "purple", "monkey", "donkey", "parrot", "spider", "beetle", "salmon",
          "school", "friend", "letter", "number", "animal", "little", "simple", "gentle",
          "bottle", "pillow", "blanket", "kitchen", "morning", "evening", "holiday",
          "picture", "rainbow", "thunder", "weather", "library", "teacher", "balloon")
_ADJECTIVES = ("red", "blue", "green", "small", "big", "happy", "quiet", "fast", "old",
               "new", "warm", "cold", "bright", "dark", "soft", "tiny", "brave", "lazy")
_NOUNS = ("fox", "cat", "dog", "bird", "tree", "boat", "star", "moon", "cup", "hat",
          "river", "house", "bell", "kite", "lamp", "drum", "rose", "frog", "bear", "train")
_JSON_FIELDS: dict[str, Callable[[random.Random], str | int]] = {
    "name": lambda rng: rng.choice(_NAMES),
    "age": lambda rng: rng.randint(5, 90),
    "city": lambda rng: rng.choice(("Lima", "Oslo", "Rome", "Paris", "Cairo", "Tokyo", "Quito",
                                    "Delhi", "Seoul", "Madrid", "Berlin", "Dublin")),
    "color": lambda rng: rng.choice(_ADJECTIVES[:3] + ("black", "white", "pink", "gray")),
    "pet": lambda rng: rng.choice(("cat", "dog", "fish", "bird", "rabbit", "turtle")),
    "score": lambda rng: rng.randint(0, 100),
    "year": lambda rng: rng.randint(1950, 2030),
    "count": lambda rng: rng.randint(0, 50),
    "fruit": lambda rng: rng.choice(("apple", "banana", "lemon", "mango", "pear", "plum")),
    "size": lambda rng: rng.choice(("small", "medium", "large")),
    "id": lambda rng: rng.randint(1, 999),
    "day": lambda rng: rng.choice(("monday", "tuesday", "friday", "sunday")),
}


# ------------------------------------------------------------- task families
def _arithmetic(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    pronoun = _PRONOUN[name]
    value = rng.randint(2, 20)
    story, recipe, steps = [f"{name} has {value} {item}."], [f"Start with {value}"], []
    for _ in range(rng.randint(2, 3)):
        choices = ["add", "sub"] + (["mul"] if value <= 30 else [])
        op = rng.choice(choices) if value > 0 else "add"
        if op == "add":
            n = rng.randint(1, 15)
            result, sign = value + n, "+"
            story.append(rng.choice((f"Then {pronoun} buys {n} more.",
                                     f"Then {pronoun} finds {n} more.",
                                     f"A friend gives {name} {n} more.")))
            recipe.append(f"add {n}")
        elif op == "sub":
            n = rng.randint(1, value)
            result, sign = value - n, "-"
            story.append(rng.choice((f"Then {pronoun} gives away {n}.",
                                     f"Then {pronoun} loses {n}.",
                                     f"Then {pronoun} uses {n}.")))
            recipe.append(f"subtract {n}")
        else:
            n = rng.randint(2, 4)
            result, sign = value * n, "*"
            word = {2: "doubles", 3: "triples", 4: "becomes four times as large"}[n]
            story.append(f"Then the number of {item} {word}.")
            recipe.append(f"multiply by {n}")
        steps.append(f"{value} {sign} {n} = {result}")
        value = result
    if rng.random() < 0.3:
        prompt = ", ".join(recipe[:-1]) + f", then {recipe[-1]}. What number do you get?"
    else:
        prompt = " ".join(story) + f" How many {item} does {name} have now?"
    return prompt, "\n".join(steps) + f"\nThe answer is {value}."


def _repeat(rng: random.Random) -> tuple[str, str]:
    phrase = rng.choice(_NOUNS) if rng.random() < 0.3 else f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    times = rng.randint(2, 6)
    prompt = rng.choice((f'Repeat the phrase "{phrase}" {times} times.',
                         f'Say "{phrase}" {times} times, separated by commas.',
                         f'Write "{phrase}" {times} times.'))
    return prompt, ", ".join([phrase] * times)


def _count(rng: random.Random) -> tuple[str, str]:
    mode = rng.random()
    if mode < 0.4:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 8))]
        sentence = " ".join(words)
        prompt = rng.choice((f'How many words are in "{sentence}"?',
                             f'Count the words in "{sentence}".'))
        steps = ", ".join(f"{word} {i}" for i, word in enumerate(words, start=1))
        return prompt, f"{steps}\nThe answer is {len(words)}."
    word = rng.choice(_WORDS)
    if mode < 0.7:
        prompt = rng.choice((f'How many letters are in the word "{word}"?',
                             f'Count the letters in "{word}".'))
        steps = ", ".join(f"{letter} {i}" for i, letter in enumerate(word, start=1))
        return prompt, f"{steps}\nThe answer is {len(word)}."
    letter = rng.choice(word) if rng.random() < 0.8 else rng.choice("aeioust")
    prompt = f'How many times does the letter "{letter}" appear in "{word}"?'
    seen, parts = 0, []
    for char in word:
        if char == letter:
            seen += 1
            parts.append(f"{char} {seen}")
        else:
            parts.append(char)
    return prompt, f"{', '.join(parts)}\nThe answer is {seen}."


def _range(rng: random.Random) -> tuple[str, str]:
    start, length = rng.randint(0, 200), rng.randint(2, 12)
    stop = start + length - 1
    if rng.random() < 0.25:
        prompt = f"Count down from {stop} to {start}."
        numbers = range(stop, start - 1, -1)
    else:
        prompt = rng.choice((f"List the integers from {start} to {stop}.",
                             f"Count from {start} to {stop}."))
        numbers = range(start, stop + 1)
    return prompt, ", ".join(str(n) for n in numbers)


def _sort(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 7))]
    listed = ", ".join(str(n) for n in numbers)
    prompt = rng.choice((f"Sort these numbers in ascending order: {listed}.",
                         f"Sort from smallest to largest: {listed}."))
    return prompt, ", ".join(str(n) for n in sorted(numbers))


def _reverse(rng: random.Random) -> tuple[str, str]:
    mode = rng.random()
    if mode < 0.3:
        word = rng.choice(_WORDS)
        prompt = rng.choice((f'Spell the word "{word}" letter by letter.', f'Spell "{word}".'))
        return prompt, " ".join(word)
    if mode < 0.6:
        word = rng.choice(_WORDS)
        prompt = rng.choice((f'Spell the word "{word}" backwards, letter by letter.',
                             f'Reverse the letters of "{word}".'))
        return prompt, " ".join(reversed(word))
    letters = [rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 7))]
    prompt = f"Reverse this sequence of letters: {' '.join(letters)}"
    return prompt, " ".join(reversed(letters))


def _json(rng: random.Random) -> tuple[str, str]:
    keys = rng.sample(sorted(_JSON_FIELDS), rng.randint(2, 4))
    values = [_JSON_FIELDS[key](rng) for key in keys]
    listed = "; ".join(f"{key}: {value}" for key, value in zip(keys, values))
    prompt = rng.choice((f"Format these fields as a compact JSON object: {listed}.",
                         f"Write a compact JSON object with {listed}."))
    body = ",".join(f'"{key}":{value}' if isinstance(value, int) else f'"{key}":"{value}"'
                    for key, value in zip(keys, values))
    return prompt, "{" + body + "}"


def _filler(rng: random.Random) -> tuple[str, str]:
    name, animal = rng.choice(_NAMES), rng.choice(_NOUNS[:4] + ("rabbit", "turtle", "owl", "horse"))
    place = rng.choice(("near a quiet river", "in a big forest", "on a small island",
                        "behind an old house", "in a sunny garden", "at the edge of a town"))
    habit = rng.choice(("looked for food", "sang a little song", "watched the clouds",
                        "ran along the path", "visited a friend", "counted the stars"))
    event = rng.choice(("found a shiny stone", "met a lost bird", "saw a rainbow",
                        "heard a strange noise", "got caught in the rain", "discovered a hidden door"))
    ending = rng.choice(("From that day on, it was never bored again.",
                         "It went home happy and slept well.",
                         "It told the story to everyone it met.",
                         "It decided to come back the next day."))
    time = rng.choice(("morning", "evening", "day", "night"))
    prompt = rng.choice((f"Tell a short story about a {animal}.",
                         f"Write a few sentences about a {animal} named {name}."))
    story = (f"{name} the {animal} lived {place}. Every {time}, it {habit}. "
             f"One day it {event}. {ending}")
    return prompt, story


def filler_story(rng: random.Random) -> str:
    """A four-sentence filler story (the ``filler`` family's response)."""
    return _filler(rng)[1]


_GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "arithmetic": _arithmetic, "repeat": _repeat, "count": _count, "range": _range,
    "sort": _sort, "reverse": _reverse, "json": _json, "filler": _filler,
}


# ------------------------------------------------------------------ splitting
def is_eval_problem(family: str, answer: str) -> bool:
    """Whether a problem belongs to the held-out split (stable across runs and machines)."""
    digest = hashlib.blake2b(f"{family}\x00{answer}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _EVAL_BUCKETS == 0


def generate_examples(
    n: int,
    seed: int,
    families: tuple[str, ...] = TRAIN_FAMILIES,
    split: str = "train",
    family_weights: dict[str, float] | None = None,
) -> list[Example]:
    """Draw ``n`` examples from ``split`` ("train" or "eval"), families mixed by
    ``family_weights`` (default ``FAMILY_WEIGHTS``; a partial mapping overrides those).

    Eval examples are unique by prompt; train examples may repeat.
    """
    unknown = set(families) - set(_GENERATORS)
    if unknown:
        raise ValueError(f"unknown families {sorted(unknown)}; known: {sorted(_GENERATORS)}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if split == "eval" and "filler" in families:
        raise ValueError("filler has no checkable answer and is training-only")
    rng = random.Random(seed)
    chosen = {**FAMILY_WEIGHTS, **(family_weights or {})}
    unknown_weights = set(family_weights or {}) - set(_GENERATORS)
    if unknown_weights:
        raise ValueError(f"weights for unknown families {sorted(unknown_weights)}")
    weights = [chosen[family] for family in families]
    examples: list[Example] = []
    seen_prompts: set[str] = set()
    attempts = 0
    while len(examples) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            raise RuntimeError(f"could not draw {n} {split} examples from {families}")
        family = rng.choices(families, weights=weights)[0]
        prompt, answer = _GENERATORS[family](rng)
        held_out = family != "filler" and is_eval_problem(family, answer)
        if held_out != (split == "eval"):
            continue
        if split == "eval":
            if prompt in seen_prompts:
                continue
            seen_prompts.add(prompt)
        examples.append(Example(family, prompt, answer))
    return examples


def train_examples(n: int = TRAIN_SIZE,
                   family_weights: dict[str, float] | None = None) -> list[Example]:
    """The deterministic training set (all families, filler included); ``family_weights``
    reweights families (e.g. more of a weak one) for a later training stage."""
    return generate_examples(n, TRAIN_SEED, TRAIN_FAMILIES, split="train",
                             family_weights=family_weights)


def eval_examples(n_per_family: int, families: tuple[str, ...] = CHECKED_FAMILIES) -> list[Example]:
    """``n_per_family`` unique held-out examples of each checked family, grouped by family."""
    examples: list[Example] = []
    for index, family in enumerate(families):
        examples += generate_examples(n_per_family, EVAL_SEED + index, (family,), split="eval")
    return examples


def mixed_eval_examples(n: int) -> list[Example]:
    """``n`` held-out examples with the checked families interleaved, so that any prefix
    of the list is a mix of families (a workload for benchmarks)."""
    per_family = -(-n // len(CHECKED_FAMILIES))
    examples = eval_examples(per_family)
    by_family = [examples[i:i + per_family] for i in range(0, len(examples), per_family)]
    return [example for row in zip(*by_family) for example in row][:n]


# -------------------------------------------------------------------- scoring
_FINAL_NUMBER = re.compile(r"The answer is (-?\d+)")


def final_number(text: str) -> int | None:
    """The number in the first ``The answer is N`` of ``text``, or None."""
    match = _FINAL_NUMBER.search(text)
    return int(match.group(1)) if match else None


def score(family: str, expected_answer: str, generated_text: str) -> bool:
    """Whether ``generated_text`` solves the problem whose full expected response is ``expected_answer``."""
    if family in NUMERIC_FAMILIES:
        got = final_number(generated_text)
        return got is not None and got == final_number(expected_answer)
    return generated_text.strip() == expected_answer.strip()
