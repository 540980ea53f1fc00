"""Long-prompt retrieval: secret numbers planted in filler text, one of them asked for.

A prompt is a passage of filler stories (the corpus's ``filler`` family) with one to
three sentences ``The secret number of the <adjective> <noun> is <NNNN>.`` planted at
random sentence boundaries, followed by ``What is the secret number of the <key>?``.
The expected response is the four digits of that key's number; scoring is exact match.

The passage length is given in words (``filler_words``), so the same generator serves
training at mixed lengths and benchmarks at fixed ones (calibrate words to tokens with
the model's tokenizer). The held-out split is by hash of the family and the expected
response, as for every other family (``corpus.is_eval_problem``).
"""

from __future__ import annotations

import random

from vllm_diffusion_lab.quality import corpus

FAMILY = "retrieval"
_ADJECTIVES = ("red", "blue", "green", "small", "big", "happy", "quiet", "fast", "old",
               "new", "warm", "cold", "bright", "dark", "soft", "tiny", "brave", "lazy")
_NOUNS = ("fox", "cat", "dog", "bird", "tree", "boat", "star", "moon", "cup", "hat",
          "river", "house", "bell", "kite", "lamp", "drum", "rose", "frog", "bear", "train")


def _filler_sentences(rng: random.Random, words: int) -> list[str]:
    sentences: list[str] = []
    count = 0
    while count < words:
        for sentence in corpus.filler_story(rng).split(". "):
            sentence = sentence if sentence.endswith(".") else sentence + "."
            sentences.append(sentence)
            count += len(sentence.split())
    return sentences


def retrieval_problem(rng: random.Random, filler_words: int) -> tuple[str, str]:
    """(prompt, expected response) with a passage of about ``filler_words`` words."""
    keys = rng.sample([(a, n) for a in _ADJECTIVES for n in _NOUNS], rng.randint(1, 3))
    numbers = [str(rng.randint(1000, 9999)) for _ in keys]
    sentences = _filler_sentences(rng, filler_words)
    slots = sorted(rng.sample(range(len(sentences) + 1), len(keys)), reverse=True)
    for slot, (adjective, noun), number in zip(slots, keys, numbers):
        sentences.insert(slot, f"The secret number of the {adjective} {noun} is {number}.")
    asked = rng.randrange(len(keys))
    adjective, noun = keys[asked]
    prompt = " ".join(sentences) + f"\nWhat is the secret number of the {adjective} {noun}?"
    return prompt, numbers[asked]


def retrieval_examples(n: int, seed: int, filler_words: tuple[int, int],
                       split: str = "eval") -> list[corpus.Example]:
    """``n`` problems of ``split`` with passages of ``filler_words`` = (min, max) words."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    low, high = filler_words
    if not 0 <= low <= high:
        raise ValueError(f"filler_words must be (min, max) with 0 <= min <= max, got {filler_words}")
    rng = random.Random(seed)
    examples: list[corpus.Example] = []
    while len(examples) < n:
        prompt, answer = retrieval_problem(rng, rng.randint(low, high))
        if corpus.is_eval_problem(FAMILY, answer) == (split == "eval"):
            examples.append(corpus.Example(FAMILY, prompt, answer))
    return examples
