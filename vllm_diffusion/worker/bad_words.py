"""``bad_words`` in block decoding: no bad word ever appears in the committed output.
Tokens completing a word with the decided tokens on either side are barred
(``barred_tokens``); a word completed within one step is undone (``positions_to_undo``).
Positions index the output, ``UNDECIDED`` where undecided; docs/architecture.md, "Bad words".
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

UNDECIDED = -1


class BadWords(Sequence):
    """A request's bad words (token id lists) as a sequence, indexed by last token
    (``ending_in``) and, for words of two tokens or more, by next-to-last token
    (``before_last``), each group sorted by length, lengths alongside (for ``bisect``)."""

    def __init__(self, words: Sequence[Sequence[int]]) -> None:
        # vLLM's lists as they are (copying a long word each step would cost its length)
        self.words = [word if isinstance(word, list) else list(word) for word in words]
        self.one_token = frozenset(word[0] for word in self.words if len(word) == 1)
        self.longest = max(map(len, self.words), default=0)
        self.ending_in: dict[int, list[list[int]]] = {}
        self.before_last: dict[int, list[list[int]]] = {}
        for word in sorted(self.words, key=len):
            self.ending_in.setdefault(word[-1], []).append(word)
            if len(word) > 1:
                self.before_last.setdefault(word[-2], []).append(word)
        self.ending_in_lengths = {t: [len(w) for w in group]
                                  for t, group in self.ending_in.items()}
        self.before_last_lengths = {t: [len(w) for w in group]
                                    for t, group in self.before_last.items()}

    def __getitem__(self, index):
        return self.words[index]

    def __len__(self) -> int:
        return len(self.words)


def indexed(words: Sequence[Sequence[int]]) -> BadWords:
    """``words`` as a ``BadWords`` (itself if it is one)."""
    return words if isinstance(words, BadWords) else BadWords(words)


def barred_tokens(context: list[int], index: int, words: Sequence[Sequence[int]]
                  ) -> set[int]:
    """Tokens that would complete a word at output position ``index`` of ``context`` (the
    output so far). ``words``: a ``BadWords`` (indexed once for many positions), or words."""
    words = indexed(words)
    size = len(context)
    if not 0 <= index < size:
        return set()
    barred = set(words.one_token)
    # ``index`` is the word's last position: the tokens before it end at index - 1.
    if index >= 1 and (group := words.before_last.get(context[index - 1])):
        fitting = bisect_right(words.before_last_lengths[context[index - 1]], index + 1)
        for word in group[:fitting]:  # start = index - len + 1 >= 0
            if context[index + 1 - len(word):index - 1] == word[:-2]:
                barred.add(word[-1])
    # The word ends at ``end`` > index: every position between is decided, in the block.
    end, last_end = index + 1, min(size, index + words.longest)
    while end < last_end and context[end] != UNDECIDED:
        if group := words.ending_in.get(context[end]):
            lengths = words.ending_in_lengths[context[end]]
            distance = end - index  # the word covers index: len > distance; start >= 0
            for word in group[bisect_left(lengths, distance + 1):
                              bisect_right(lengths, end + 1)]:
                offset = len(word) - 1 - distance  # index is the word's offset-th token
                if (context[index - offset:index] == word[:offset]
                        and context[index + 1:end] == word[offset + 1:-1]):
                    barred.add(word[offset])
        end += 1
    return barred


def positions_to_undo(context: list[int], changed: list[int],
                      words: Sequence[Sequence[int]]) -> list[int]:
    """Output positions whose change this step must be undone: for every occurrence of a
    word in ``context`` (the output after the step) that covers a position in ``changed``,
    the rightmost such position. Sorted, without repeats. ``words`` as ``barred_tokens``."""
    if not changed:
        return []
    words = indexed(words)
    ordered = sorted(set(changed))
    low, high = ordered[0], ordered[-1]
    undo = set()
    # An occurrence ends at ``end`` >= low and starts at or before high.
    for end in range(max(low, 0), min(len(context), high + words.longest)):
        group = words.ending_in.get(context[end])
        if not group:
            continue
        lengths = words.ending_in_lengths[context[end]]
        for word in group[bisect_left(lengths, end - high + 1):
                          bisect_right(lengths, end + 1)]:
            start = end + 1 - len(word)
            if context[start:end + 1] == word:
                rightmost = ordered[bisect_right(ordered, end) - 1]
                if rightmost >= start:
                    undo.add(rightmost)
    return sorted(undo)


def barred_tokens_plain(context: list[int], index: int, words: Sequence[Sequence[int]]
                        ) -> set[int]:
    """``barred_tokens`` as a plain loop over every word and offset (the reference)."""
    barred = set()
    for word in words:
        length = len(word)
        for offset in range(length):  # index is the word's offset-th token
            start = index - offset
            if start < 0 or start + length > len(context):
                continue
            if all(context[start + j] == word[j] for j in range(length) if j != offset):
                barred.add(word[offset])
    return barred


def positions_to_undo_plain(context: list[int], changed: list[int],
                            words: Sequence[Sequence[int]]) -> list[int]:
    """``positions_to_undo`` as a plain loop over every word and start (the reference)."""
    if not changed:
        return []
    changed_set, undo = set(changed), set()
    low, high = min(changed), max(changed)
    for word in words:
        word, length = list(word), len(word)
        for start in range(max(0, low - length + 1), min(high, len(context) - length) + 1):
            if context[start:start + length] != word:
                continue
            inside = [p for p in range(start, start + length) if p in changed_set]
            if inside:
                undo.add(inside[-1])
    return sorted(undo)


def undo_completed_words(context: list[int], first_output: int,
                         words: Sequence[Sequence[int]], commits, edits, before, after,
                         mask_token_id: int) -> None:
    """Apply ``positions_to_undo`` to one block's step decisions, in place, until no
    occurrence is left. context: the output before the step; first_output: the block's
    first output index; commits, edits: [B] bool; before, after: [B] int64 tokens."""
    words = indexed(words)
    while True:
        context_after = list(context)
        for position, token in enumerate(after.tolist()):
            index = first_output + position
            if 0 <= index < len(context_after):
                context_after[index] = UNDECIDED if token == mask_token_id else token
        changed = [first_output + int(p) for p in (commits | edits).nonzero().flatten()]
        undo = positions_to_undo(context_after, changed, words)
        if not undo:
            return
        for index in undo:
            position = index - first_output
            commits[position] = edits[position] = False
            after[position] = before[position]
