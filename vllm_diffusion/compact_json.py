"""Compact JSON for the plugin's models: a ``json_object`` or ``json_schema`` request's
grammar allows no whitespace between JSON tokens (inside strings it stays text), unless
the engine option ``diffusion_json_any_whitespace`` (``--additional-config``, bool,
default false) allows it.

Why: a diffusion model proposes every masked position of a block at once, and where the
grammar allows unlimited whitespace between JSON tokens, whitespace is an easy proposal
for the positions the model is unsure of; requests then wander in whitespace up to
``max_tokens``. Instructor-style extraction of a three-item list on the default model
validated 0/20 with any whitespace and 5/20 compact (``benchmarks/RESULTS.md``, "Compact
JSON grammars"). xgrammar 0.2.8 still allows one space after a comma (xgrammar#945).

How: vLLM's rollback-capable structured-output backends (xgrammar, llguidance) read the
engine-wide ``StructuredOutputsConfig.disable_any_whitespace`` when they compile a JSON
grammar (vLLM 0.32 reads no per-request field for it); the config hook
(``engine_setup.py``) sets that declared field for the plugin's models only, in the
``VllmConfig`` that the engine core (which checks every emitted token) and the workers
(whose matchers decode) receive, so both compile the same grammar.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from vllm_diffusion.options import Rule

ANY_WHITESPACE_KEY = "diffusion_json_any_whitespace"


def parse_any_whitespace(values: MutableMapping[str, Any], source: str) -> bool:
    """Take ``diffusion_json_any_whitespace`` out of ``values`` (``additional_config``)
    and check it."""
    return Rule(bool).check(ANY_WHITESPACE_KEY, values.pop(ANY_WHITESPACE_KEY, False), source)


def apply_json_layout(structured_outputs_config: Any, any_whitespace: bool) -> None:
    """Set vLLM's ``disable_any_whitespace`` for compact JSON, unless ``any_whitespace``;
    a configuration asking for both is refused (``ValueError``) rather than one of them
    being dropped."""
    if not any_whitespace:
        structured_outputs_config.disable_any_whitespace = True
    elif structured_outputs_config.disable_any_whitespace:
        raise ValueError(
            f"additional_config '{ANY_WHITESPACE_KEY}': true allows whitespace between "
            "JSON tokens, which --structured-outputs-config.disable_any_whitespace true "
            "bars; set only one of them")
