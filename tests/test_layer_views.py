"""The one-way forward: each layer's attention reads a read-only view of the step's rows
that the rows' owner publishes (``models/step_run.py``), changes nothing it reads, and what
it selects for a policy (``sparse_prefix``'s kept prefix positions) reaches the policy
through the hooks after that attention (``StepHooks.after_key_scoring``), not from inside
the attention; preselected keys (``LayerHooks.preselect_keys``) go into the views before a
whole forward and their selections to the hooks after it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vllm_diffusion.attention import backend
from vllm_diffusion.attention.backend import (BlockDiffusionAttentionImpl,
                                              BlockDiffusionMetadata)
from vllm_diffusion.kernels.block_attention import block_causal_attention
from vllm_diffusion.kernels.sparse_prefix import select_prefix
from vllm_diffusion.models.step_run import (LayerViews, StepRun, hand_selected,
                                            publish_preselected_keys)
from vllm_diffusion.policies.sparse_prefix import (SparsePrefixConfig, SparsePrefixHooks,
                                                   SparsePrefixState)
from vllm_diffusion.step.hooks import (ForwardStep, LayerHooks, RowSelection, StepHooks,
                                       StepRequest)
from vllm_diffusion.step.keys import KeySelection
from vllm_diffusion.step.rows import StepRows

HEADS, KV_HEADS, DIM, PAGE, BLOCK = 4, 2, 32, 16, 8
# Two requests, each with a committed prefix and one block of rows being denoised:
# (prefix length, block rows)
REQUESTS = [(16, 8), (8, 8)]


class DropRows(StepHooks):
    """Keeps ``keep`` of the rows before the attention of ``before`` and after the output
    of ``after``."""

    def __init__(self, keep: list[bool], before=(), after=()) -> None:
        self.keep = torch.tensor(keep)
        self.layers = LayerHooks(before_attention=before, after_output=after)

    def before_attention(self, layer_input):
        return RowSelection(self.keep)

    def after_output(self, layer_input):
        return RowSelection(self.keep)


def toy_run(hooks: StepHooks, num_layers: int = 4):
    plans = []

    def planner(view):
        plans.append(view.query_positions.tolist())
        return object()

    rows = StepRows(torch.arange(4), torch.tensor([10, 11, 12, 13]), [0, 4], [4])
    views = LayerViews([f"layer{i}" for i in range(num_layers)], torch.zeros(1, 1), 4,
                       planner)
    run = StepRun(hooks, torch.ones(4, dtype=torch.bool), rows, views)
    return run, views.by_name, plans


def layer_inputs(rows: int):
    attention = SimpleNamespace(num_heads=1, num_kv_heads=1, head_dim=2, scaling=1.0)
    return attention, torch.zeros(rows, 2), torch.zeros(rows, 2), torch.zeros(rows, 3)


def test_a_drop_before_an_attention_leaves_that_layer_the_key_rows_that_entered_it():
    run, views, plans = toy_run(DropRows([True, False, True, True], before=(1,)))
    first = views["layer0"]
    assert all(views[f"layer{i}"] is first for i in range(4)) and len(plans) == 1
    attention, q, k, residual = layer_inputs(4)
    run.before_attention(0, attention, q, k, residual)  # no hook at layer 0: no change
    assert views["layer0"] is first
    q, residual = run.before_attention(1, attention, q, k, residual)
    assert q.shape[0] == residual.shape[0] == 3
    this, later = views["layer1"], views["layer2"]
    assert this.query_positions.tolist() == later.query_positions.tolist() == [0, 2, 3]
    assert this.query_start_loc == later.query_start_loc == (0, 3)
    assert this.slot_mapping.tolist() == [10, 11, 12, 13]  # the attention stores them all
    assert later.slot_mapping.tolist() == [10, 12, 13] and views["layer3"] is later
    assert this.attention_plan is later.attention_plan  # planned once for the new rows
    assert plans == [[0, 1, 2, 3], [0, 2, 3]]
    # the earlier view keeps the rows it was made with
    assert views["layer0"] is first and first.query_positions.tolist() == [0, 1, 2, 3]
    assert first.slot_mapping.tolist() == [10, 11, 12, 13] and first.kv_lens == (4,)


def test_a_drop_after_an_output_narrows_the_views_of_the_later_layers():
    run, views, plans = toy_run(DropRows([True, False, False, True], after=(1, 3)))
    first = views["layer0"]
    _, _, _, residual = layer_inputs(4)
    (residual,) = run.after_output(1, residual, residual)
    assert views["layer1"] is first
    assert views["layer2"] is views["layer3"]
    assert views["layer2"].query_positions.tolist() == [0, 3]
    assert views["layer2"].slot_mapping.tolist() == [10, 13]
    run.hooks.keep = torch.tensor([True, False])
    run.after_output(3, residual[:2], residual[:2])  # after the last layer: no view to plan
    assert len(plans) == 2 and run.rows.tolist() == [0]


def test_a_view_cannot_be_changed():
    _, views, _ = toy_run(StepHooks())
    with pytest.raises(dataclasses.FrozenInstanceError):
        views["layer0"].slot_mapping = torch.tensor([1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        views["layer0"].attention_plan = None


def sparse_prefix_step(per_kv_head: list[bool], keep: list[int], whole: bool = False):
    """A two-layer step of two requests that select their kept prefix positions; returns
    the hooks, the run (with ``whole``: the output slots of the views published for a
    whole forward), its views, the attention and a KV cache holding the prefixes."""
    gen = torch.Generator().manual_seed(7)
    impl = BlockDiffusionAttentionImpl(HEADS, DIM, DIM ** -0.5, num_kv_heads=KV_HEADS)
    pages = [-(-(prefix + rows) // PAGE) for prefix, rows in REQUESTS]
    kv_cache = torch.zeros(sum(pages) + 1, KV_HEADS, PAGE, 2 * DIM)
    block_table = torch.zeros(len(REQUESTS), max(pages), dtype=torch.long)
    first_page = 1
    for r, count in enumerate(pages):
        block_table[r, :count] = torch.arange(first_page, first_page + count)
        first_page += count

    def slots(r, positions):
        return block_table[r, positions // PAGE] * PAGE + positions % PAGE

    for r, (prefix, _) in enumerate(REQUESTS):  # the committed prefix, from earlier steps
        impl.write_kv(kv_cache, torch.randn(prefix, KV_HEADS, DIM, generator=gen),
                      torch.randn(prefix, KV_HEADS, DIM, generator=gen),
                      slots(r, torch.arange(prefix)))
    positions = torch.cat([torch.arange(p, p + n) for p, n in REQUESTS])
    loc = [0, REQUESTS[0][1], REQUESTS[0][1] + REQUESTS[1][1]]
    rows = StepRows(positions, torch.cat([slots(r, torch.arange(p, p + n))
                                          for r, (p, n) in enumerate(REQUESTS)]),
                    loc, [p + n for p, n in REQUESTS])
    requests, scoring = [], []
    for r, ((prefix, count), shared) in enumerate(zip(REQUESTS, per_kv_head)):
        request = SimpleNamespace(
            canvas=SimpleNamespace(start=prefix),
            policy_config=SparsePrefixConfig(pool_kernel=3, per_kv_head=shared),
            policy_state=SparsePrefixState(kept=torch.full(
                (2, KV_HEADS if shared else 1, keep[r]), -1, dtype=torch.long)))
        requests.append(StepRequest(request, range(loc[r], loc[r + 1]),
                                    torch.arange(loc[r], loc[r + 1]), torch.arange(count)))
        scoring.append((r, request, keep[r]))
    step = ForwardStep(requests, loc[-1], torch.device("cpu"))
    hooks = SparsePrefixHooks(step, 2, KV_HEADS, scoring, [])
    views = LayerViews(["layer0", "layer1"], block_table, BLOCK,
                       lambda view: impl.plan_step(view, kv_cache))
    if whole:
        return hooks, publish_preselected_keys(hooks, rows, views), views.by_name, impl, \
            kv_cache
    run = StepRun(hooks, torch.ones(loc[-1], dtype=torch.bool), rows, views)
    return hooks, run, views.by_name, impl, kv_cache


def snapshot(view: BlockDiffusionMetadata) -> dict:
    return {field.name: getattr(view, field.name).clone()
            if isinstance(getattr(view, field.name), torch.Tensor) else getattr(view, field.name)
            for field in dataclasses.fields(view) if field.name != "selected_prefix"}


def assert_unchanged(view: BlockDiffusionMetadata, before: dict) -> None:
    for name, value in before.items():
        now = getattr(view, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(now, value), name
        else:
            assert now is value, name


def test_the_attention_changes_nothing_it_reads(monkeypatch):
    monkeypatch.setattr(backend, "get_tensor_model_parallel_world_size", lambda: 1)
    _, _, views, impl, kv_cache = sparse_prefix_step([False, True], [4, 3])
    view = views["layer0"]  # before the hooks: the dense view every layer shares
    assert view.attention_plan is None  # every layer selects keys: nothing to plan
    assert view.key_selection is None
    gen = torch.Generator().manual_seed(3)
    rows = view.num_queries
    query = torch.randn(rows, HEADS, DIM, generator=gen)
    key, value = (torch.randn(rows, KV_HEADS, DIM, generator=gen) for _ in range(2))
    want = None
    for planned in (view, dataclasses.replace(view, attention_plan=impl.plan_step(
            view, kv_cache))):
        before = snapshot(planned)
        output = impl.forward(None, query, key, value, kv_cache, planned,
                              torch.empty_like(query))
        assert_unchanged(planned, before)
        if want is None:
            want = block_causal_attention(query, kv_cache, view.query_positions,
                                          list(view.query_start_loc), list(view.kv_lens),
                                          view.block_table, BLOCK, DIM ** -0.5)
        torch.testing.assert_close(output, want, rtol=1e-5, atol=1e-5)


def test_sparse_prefix_selection_reaches_the_policy_through_the_hooks(monkeypatch):
    """The attention fills the view's output slot and leaves the policy's state alone; the
    run hands the slot to the hooks after that attention, which keep it per layer."""
    monkeypatch.setattr(backend, "get_tensor_model_parallel_world_size", lambda: 1)
    per_kv_head, keep = [False, True], [4, 3]
    hooks, run, views, impl, kv_cache = sparse_prefix_step(per_kv_head, keep)
    gen = torch.Generator().manual_seed(11)
    attention = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                                scaling=DIM ** -0.5)
    rows = sum(n for _, n in REQUESTS)
    states = [request.policy_state for request in hooks.scoring_requests.values()]
    for layer in range(2):
        query = torch.randn(rows, HEADS * DIM, generator=gen)
        key = torch.randn(rows, KV_HEADS * DIM, generator=gen)
        assert views[f"layer{layer}"].key_selection is None  # until its hook ran
        run.before_attention(layer, attention, query, key)
        view = views[f"layer{layer}"]
        assert [s.request for s in view.key_selection.scoring] == [0, 1]
        assert view.selected_prefix == {}
        before = snapshot(view)
        query = query.view(rows, HEADS, DIM)
        output = impl.forward(None, query, key.view(rows, KV_HEADS, DIM),
                              torch.randn(rows, KV_HEADS, DIM, generator=gen), kv_cache,
                              view, torch.empty_like(query))
        assert_unchanged(view, before)
        # the selection went to the output slot, not into the policy's state
        assert sorted(view.selected_prefix) == [0, 1]
        assert all(bool((state.kept[layer] == -1).all()) for state in states)
        run.after_attention(layer)
        loc = view.query_start_loc
        for r, state in enumerate(states):
            want = select_prefix(query[loc[r]:loc[r + 1]], kv_cache, view.block_table[r],
                                 REQUESTS[r][0], DIM ** -0.5, keep[r], 3, per_kv_head[r])
            assert torch.equal(state.kept[layer], want)
            assert want.shape == (KV_HEADS if per_kv_head[r] else 1, keep[r])
        # scoring requests attend densely
        torch.testing.assert_close(output, block_causal_attention(
            query, kv_cache, view.query_positions, list(loc), list(view.kv_lens),
            view.block_table, BLOCK, DIM ** -0.5), rtol=1e-5, atol=1e-5)


def test_preselected_keys_reach_the_policy_after_a_whole_forward(monkeypatch):
    """Hooks that only preselect keys leave the model whole: every layer's view carries
    its selection and output slot before the forward, the attention fills the slot, and
    the policy's state changes only when the slots are handed over after the forward."""
    monkeypatch.setattr(backend, "get_tensor_model_parallel_world_size", lambda: 1)
    per_kv_head, keep = [True, False], [5, 2]
    hooks, slots, views, impl, kv_cache = sparse_prefix_step(per_kv_head, keep, whole=True)
    assert not hooks.layers.between_layers
    assert sorted(slots) == [0, 1]
    states = [request.policy_state for request in hooks.scoring_requests.values()]
    gen = torch.Generator().manual_seed(5)
    rows = sum(n for _, n in REQUESTS)
    queries = []
    for layer in range(2):
        view = views[f"layer{layer}"]
        assert view.selected_prefix is slots[layer] and view.selected_prefix == {}
        assert [s.request for s in view.key_selection.scoring] == [0, 1]
        query = torch.randn(rows, HEADS, DIM, generator=gen)
        queries.append(query)
        impl.forward(None, query, torch.randn(rows, KV_HEADS, DIM, generator=gen),
                     torch.randn(rows, KV_HEADS, DIM, generator=gen), kv_cache, view,
                     torch.empty_like(query))
        assert sorted(view.selected_prefix) == [0, 1]
    assert all(bool((state.kept == -1).all()) for state in states)  # not handed over yet
    hand_selected(hooks, slots)
    loc = views["layer0"].query_start_loc
    for layer, query in enumerate(queries):
        for r, state in enumerate(states):
            want = select_prefix(query[loc[r]:loc[r + 1]], kv_cache,
                                 views["layer0"].block_table[r], REQUESTS[r][0], DIM ** -0.5,
                                 keep[r], 3, per_kv_head[r])
            assert torch.equal(state.kept[layer], want)


def test_a_step_with_hooks_between_layers_still_honours_preselected_keys():
    """Preselected keys next to a hook between layers: the run puts each selection in its
    layer's view at that layer."""
    _, _, views, _, _ = sparse_prefix_step([False, False], [3, 3])
    selection = KeySelection([8, 8], [16, 8], [0], torch.zeros(1, 1, 3, dtype=torch.long), [])

    class Both(StepHooks):
        layers = LayerHooks(after_output=(0,), preselect_keys=(1,))

        def preselected_keys(self, layer):
            return selection

    rows = views["layer0"]
    step_rows = StepRows(rows.query_positions, rows.slot_mapping, rows.query_start_loc,
                         rows.kv_lens)
    layer_views = LayerViews(["layer0", "layer1"], rows.block_table, BLOCK, None)
    run = StepRun(Both(), torch.ones(rows.num_queries, dtype=torch.bool), step_rows,
                  layer_views)
    assert layer_views.by_name["layer1"].key_selection is None
    attention = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                                scaling=DIM ** -0.5)
    run.before_attention(1, attention, torch.zeros(rows.num_queries, HEADS * DIM),
                         torch.zeros(rows.num_queries, KV_HEADS * DIM))
    assert layer_views.by_name["layer1"].key_selection is selection
    assert layer_views.by_name["layer0"].key_selection is None


def test_preselected_keys_refused_where_they_cannot_hold():
    """A preselected selection indexes the step's rows: after a hook dropped rows it is
    refused, and so is a layer declared both ways."""
    _, _, views, _, _ = sparse_prefix_step([False, False], [3, 3])
    selection = KeySelection([8, 8], [16, 8], [0], torch.zeros(1, 1, 3, dtype=torch.long), [])
    rows = views["layer0"]

    def run_of(layers):
        class Hooks(StepHooks):
            def preselected_keys(self, layer):
                return selection

            def after_output(self, layer_input):
                keep = torch.ones(len(layer_input.rows), dtype=torch.bool)
                keep[0] = False
                return RowSelection(keep)

        hooks = Hooks()
        hooks.layers = layers
        step_rows = StepRows(rows.query_positions, rows.slot_mapping, rows.query_start_loc,
                             rows.kv_lens)
        return StepRun(hooks, torch.ones(rows.num_queries, dtype=torch.bool), step_rows,
                       LayerViews(["layer0", "layer1"], rows.block_table, BLOCK, None))

    with pytest.raises(ValueError, match="both in select_keys and in preselect_keys"):
        run_of(LayerHooks(select_keys=(1,), preselect_keys=(1,)))
    run = run_of(LayerHooks(after_output=(0,), preselect_keys=(1,)))
    hidden = torch.zeros(rows.num_queries, HEADS * DIM)
    run.after_output(0, hidden, hidden)  # drops the first row
    attention = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                                scaling=DIM ** -0.5)
    with pytest.raises(ValueError, match="after a hook dropped rows"):
        run.before_attention(1, attention, torch.zeros(rows.num_queries - 1, HEADS * DIM),
                             torch.zeros(rows.num_queries - 1, KV_HEADS * DIM))
