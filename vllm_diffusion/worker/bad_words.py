"""``bad_words`` in block decoding: no bad word ever appears in the committed output.

vLLM tokenizes each word (with and without a leading space) into
``SamplingParams.bad_words_token_ids`` and, autoregressively, bars a word's last token
when the output ends with the rest of it. Block decoding fills positions in any order and
several in one step, so here:

- at every computed position, a token is barred when placing it there would complete a
  word whose other tokens already sit, decided, at the neighbouring output positions (on
  either side: a word's last token may be decided before its first); a one-token word is
  barred everywhere (``barred_tokens``, the logit stage);
- a step that commits or edits several positions can still complete a word from tokens
  decided in the same step; then the rightmost position of that occurrence changed in
  the step is left as it was (masked, or its old token), and the next step bars the token
  there (``positions_to_undo``, applied after the policy's choice). Each occurrence has at
  least two positions changed in the step, so every step still commits something.

Only the output counts, as in vLLM: a word may occur in the prompt, and an occurrence may
not reach into it. Output positions are indices into the output (0: the first token after
the prompt); undecided positions hold -1.
"""

from __future__ import annotations

UNDECIDED = -1


def barred_tokens(context: list[int], index: int, words: list[list[int]]) -> set[int]:
    """Tokens that would complete a word at output position ``index`` of ``context`` (the
    output so far, ``UNDECIDED`` where not decided)."""
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


def positions_to_undo(context: list[int], changed: list[int], words: list[list[int]]
                      ) -> list[int]:
    """Output positions whose change this step must be undone: for every occurrence of a
    word in ``context`` (the output after the step) that covers a position in ``changed``,
    the rightmost such position. Sorted, without repeats."""
    changed_set = set(changed)
    undo = set()
    if not changed:
        return []
    low, high = min(changed), max(changed)
    for word in words:
        length = len(word)
        for start in range(max(0, low - length + 1), min(high, len(context) - length) + 1):
            if context[start:start + length] != word:
                continue
            inside = [p for p in range(start, start + length) if p in changed_set]
            if inside:
                undo.add(inside[-1])
    return sorted(undo)


def undo_completed_words(context: list[int], first_output: int, words: list[list[int]],
                         commits, edits, before, after, mask_token_id: int) -> None:
    """Apply ``positions_to_undo`` to one block's step decisions, in place, until no
    occurrence is left. context: the output before the step (``UNDECIDED`` where masked);
    first_output: the output index of the block's first position; commits, edits: [B]
    bool; before, after: [B] int64 the block's tokens before and after the step."""
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
