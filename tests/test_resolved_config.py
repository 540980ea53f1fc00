"""The engine configuration is resolved once: the typed ``DiffusionEngineConfig`` stored in
vLLM's configuration is what the engine core and the workers read back (pickled with the
``VllmConfig``), unchanged and without a second validation; and the policy registry
imports a policy only when it is asked for."""

from __future__ import annotations

import pickle
import types

import pytest

from vllm_diffusion.config import (DiffusionEngineConfig, engine_config_from_vllm,
                                   parse_engine_options, store_resolved)
from vllm_diffusion.policies import POLICIES, PolicyRegistry


def resolve(**options) -> DiffusionEngineConfig:
    return parse_engine_options(options, config_block_size=8, config_mask_token_id=3,
                                vocab_size=100)


def test_the_stored_configuration_is_read_back_as_it_is(monkeypatch):
    vllm_config = types.SimpleNamespace(additional_config={"diffusion_policy": "focus"})
    config = resolve(diffusion_policy="focus", alpha=2.0)
    store_resolved(vllm_config, config)

    def no_second_parse(*args, **kwargs):
        raise AssertionError("the resolved configuration was parsed again")

    monkeypatch.setattr("vllm_diffusion.config.parse_engine_options", no_second_parse)
    assert engine_config_from_vllm(vllm_config) is config


def test_an_unresolved_configuration_is_refused():
    for stored in ({}, {"diffusion_policy": "standard"}, None):
        with pytest.raises(RuntimeError, match="not resolved at start-up"):
            engine_config_from_vllm(types.SimpleNamespace(additional_config=stored))


def test_the_configuration_travels_and_hashes_inside_vllms_config():
    from vllm.config import VllmConfig

    vllm_config = VllmConfig()
    config = resolve(diffusion_policy="focus", diffusion_row_buckets=[8, 16])
    store_resolved(vllm_config, config)
    received = pickle.loads(pickle.dumps(vllm_config))  # as the engine core receives it
    assert engine_config_from_vllm(received) == config
    assert received.compute_hash() == vllm_config.compute_hash()
    other = VllmConfig()
    store_resolved(other, resolve(diffusion_policy="focus", diffusion_row_buckets=[8, 32]))
    assert other.compute_hash() != vllm_config.compute_hash()
    # the options it holds resolve to the same configuration
    assert resolve(**config.to_dict()) == config


def test_the_registry_imports_a_policy_on_its_first_lookup(monkeypatch):
    imported = []
    module = types.ModuleType("policy_module_for_the_registry_test")
    module.Named = type("Named", (), {"name": "named"})
    module.Misnamed = type("Misnamed", (), {"name": "other"})

    def import_module(name):
        imported.append(name)
        return module

    monkeypatch.setattr("importlib.import_module", import_module)
    registry = PolicyRegistry({"named": f"{module.__name__}:Named",
                               "misnamed": f"{module.__name__}:Misnamed"})
    assert "named" in registry and sorted(registry) == ["misnamed", "named"]
    assert registry.get("unknown") is None and registry.module_of("named") == module.__name__
    assert imported == []
    assert registry["named"] is module.Named and registry["named"] is module.Named
    assert imported == [module.__name__]  # once
    with pytest.raises(RuntimeError, match="named 'other' but registered as 'misnamed'"):
        registry["misnamed"]
    registry["extra"] = module.Named
    assert registry["extra"] is module.Named
    assert registry.module_of("extra") == module.Named.__module__
    del registry["extra"]
    assert "extra" not in registry


def test_every_registered_policy_is_found_under_its_name():
    assert set(POLICIES) == {"standard", "focus", "elastic", "es", "ada", "sparse_prefix"}
    for name in POLICIES:
        assert POLICIES[name].name == name
        assert POLICIES[name].__module__.startswith(POLICIES.module_of(name))
