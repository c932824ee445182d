"""Chat messages with image content parts -> messages a chat template renders (each image
part becomes `{"type": "image"}`, which the vision models' templates write as `<image>`) and
the images, decoded, in the order their placeholders appear.

Image parts, in OpenAI's and vLLM's forms: `{"type": "image_url", "image_url": {"url": ...}}`
(or the URL as a bare string), and in Python `{"type": "image_pil", "image_pil": image}` or
`{"type": "image", "image": image}` with anything `decode.to_rgb` takes. Where a URL may point
(data: always; local files, http(s)) is the `load_url` callable's decision (`media.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jengine.vision.decode import decode_data_url, to_rgb

IMAGE_PART_TYPES = ("image_url", "image_pil", "image", "input_image")


def data_urls_only(url: str, where: str) -> np.ndarray:
    """The default URL policy: `data:` URLs only."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "a path"
        raise ValueError(f"{where}: image URLs with {scheme!r} are not allowed here (use a "
                         "data: URL)")
    return decode_data_url(url)


def has_images(messages: list[dict]) -> bool:
    """Whether any message holds an image content part."""
    return any(isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
               for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for part in m["content"])


def split_images(messages: list[dict], load_url: Callable[[str, str], np.ndarray] = data_urls_only,
                 ) -> tuple[list[dict], list[np.ndarray]]:
    """(messages for the template, the images). ValueError names the content part at fault
    (`messages[i].content[j]`): an unknown part, a bad URL, an undecodable image."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text"):
                parts.append({"type": "text", "text": part.get("text", "")})
                continue
            if kind not in IMAGE_PART_TYPES:
                raise ValueError(f"{where}: content part type {kind!r} is not supported")
            images.append(_image_of(part, kind, where, load_url))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def _image_of(part: dict[str, Any], kind: str, where: str,
              load_url: Callable[[str, str], np.ndarray]) -> np.ndarray:
    value = part.get(kind)
    if kind == "input_image":  # the Responses API: {"type": "input_image", "image_url": str}
        value = part.get("image_url")
    if kind == "image_url" or kind == "input_image":
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}: image_url needs a url")
        try:
            return load_url(url, where)
        except ValueError as e:
            message = str(e)
            raise ValueError(message if message.startswith(where) else f"{where}: {message}"
                             ) from None
    try:
        return to_rgb(value, where)
    except ValueError as e:
        message = str(e)
        raise ValueError(message if message.startswith(where) else f"{where}: {message}"
                         ) from None
