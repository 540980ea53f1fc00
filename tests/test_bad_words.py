"""The bad-words matching (``worker/bad_words.py``): the plain loops against the
definition (a token is barred where writing it completes a word), the index against the
plain loops on a named grid of hand-made cases and seeded random ones (the same barred
tokens at every position and the same positions to undo), and the undo leaving no word.
Fast, no engine."""

from __future__ import annotations

import itertools
import random

import pytest

from vllm_diffusion.worker.bad_words import (
    UNDECIDED,
    BadWords,
    barred_tokens,
    barred_tokens_plain,
    positions_to_undo,
    positions_to_undo_plain,
)

U = UNDECIDED

# name: (context, words) -- U: undecided
BARRED_GRID = {
    "one-token-word": ([U, U, U], [[7]]),
    "left-context": ([3, 4, U, U], [[3, 4, 5]]),
    "right-context": ([U, 4, 5, U], [[3, 4, 5]]),
    "middle": ([3, U, 5], [[3, 4, 5], [9, 9]]),
    "undecided-neighbour": ([3, U, U], [[3, 4, 5]]),
    "repeated-token": ([9, U, 9], [[9, 9]]),
    "word-longer-than-context": ([3, 4, U], [[3, 4, 5, 6]]),
    "word-at-output-start": ([U, 4, 5, 6], [[3, 4, 5, 6]]),
    "decided-index-ignored": ([3, 8, 5], [[3, 4, 5]]),  # an editing row's own token
    "shared-last-token": ([1, 2, U, 2, 5], [[1, 2, 5], [2, 9, 2, 5], [3, 2, 5], [5]]),
    "shared-next-to-last": ([6, 1, 2, U], [[6, 1, 2, 7], [1, 2, 8], [9, 2, 4], [2, 3]]),
    "both-sides": ([1, U, 3, U, 5], [[1, 2, 3], [3, 4, 5], [2, 3, 4], [1, 2, 3, 4, 5]]),
    "overlapping-self": ([7, 7, U, 7, 7], [[7, 7, 7], [7, 7, 7, 7, 7]]),
    "duplicate-words": ([3, U, 5], [[3, 4, 5], [3, 4, 5]]),
    "decided-run-longer-than-words": ([U, 2, 3, 4, 5, 6, 7, 8], [[1, 2], [1, 2, 3]]),
    "empty-context": ([], [[1], [1, 2]]),
}


def barred_by_definition(context: list[int], index: int, words: list[list[int]]) -> set[int]:
    """The tokens t such that writing t at ``index`` makes some word appear whole in the
    context (a word appearing without ``index`` does not count)."""
    barred = set()
    for token in {t for w in words for t in w}:
        trial = list(context)
        trial[index] = token
        for word in words:
            for start in range(len(trial) - len(word) + 1):
                if start <= index < start + len(word) and trial[start:start + len(word)] == word:
                    barred.add(token)
    return barred


@pytest.mark.parametrize("name", BARRED_GRID)
def test_the_plain_loop_bars_what_the_definition_says(name):
    context, words = BARRED_GRID[name]
    for index in range(len(context)):
        assert barred_tokens_plain(context, index, words) == barred_by_definition(
            context, index, words), index


@pytest.mark.parametrize("name", BARRED_GRID)
def test_barred_tokens_equal_the_plain_loop(name):
    context, words = BARRED_GRID[name]
    index = BadWords(words)
    for position in range(-1, len(context) + 1):
        expected = barred_tokens_plain(context, position, words)
        assert barred_tokens(context, position, words) == expected, position
        assert barred_tokens(context, position, index) == expected, position


def random_case(seed: int, alphabet: int, length: int, count: int, longest: int,
                undecided: float) -> tuple[list[int], list[list[int]]]:
    """A context over ``alphabet`` tokens with a share of undecided positions, and words
    of which about half are cut from the context (so that they can match)."""
    rng = random.Random(seed)
    context = [rng.randrange(alphabet) for _ in range(length)]
    words = []
    for _ in range(count):
        size = rng.randint(1, longest)
        if rng.random() < 0.5 and size <= length:
            start = rng.randrange(length - size + 1)
            words.append(context[start:start + size])
        else:
            words.append([rng.randrange(alphabet) for _ in range(size)])
    context = [U if rng.random() < undecided else t for t in context]
    return context, words


# name: (alphabet, context length, words, longest word, share undecided)
RANDOM_GRID = {
    "binary-short-words": (2, 12, 6, 3, 0.3),
    "binary-long-words": (2, 16, 8, 10, 0.2),
    "small-alphabet-dense": (3, 24, 12, 5, 0.1),
    "small-alphabet-sparse": (3, 24, 12, 5, 0.6),
    "words-longer-than-output": (4, 10, 10, 20, 0.3),
    "large-alphabet": (50, 40, 20, 6, 0.25),
    "all-decided": (3, 20, 10, 6, 0.0),
}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", RANDOM_GRID)
def test_barred_tokens_equal_the_plain_loop_on_random_cases(name, seed):
    context, words = random_case(seed, *RANDOM_GRID[name])
    index = BadWords(words)
    for position in range(len(context)):
        assert (barred_tokens(context, position, index)
                == barred_tokens_plain(context, position, words)), (position, context, words)


# name: (context after the step, changed positions, words)
UNDO_GRID = {
    "nothing-changed": ([1, 2, 1, 2], [], [[1, 2]]),
    "one-occurrence": ([1, 2, U], [0, 1], [[1, 2]]),
    "occurrence-before-the-change": ([1, 2, 3], [2], [[1, 2]]),
    "occurrence-covering-old-and-new": ([1, 2, 3], [1], [[1, 2]]),
    "one-token-word": ([5, 1, 5], [2], [[5]]),
    "two-occurrences": ([1, 2, 1, 2], [0, 1, 2, 3], [[1, 2]]),
    "nested-words": ([3, 3, 3, 3], [1, 2, 3], [[3, 3], [3, 3, 3]]),
    "word-longer-than-context": ([1, 2], [0, 1], [[1, 2, 3]]),
    "rightmost-inside": ([4, 5, 6, 7], [0, 2], [[4, 5, 6], [5, 6, 7]]),
}


@pytest.mark.parametrize("name", UNDO_GRID)
def test_positions_to_undo_equal_the_plain_loop(name):
    context, changed, words = UNDO_GRID[name]
    expected = positions_to_undo_plain(context, changed, words)
    assert positions_to_undo(context, changed, words) == expected
    assert positions_to_undo(context, changed, BadWords(words)) == expected


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", RANDOM_GRID)
def test_positions_to_undo_equal_the_plain_loop_on_random_cases(name, seed):
    context, words = random_case(seed, *RANDOM_GRID[name])
    rng = random.Random(seed + 1000)
    decided = [p for p, t in enumerate(context) if t != U]
    for _ in range(6):
        changed = sorted(rng.sample(decided, rng.randint(0, len(decided))))
        assert (positions_to_undo(context, changed, words)
                == positions_to_undo_plain(context, changed, words)), (changed, context)


def test_the_index_groups_words_by_their_last_tokens_sorted_by_length():
    words = BadWords([[1, 2, 3], [3], [9, 2, 3, 3], [4, 3]])
    assert list(words) == [[1, 2, 3], [3], [9, 2, 3, 3], [4, 3]] and len(words) == 4
    assert words.one_token == {3} and words.longest == 4
    assert words.ending_in[3] == [[3], [4, 3], [1, 2, 3], [9, 2, 3, 3]]
    assert words.ending_in_lengths[3] == [1, 2, 3, 4]
    assert words.before_last == {4: [[4, 3]], 2: [[1, 2, 3]], 3: [[9, 2, 3, 3]]}


def test_positions_to_undo_breaks_every_occurrence_made_in_one_step():
    words = [[1, 2], [3, 3, 3]]
    for after in itertools.product([1, 2, 3], repeat=5):
        changed = [1, 2, 3, 4]  # position 0 was decided before the step
        context = list(after)
        while undo := positions_to_undo(context, changed, words):
            for index in undo:
                context[index] = UNDECIDED
                changed.remove(index)
        text = [context[i:i + 2] for i in range(4)] + [context[i:i + 3] for i in range(3)]
        assert [1, 2] not in text and [3, 3, 3] not in text
        if context[0:2] != [1, 2]:  # only occurrences covering a change are undone
            assert changed, after  # something of the step is kept


class CountedWord(list):
    """A word that counts the slices taken of it (the index compares words by slices)."""

    slices = 0

    def __getitem__(self, item):
        if isinstance(item, slice):
            CountedWord.slices += 1
        return super().__getitem__(item)


def test_words_longer_than_the_output_are_never_compared():
    """64 words of 5,000 tokens, each ending in tokens the output holds: at every
    position of a block after 40 output tokens none is compared, barring or undoing; a
    short word that can end at a position is compared there once."""
    rng = random.Random(0)
    output = [rng.randrange(8) for _ in range(40)]
    long_words = [CountedWord([rng.randrange(8) for _ in range(4998)] + output[i:i + 2])
                  for i in range(0, 32, 2)] * 4
    context = output + [U, output[1], U, U]
    words = BadWords(long_words)
    CountedWord.slices = 0
    for index in range(len(context)):
        barred_tokens(context, index, words)
    assert positions_to_undo(output, list(range(30, 40)), words) == []
    assert CountedWord.slices == 0
    short = CountedWord([output[39], 9])  # 9: a token the output does not hold
    words = BadWords([*long_words, short])
    assert barred_tokens(context, 40, words) == {9} and CountedWord.slices == 1
