"""Which images and other media a call may carry to the engine.

Off by default (:data:`ImagePolicy`): the learner trains on token ids alone, so a vision
model's image tokens would be trained without the pixels they stood for, and a call carrying
images repeats every earlier image in its event (a few screenshots put a conversation's events
over the calls topic's limit, and they go to the dead-letter topic instead of training). With
``inline``, images sent as data go on; an image by URL is refused either way, because the engine
would fetch it itself, from inside the cluster, at an address the rollout chose. With
``placeholder``, each image becomes a line of text saying it was left out: a harness resends its
whole conversation on every call, so under ``refuse`` one image (Claude Code reading a
screenshot) fails every later call of the rollout, where a text-only model can go on without it.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from proxy.errors import InvalidRequestError, UnsupportedFeatureError

ImagePolicy = Literal["refuse", "inline", "placeholder"]
"""``refuse`` (default): image parts get a 400 naming them. ``inline``: images sent as data
(base64, data URLs) go to the engine as chat ``image_url`` parts; URLs are refused.
``placeholder``: every image, by data or URL, goes to the engine as :data:`IMAGE_PLACEHOLDER`, and
every Anthropic ``document`` as :data:`DOCUMENT_PLACEHOLDER`."""

IMAGE_PLACEHOLDER: Final = "[image omitted: this model reads text only]"
"""The text an image becomes under ``placeholder``: the model learns that something was there."""

DOCUMENT_PLACEHOLDER: Final = "[document omitted: this model reads text only]"
"""The text an Anthropic ``document`` block (Claude Code's Read of a PDF) becomes under ``placeholder``."""

MEDIA_PARTS: Final = frozenset({"image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio",
                                "audio_embeds", "video_url", "video_embeds", "prompt_embeds", "file"})
"""Chat content part types through which vLLM reads media (some of them by fetching a URL). Its
parser also takes each of these as a key of a part with no ``type`` (or with a ``uuid``), so a
part carrying any of them as a key is media too, whatever its ``type`` says."""

_SETTING: Final = "OPENFORGE_PROXY_IMAGES"


def refuse_images(path: str) -> UnsupportedFeatureError:
    """The refusal of an image under the default policy."""
    return UnsupportedFeatureError(
        path, f"images are not passed to the engine: the learner trains on token ids alone ({_SETTING}=inline "
              f"passes images sent as data, for a stack that trains on them; {_SETTING}=placeholder sends each "
              "as a line of text saying it was left out, for a text-only model)")


def inline_image(url: str, kind_path: str, url_path: str, policy: ImagePolicy) -> dict[str, Any]:
    """A chat ``image_url`` part for ``url`` if ``policy`` lets it through.

    Args:
        url: The image's URL (a data URL for an image sent as data).
        kind_path: Where the harness's request says this is an image (named by the refusal).
        url_path: Where it gives the URL (named by the refusal of a URL).
        policy: The proxy's :data:`ImagePolicy`.

    Raises:
        UnsupportedFeatureError: images are refused, or this one is a URL the engine would fetch.
    """
    if policy != "inline":
        raise refuse_images(kind_path)
    if not url.startswith("data:"):
        raise UnsupportedFeatureError(url_path, "image URLs are refused: the engine would fetch them itself, "
                                                "from inside the cluster; send the image as base64 data")
    return {"type": "image_url", "image_url": {"url": url}}


def check_chat_media(messages: list[Any], policy: ImagePolicy) -> list[Any]:
    """Refuse the media parts of chat messages that ``policy`` does not let through.

    A part is media by its ``type`` or by any media key it carries (see :data:`MEDIA_PARTS`), or
    by a ``uuid``, which sends it down vLLM's media path; the only media that passes is, under
    ``inline``, a typed ``image_url`` part whose URL is data. Under ``placeholder`` a typed
    ``image_url`` part (data or URL) becomes a text part of :data:`IMAGE_PLACEHOLDER`; other
    media is refused as under ``inline``.

    Returns:
        The messages to send: ``messages`` itself, or, where placeholders replaced images, a
        copy (the harness's request stays as sent, for the record of a call refused later).

    Raises:
        UnsupportedFeatureError: names the first such part.
        InvalidRequestError: an image part without a string URL.
    """
    out = messages
    for i, message in enumerate(messages):
        content = message.get("content")
        if type(content) is not list:
            continue
        for j, part in enumerate(content):
            if type(part) is not dict:
                continue  # a string is text; anything else is the engine's to refuse
            kind = part.get("type")
            keys = part.keys() & MEDIA_PARTS
            if not keys and "uuid" not in part and not (isinstance(kind, str) and kind in MEDIA_PARTS):
                continue
            path = f"messages[{i}].content[{j}]"
            if kind != "image_url" or keys != {"image_url"} or "uuid" in part:
                named = kind if isinstance(kind, str) and kind in MEDIA_PARTS else "/".join(sorted(keys)) or "uuid"
                if "image_url" not in keys or policy != "refuse":
                    raise UnsupportedFeatureError(f"{path}.type", f"{named} parts are not passed to the engine "
                                                                  "(an image goes as a typed image_url part with data)")
                raise refuse_images(f"{path}.type")
            if policy == "placeholder":
                if out is messages:
                    out = list(messages)
                if out[i] is message:
                    out[i] = {**message, "content": list(content)}
                out[i]["content"][j] = {"type": "text", "text": IMAGE_PLACEHOLDER}
                continue
            image = part["image_url"]
            url = image.get("url") if type(image) is dict else None
            if policy == "inline" and type(url) is not str:
                raise InvalidRequestError(f"{path}.image_url.url must be a string")
            inline_image(url or "", f"{path}.type", f"{path}.image_url.url", policy)
    return out


__all__ = ["DOCUMENT_PLACEHOLDER", "IMAGE_PLACEHOLDER", "MEDIA_PARTS", "ImagePolicy", "check_chat_media",
           "inline_image", "refuse_images"]
