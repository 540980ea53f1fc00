"""Compact JSON for the plugin's models: ``json_object`` and ``json_schema`` grammars allow no
whitespace between JSON tokens unless ``diffusion_json_any_whitespace`` allows it (why:
docs/usage.md, "Compact JSON"). The config hook sets vLLM's engine-wide
``disable_any_whitespace`` in the ``VllmConfig`` the engine core and the workers receive,
so both compile the same grammar.
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
    """Set vLLM's ``disable_any_whitespace`` unless ``any_whitespace``; a configuration
    asking for both is refused (``ValueError``) rather than one of them being dropped."""
    if not any_whitespace:
        structured_outputs_config.disable_any_whitespace = True
    elif structured_outputs_config.disable_any_whitespace:
        raise ValueError(
            f"additional_config '{ANY_WHITESPACE_KEY}': true allows whitespace between "
            "JSON tokens, which --structured-outputs-config.disable_any_whitespace true "
            "bars; set only one of them")
