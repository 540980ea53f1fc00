"""Engine-wide limits on what multiplies one request's work (``RequestLimits``: the
``diffusion_max_*`` keys of ``--additional-config``, checked at start-up), and the admission
checks that refuse a request over one with HTTP 400 naming the limit and its value
(docs/limits.md, "Per-request limits"). The policies' step limits are options of their
configs (``policies/parts/strategy_config.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, NoReturn

from vllm.exceptions import VLLMValidationError

from vllm_diffusion.options import Rule, option

KEY_PREFIX = "diffusion_"  # a limit's additional_config key: the prefix and its field name
CHARS_PER_TOKEN = 16  # bad words' characters per token of the limit, checked untokenized


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The largest values a request may ask for (docs/limits.md)."""

    max_n: int = option(16, Rule(int, low=1, high=16384))
    max_bad_words: int = option(64, Rule(int, low=0, high=1 << 16))
    max_bad_word_tokens: int = option(1024, Rule(int, low=0, high=1 << 24))
    max_grammar_chars: int = option(65536, Rule(int, low=1, high=1 << 30))

    def to_options(self) -> dict[str, int]:
        """The limits as ``additional_config`` keys (``parse_request_limits`` takes them)."""
        return {KEY_PREFIX + name: value for name, value in dataclasses.asdict(self).items()}


LIMIT_KEYS = tuple(KEY_PREFIX + field.name for field in dataclasses.fields(RequestLimits))


def parse_request_limits(values: dict[str, Any], source: str) -> RequestLimits:
    """Take the limits' keys out of ``values`` (``additional_config``) and check each."""
    checked = {}
    for field in dataclasses.fields(RequestLimits):
        key = KEY_PREFIX + field.name
        if key in values:
            checked[field.name] = field.metadata["rule"].check(key, values.pop(key), source)
    return RequestLimits(**checked)


def _refuse(parameter: str, what: str, limit: str, value: int) -> NoReturn:
    raise VLLMValidationError(
        f"{what}, more than this server allows: {KEY_PREFIX}{limit}={value} (an engine-wide "
        f"--additional-config option)", parameter=parameter)


def grammar_chars(wanted: Any) -> dict[str, int]:
    """The characters of each text a structured-output constraint is built from (a JSON
    schema given as an object counts as its JSON text)."""
    if wanted is None:
        return {}
    texts = {}
    for name in ("json", "regex", "grammar", "structural_tag", "whitespace_pattern"):
        value = getattr(wanted, name, None)
        if isinstance(value, Mapping):
            value = json.dumps(value)
        if isinstance(value, str):
            texts[name] = len(value)
    if wanted.choice:
        texts["choice"] = sum(len(str(choice)) for choice in wanted.choice)
    return texts


def check_request_limits(params: Any, limits: RequestLimits) -> None:
    """What can be checked before vLLM tokenizes bad words or builds a grammar: ``n``, the
    bad words and their characters, the size of the structured-output constraint."""
    if params.n > limits.max_n:
        _refuse("n", f"n={params.n} asks for {params.n} outputs, each decoded as a request "
                     "of its own", "max_n", limits.max_n)
    words = len(params.bad_words or ())
    if words > limits.max_bad_words:
        _refuse("bad_words", f"bad_words holds {words} words", "max_bad_words",
                limits.max_bad_words)
    chars = sum(map(len, params.bad_words or ()))
    if chars > CHARS_PER_TOKEN * limits.max_bad_word_tokens:
        _refuse("bad_words", f"bad_words hold {chars} characters, which cannot tokenize "
                             f"within the token limit unless their tokens average more than "
                             f"{CHARS_PER_TOKEN} characters", "max_bad_word_tokens",
                limits.max_bad_word_tokens)
    texts = grammar_chars(params.structured_outputs)
    if sum(texts.values()) > limits.max_grammar_chars:
        parts = " + ".join(f"{name} {count}" for name, count in texts.items())
        _refuse("structured_outputs",
                f"structured_outputs: the constraint has {sum(texts.values())} characters "
                f"({parts})", "max_grammar_chars", limits.max_grammar_chars)


def check_bad_word_tokens(params: Any, limits: RequestLimits) -> None:
    """Once vLLM tokenized the bad words: their tokens together."""
    tokenizations = params.bad_words_token_ids or ()
    tokens = sum(len(word) for word in tokenizations)
    if tokens > limits.max_bad_word_tokens:
        _refuse("bad_words", f"bad_words tokenize to {tokens} tokens ({len(tokenizations)} "
                             "tokenizations, each word with and without a leading space)",
                "max_bad_word_tokens", limits.max_bad_word_tokens)
