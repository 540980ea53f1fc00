"""Policies with forward hooks, compiled: the layers between their hook points run as
pieces compiled with a dynamic row dimension (``models/layer_segments.py``), so FOCUS's
eviction and ES-dLLM's skipping no longer force eager mode. Greedy output of a compiled
engine equals the policies' plain references token for token on a named grid (blocks 16
and 32; batches of prompts shorter than a block, one block and several blocks, run as
batches of 1, 3 and 2 requests so the pieces see many row counts), also with the rows
after a drop padded to buckets (``diffusion_row_buckets``: the padding never changes an
output); a policy with hooks at other layers compiles the same way; ``sparse_prefix``,
whose key selections are made before the forward, runs the model vLLM compiled, whole;
``--enforce-eager`` is honoured."""

from __future__ import annotations

import pytest
import torch
from conftest import diffusion_llm
from reference_early_skip import reference_es_generate
from reference_focus import reference_focus_generate
from reference_sdar import ReferenceSDAR
from reference_sparse_prefix import reference_sparse_prefix_generate
from test_parity import checkpoint_info, make_prompts

from vllm import SamplingParams
from vllm.config import CompilationMode
from vllm.inputs import TokensPrompt

from vllm_diffusion.models.layer_segments import _SEGMENTS, piece_boundaries
from vllm_diffusion.policies.es import default_skip_layers
from vllm_diffusion.policies.focus import FocusConfig
from vllm_diffusion.step.hooks import LayerHooks
from vllm_diffusion_lab.fixtures.tiny_sdar import build_tiny_sdar
from vllm_diffusion_lab.offline import stats_delta

pytestmark = pytest.mark.engine

# name: (policy, block size, engine options, per-request options)
GRID = {
    "focus-b16": ("focus", 16, {}, {"strategy": "threshold", "threshold": 0.7}),
    "es-b32": ("es", 32, {}, {"strategy": "threshold", "threshold": 0.7}),
    "es-b16-other-layers": ("es", 16, {"skip_layers": [0, 2]},
                            {"strategy": "low_confidence_dynamic", "threshold": 0.5}),
    # rows after a drop padded to a few counts (for CUDA graphs): outputs unchanged
    "focus-b32-buckets": ("focus", 32, {"diffusion_row_buckets": [8, 16, 32, 64, 128]},
                          {"strategy": "threshold", "threshold": 0.7}),
    "es-b16-buckets": ("es", 16, {"diffusion_row_buckets": [4, 16, 64]},
                       {"strategy": "threshold", "threshold": 0.7}),
}


@pytest.fixture(scope="module")
def four_layer_checkpoint(tmp_path_factory):
    return build_tiny_sdar(tmp_path_factory.mktemp("sdar-4-layers"), num_layers=4, seed=3)


def reference_tokens(reference, policy, prompt, block_size, mask_id, max_tokens, engine,
                     options):
    if policy == "focus":
        return reference_focus_generate(reference, prompt, block_size=block_size,
                                        mask_id=mask_id, max_tokens=max_tokens,
                                        config=FocusConfig(**options))
    layers = tuple(engine.get("skip_layers") or default_skip_layers(4))
    return reference_es_generate(reference, prompt, block_size=block_size, mask_id=mask_id,
                                 max_tokens=max_tokens, skip_layers=layers, alpha=0.5,
                                 skip_ratio=0.5, **options)


@pytest.mark.parametrize("name", GRID)
def test_compiled_hook_policies_equal_their_references(name, four_layer_checkpoint):
    policy, block_size, engine, options = GRID[name]
    checkpoint = four_layer_checkpoint
    mask_id, stops, vocab_size = checkpoint_info(checkpoint)
    reference = ReferenceSDAR(checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=80 + block_size)
    max_tokens = 2 * block_size + 3
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=options)
    with diffusion_llm(checkpoint, diffusion_block_size=block_size, enforce_eager=False,
                       additional_config={"diffusion_policy": policy, **engine}) as llm:
        config = llm.llm_engine.vllm_config
        assert not config.model_config.enforce_eager
        assert config.compilation_config.mode != CompilationMode.NONE
        before = llm.collective_rpc("diffusion_stats")[0]
        for batch in (prompts[:1], prompts, prompts[1:]):
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                                   use_tqdm=False)
            for prompt, out in zip(batch, outputs):
                assert list(out.outputs[0].token_ids) == reference_tokens(
                    reference, policy, prompt, block_size, mask_id, max_tokens, engine,
                    options)
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        (segments,) = _SEGMENTS[runner.model.model].values()
        for _, _, piece in segments.pieces:  # every piece really ran compiled
            code = piece._torchdynamo_orig_callable.__code__
            assert torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
    per_layer = stats["block_positions_per_layer"]
    assert per_layer[-1] < per_layer[0]  # rows really were dropped inside the forward
    # padding rows were really added where buckets are asked for
    assert (stats["bucket_padding_rows"] > 0) == ("diffusion_row_buckets" in engine)


def test_compiled_sparse_prefix_runs_the_whole_forward(four_layer_checkpoint, sparse_calls):
    """``sparse_prefix`` preselects its keys (``LayerHooks.preselect_keys``): a compiled
    engine runs its steps through the model vLLM compiled, no pieces made, the sparse
    attention and the selection inside it, and its greedy output equals the reference."""
    block_size, checkpoint = 8, four_layer_checkpoint
    mask_id, stops, vocab_size = checkpoint_info(checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=61)
    prompts.append(prompts[-1] * 3)  # a longer prefix
    options = {"strategy": "low_confidence_static", "threshold": 1.0, "retention_ratio": 0.3,
               "pool_kernel": 3, "delay_steps": 1, "per_kv_head": False}
    max_tokens = 3 * block_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=options)
    with diffusion_llm(checkpoint, diffusion_block_size=block_size, enforce_eager=False,
                       additional_config={"diffusion_policy": "sparse_prefix"}) as llm:
        assert not llm.llm_engine.vllm_config.model_config.enforce_eager
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        assert not _SEGMENTS.get(runner.model.model)  # no step ran as pieces
    reference = ReferenceSDAR(checkpoint)
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == reference_sparse_prefix_generate(
            reference, prompt, block_size=block_size, mask_id=mask_id, max_tokens=max_tokens,
            **options)
    assert any(sparse for sparse, _ in sparse_calls)
    assert any(scoring for _, scoring in sparse_calls)


def test_enforce_eager_is_honoured(four_layer_checkpoint):
    """With ``--enforce-eager`` nothing is compiled: vLLM compiles no model, and FOCUS's
    steps, whose hooks really run (rows are dropped inside the forward), go through pieces
    that are plain functions."""
    from vllm.compilation.counter import compilation_counter

    compiles_before = compilation_counter.clone()
    with diffusion_llm(four_layer_checkpoint, diffusion_block_size=8, enforce_eager=True,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        config = llm.llm_engine.vllm_config
        assert config.model_config.enforce_eager
        assert config.compilation_config.mode == CompilationMode.NONE
        before = llm.collective_rpc("diffusion_stats")[0]
        out = llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        stats = stats_delta(before, llm.collective_rpc("diffusion_stats")[0])
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        segment_sets = list(_SEGMENTS[runner.model.model].values())
    # vLLM counts a model only where its compile decorator is to compile it (this engine
    # without --enforce-eager moves the count).
    assert compilation_counter.num_models_seen == compiles_before.num_models_seen
    per_layer = stats["block_positions_per_layer"]
    assert per_layer[-1] < per_layer[0]  # the hook path ran: FOCUS dropped rows
    # the pieces it ran through were made eager: no torch.compile wrapper around any
    assert segment_sets and not any(segments.compiled for segments in segment_sets)
    assert not any(hasattr(piece, "_torchdynamo_orig_callable")
                   for segments in segment_sets for _, _, piece in segments.pieces)


@pytest.mark.parametrize("declared,num_layers,want", [
    (LayerHooks(), 4, [(0, 7)]),
    (LayerHooks(before_attention=(0, 1)), 12, [(0, 0), (1, 2), (3, 23)]),
    (LayerHooks(before_attention=(2,)), 4, [(0, 4), (5, 7)]),
    (LayerHooks(after_output=(2, 3)), 12, [(0, 5), (6, 7), (8, 23)]),
    (LayerHooks(select_keys=(1,), after_output=(1,)), 4, [(0, 2), (3, 3), (4, 7)]),
    (LayerHooks(after_output=(3,)), 4, [(0, 7)]),
])
def test_pieces_end_at_the_hook_points(declared, num_layers, want):
    """Unit 2l is layer l's attention inputs, 2l + 1 its attention output and MLP."""
    assert piece_boundaries(declared, num_layers) == want


def test_a_hook_at_every_layer_runs_eagerly():
    """With a hook at every layer no piece spans a layer: nothing is compiled."""
    from vllm_diffusion.models.layer_segments import LayerSegments

    identity = torch.nn.Identity()
    every = LayerSegments([identity] * 4, LayerHooks(select_keys=(0, 1, 2, 3)),
                          compiled=True, embed=identity, final_norm=identity)
    assert not every.compiled
    assert all(not hasattr(p, "_torchdynamo_orig_callable") for _, _, p in every.pieces)
    some = LayerSegments([identity] * 4, LayerHooks(after_output=(1,)),
                         compiled=True, embed=identity, final_norm=identity)
    assert some.compiled


class HalfLayer(torch.nn.Module):
    """A layer with the two halves a piece runs (no attention: a linear map for each)."""

    def __init__(self, width: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inputs = torch.nn.Linear(width, width)
        self.output = torch.nn.Linear(width, width)

    def attention_inputs(self, positions, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        q = self.inputs(residual) + positions[:, None]
        return q, q * 2, q * 3, residual

    def attention_output(self, positions, q, k, v, residual):
        return self.output(q + k - v), residual


def test_compiled_pieces_guard_their_inputs_only():
    """The pieces drop the guards on their layers and globals, not those on their inputs:
    new row counts and a new dtype still give the eager result, and an in-place change of
    a layer's weights is seen (parameters are read at every call)."""
    from vllm_diffusion.models.layer_segments import _input_guards, _piece

    entries = [type("Guard", (), {"name": n})() for n in
               ("", "hidden", "q[0]", "residual.size()", "layers[0]._modules",
                "G['__import_torch']", "run_units")]
    assert _input_guards(entries) == [True, True, True, True, False, False, False]
    layers = [HalfLayer(8, seed) for seed in range(2)]
    compiled = _piece(layers, 0, 3, compiled=True)
    eager = _piece(layers, 0, 3, compiled=False)
    for rows, dtype in ((5, torch.float32), (9, torch.float32), (2, torch.float64),
                        (7, torch.float32)):
        if dtype == torch.float64:
            for layer in layers:
                layer.double()
        elif layers[0].inputs.weight.dtype != dtype:
            for layer in layers:
                layer.float()
        args = (torch.arange(rows, dtype=dtype), torch.randn(rows, 8, dtype=dtype),
                None, None, None, None)
        torch.testing.assert_close(compiled(*args)[0], eager(*args)[0])
    with torch.no_grad():
        layers[1].output.weight.mul_(-1)
    args = (torch.arange(4.0), torch.randn(4, 8), None, None, None, None)
    torch.testing.assert_close(compiled(*args)[0], eager(*args)[0])


def test_first_requests_after_start_up_compile_nothing(four_layer_checkpoint):
    """The workers' start-up warm-up (``worker/warm_up.py``) decodes dummy requests through
    FOCUS's pieces, so they are compiled before the engine is ready; after it the
    engine's counters read zero, and requests of other batch sizes and prompt lengths,
    whose hooks drop rows, compile no graph."""
    import torch._dynamo.utils as dynamo_utils

    block_size, checkpoint = 8, four_layer_checkpoint
    mask_id, stops, vocab_size = checkpoint_info(checkpoint)
    prompts = make_prompts(block_size, vocab_size, stops | {mask_id}, seed=90)
    params = SamplingParams(temperature=0, max_tokens=2 * block_size + 3, ignore_eos=True)
    with diffusion_llm(checkpoint, diffusion_block_size=block_size, enforce_eager=False,
                       additional_config={"diffusion_policy": "focus"}) as llm:
        start = llm.collective_rpc("diffusion_stats")[0]
        assert start["engine_steps"] == 0 and start["tokens_committed"] == 0
        worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
        (segments,) = _SEGMENTS[worker.worker.model_runner.model.model].values()
        for _, _, piece in segments.pieces:  # compiled before any request
            code = piece._torchdynamo_orig_callable.__code__
            assert torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        for batch in (prompts[:1], prompts):
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                         use_tqdm=False)
        assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
        stats = stats_delta(start, llm.collective_rpc("diffusion_stats")[0])
    per_layer = stats["block_positions_per_layer"]
    assert per_layer[-1] < per_layer[0]  # the hooks ran: FOCUS dropped rows


@pytest.mark.parametrize("eager, policy, connector, want", [
    (False, "focus", False, True), (False, "es", False, True),
    (True, "focus", False, False),  # nothing compiled
    (False, "standard", False, False),  # no hooks: the model vLLM warmed up
    (False, "focus", True, False),  # a scheduler of its own would touch the connector
])
def test_warm_up_runs_where_pieces_compile_at_first_use(eager, policy, connector, want):
    from types import SimpleNamespace

    from vllm_diffusion.policies import POLICIES
    from vllm_diffusion.worker.warm_up import needs_warm_up

    runner = SimpleNamespace(
        policy=object.__new__(POLICIES[policy]),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager),
                                    kv_transfer_config=object() if connector else None,
                                    kv_events_config=None))
    assert needs_warm_up(runner) is want
