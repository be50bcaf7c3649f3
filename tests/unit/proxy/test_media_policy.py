"""Which media a chat-completions call may carry to the engine (``OPENFORGE_PROXY_IMAGES``).

Chat requests pass through, so before this the engine got whatever media parts the harness
sent: images the learner would train on as bare tokens, and URLs vLLM fetches itself (audio,
video and images alike), from inside the cluster, at addresses a rollout chose.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from proxy.adapters import ChatAdapter
from proxy.errors import InvalidRequestError, UnsupportedFeatureError
from proxy.media import IMAGE_PLACEHOLDER
from proxy.service import _has_media

DATA_URL = "data:image/png;base64,iVBORw0KGgo="


def _chat(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]}


def test_text_parts_pass_under_either_policy() -> None:
    body = _chat({"type": "text", "text": "and this"})
    assert ChatAdapter().to_chat(body) == body
    assert ChatAdapter("inline").to_chat(body) == body


def test_an_inline_image_passes_only_when_images_are_on() -> None:
    body = _chat({"type": "image_url", "image_url": {"url": DATA_URL}})
    with pytest.raises(UnsupportedFeatureError, match="OPENFORGE_PROXY_IMAGES=inline") as refused:
        ChatAdapter().to_chat(body)
    assert refused.value.field == "messages[1].content[1].type"
    assert ChatAdapter("inline").to_chat(body) == body


@pytest.mark.parametrize(("part", "error", "message"), [
    ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}},
     UnsupportedFeatureError, "messages[1].content[1].image_url.url: image URLs are refused"),
    ({"type": "video_url", "video_url": {"url": "http://svc.internal/clip.mp4"}},
     UnsupportedFeatureError, "messages[1].content[1].type: video_url parts are not passed"),
    ({"type": "audio_url", "audio_url": {"url": "http://svc.internal/a.wav"}},
     UnsupportedFeatureError, "messages[1].content[1].type: audio_url parts are not passed"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     UnsupportedFeatureError, "messages[1].content[1].type: input_audio parts are not passed"),
    ({"type": "image_url", "image_url": "not an object"},
     InvalidRequestError, "messages[1].content[1].image_url.url must be a string"),
    # vLLM reads media by key from a part with no type, or with a uuid, whatever its type says.
    ({"image_url": "http://169.254.169.254/x"}, UnsupportedFeatureError, "image_url parts are not passed"),
    ({"video_url": {"url": "http://10.0.0.1/v.mp4"}}, UnsupportedFeatureError, "video_url parts are not passed"),
    ({"type": "text", "text": "x", "uuid": "u", "image_url": "http://x"}, UnsupportedFeatureError,
     "image_url parts are not passed"),
    ({"type": "video_embeds", "video_embeds": "AAAA"}, UnsupportedFeatureError, "video_embeds parts are not passed"),
    ({"type": "image_url", "image_url": {"url": DATA_URL}, "uuid": "u"}, UnsupportedFeatureError,
     "image_url parts are not passed"),
])
def test_media_the_engine_would_fetch_or_cannot_train_on_is_refused_with_images_on(
        part: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        ChatAdapter("inline").to_chat(_chat(part))


@pytest.mark.parametrize("part", [
    {"image_url": {"url": DATA_URL}},
    {"type": "text", "text": "x", "audio_url": "http://svc.internal/a.wav"},
    {"type": "prompt_embeds", "data": "AAAA"},
])
def test_media_by_key_is_refused_under_the_default_too(part: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedFeatureError):
        ChatAdapter().to_chat(_chat(part))


def test_a_malformed_type_is_left_to_the_engine_rather_than_failing_here() -> None:
    body = _chat({"type": ["text"], "text": "x"})
    assert ChatAdapter().to_chat(body) == body


@pytest.mark.parametrize("url", [DATA_URL, "https://example.com/cat.png"])
def test_an_image_becomes_the_placeholder_text_in_its_place_under_placeholder(url: str) -> None:
    body = _chat({"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "and this"})
    asked = copy.deepcopy(body)
    sent = ChatAdapter("placeholder").to_chat(body)
    assert sent["messages"][1]["content"] == [{"type": "text", "text": "look"},
                                              {"type": "text", "text": IMAGE_PLACEHOLDER},
                                              {"type": "text", "text": "and this"}]
    assert body == asked  # the harness's request stays as sent (a call refused later records it)
    assert sent["messages"][0] is body["messages"][0]  # messages without images are not copied


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "image_url", "image_url": {"url": DATA_URL}, "uuid": "u1"}])
def test_other_media_are_still_refused_under_placeholder(part: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedFeatureError, match="not passed to the engine"):
        ChatAdapter("placeholder").to_chat(_chat(part))


@pytest.mark.parametrize(("content", "media"), [
    ("just text", False),
    ([{"type": "text", "text": "hi"}], False),
    ([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}], True),
    ([{"input_audio": {"data": "AA==", "format": "wav"}}], True),  # a media key without a type is media too
])
def test_calls_with_media_stay_in_chat_mode(content: object, media: bool) -> None:
    """Continuation sends token ids alone, which would leave an image out: such calls go by chat mode."""
    assert _has_media({"messages": [{"role": "user", "content": content}]}) is media
