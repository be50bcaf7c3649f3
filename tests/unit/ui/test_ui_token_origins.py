"""The token view colours origins from the sample's recorded origins, not from its loss mask."""

from __future__ import annotations

from assembler_factories import call

from consumers.assembler.samples import build_samples
from openforge.ui.tokens import render_sample, token_origins
from schemas.call.v1 import NormalizedRequest


def test_origins_come_from_the_sample_and_the_mask_only_for_samples_without_them() -> None:
    user, answer, tool = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                          {"role": "tool", "content": "42"})
    first = call([1, 2], [10], call_id="a").model_copy(update={"request": NormalizedRequest(messages=[user])})
    second = call([1, 2, 10, 7, 8], [11], call_id="b").model_copy(
        update={"request": NormalizedRequest(messages=[user, answer, tool])})
    [sample] = build_samples([first, second]).samples
    assert token_origins(sample) == ["sampled", "tool", "tool", "sampled"]
    html = render_sample(sample, colouring="origin", spans=[], text_of=None)
    assert html.count("o-tool") == 2 and html.count("o-sampled") == 2
    older = sample.model_copy(update={"origins": []})  # an assembler from before origins
    assert token_origins(older) == ["sampled", "context", "context", "sampled"]
