"""Decoding policies, one module (or small package) each, behind ``base.DecodingPolicy``.
``POLICIES`` maps a policy name to its class, importing a policy's module on its first
lookup (the API server loads the served policy and no other); names and membership
import nothing. Adding a policy: one module plus one entry in ``_LOCATIONS``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping

# policy name -> "module:class"
_LOCATIONS = {
    "standard": "vllm_diffusion.policies.standard:StandardPolicy",
    "focus": "vllm_diffusion.policies.focus:FocusPolicy",
    "elastic": "vllm_diffusion.policies.elastic:ElasticPolicy",
    "es": "vllm_diffusion.policies.es:EsPolicy",
    "ada": "vllm_diffusion.policies.ada:AdaPolicy",
    "sparse_prefix": "vllm_diffusion.policies.sparse_prefix:SparsePrefixPolicy",
}


class PolicyRegistry(MutableMapping):
    """Policy name -> policy class, importing a policy's module on its first lookup. A
    class registered at run time (``registry[name] = cls``) is kept as given."""

    def __init__(self, locations: dict[str, str]) -> None:
        self._entries: dict[str, str | type] = dict(locations)  # location or loaded class

    def module_of(self, name: str) -> str:
        """The module that defines policy ``name`` (without importing it)."""
        entry = self._entries[name]
        return entry.partition(":")[0] if isinstance(entry, str) else entry.__module__

    def __getitem__(self, name: str) -> type:
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, class_name = entry.partition(":")
            entry = getattr(importlib.import_module(module), class_name)
            if entry.name != name:
                raise RuntimeError(f"policy registry: {module}.{class_name} is named "
                                   f"{entry.name!r} but registered as {name!r}")
            self._entries[name] = entry
        return entry

    def __setitem__(self, name: str, cls: type) -> None:
        self._entries[name] = cls

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:  # Mapping's would import the policy
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


POLICIES = PolicyRegistry(_LOCATIONS)

__all__ = ["POLICIES", "PolicyRegistry"]
