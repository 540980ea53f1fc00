"""The proposal pipeline's slots and the request admission stay in step: a sampling
parameter whose slot has no stage is refused, never silently ignored."""

from __future__ import annotations

import pytest

from vllm_diffusion import requests
from vllm_diffusion.worker import proposal

REFUSED = {name for name, _, _ in requests._UNSUPPORTED}


@pytest.mark.parametrize("slot", proposal.SLOT_PARAMETERS)
def test_an_empty_slot_has_its_parameters_refused(slot):
    if proposal.LOGIT_STAGES[slot] is not None:
        pytest.skip(f"slot {slot!r} has a stage")
    for parameter in proposal.SLOT_PARAMETERS[slot]:
        assert parameter in REFUSED, f"{parameter} has no stage but admission accepts it"


def test_stages_follow_the_sampler_order():
    assert proposal.STAGES == (
        "allowed_token_ids", "bad_words", "min_tokens", "logit_bias", "penalties", "grammar",
        "mask_token", "temperature", "top_k_top_p", "draw", "commit_choice")
