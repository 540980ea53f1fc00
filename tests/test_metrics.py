"""The per-step diffusion counters through their one adapter (``metrics.py``): what the
scheduler encodes is what the front end's stat loggers decode, also after vLLM's encoding
of the engine core's outputs between processes."""

from __future__ import annotations

import pytest
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_diffusion.metrics import StepCounters, decode_counters, encode_counters

COUNTERS = [
    StepCounters(denoised_blocks=0, block_positions=0, positions_after_eviction=0,
                 committed_tokens=0),
    StepCounters(denoised_blocks=3, block_positions=24, positions_after_eviction=10,
                 committed_tokens=7, layer_positions=(24, 10, 10, 10), matcher_fills=5,
                 matcher_accepts=4, chosen_chunk=8, token_edits=(2, 1, 1)),
    StepCounters(denoised_blocks=1, block_positions=32, positions_after_eviction=32,
                 committed_tokens=32, layer_positions=(32,)),
]


@pytest.mark.parametrize("counters", COUNTERS, ids=["idle", "every-counter", "one-layer"])
def test_counters_round_trip(counters):
    stats = encode_counters(counters)
    # vLLM's own loggers read these three as diffusion steps, positions and commits
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        counters.denoised_blocks, counters.block_positions, counters.committed_tokens)
    assert stats.num_spec_tokens == 0 and stats.num_accepted_tokens_per_pos == []
    assert decode_counters(stats) == counters


@pytest.mark.parametrize("counters", COUNTERS[1:], ids=["every-counter", "one-layer"])
def test_counters_survive_the_engine_core_output_encoding(counters):
    """Between the engine core and the front end, ``EngineCoreOutputs`` travel through
    vLLM's msgpack encoding, which decodes ``scheduler_stats`` as its declared types."""
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(
        spec_decoding_stats=encode_counters(counters)))
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert decode_counters(received.scheduler_stats.spec_decoding_stats) == counters


def test_stats_without_the_plugins_layout_are_refused():
    assert decode_counters(SpecDecodingStats(num_spec_tokens=0)) is None
    with pytest.raises(ValueError, match="layout version 1"):
        decode_counters(SpecDecodingStats.new(num_spec_tokens=4))  # vLLM's own: zeros
    truncated = encode_counters(COUNTERS[1])
    truncated.num_draft_tokens_per_pos = truncated.num_draft_tokens_per_pos[:5]
    with pytest.raises(ValueError, match="at least 7 counts"):
        decode_counters(truncated)
    with pytest.raises(ValueError, match="token_edits holds 3 counts"):
        encode_counters(StepCounters(1, 1, 1, 1, token_edits=(1, 2)))
