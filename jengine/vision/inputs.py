"""A prompt's images -> what the engine core needs: the token ids with every `<image>`
expanded to its placeholders, the tiles to encode, the encoded row each placeholder takes,
and the ids the prefix cache keys the prompt by (placeholders keyed by their image's pixels).

`ImagePrompt` is the value a caller hands the engine (vLLM's `{"prompt": ...,
"multi_modal_data": {"image": ...}}`, or a chat with image parts, becomes one);
`ImagePrompter` is one model's way of turning it into a `PreparedImages`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from jengine.models.idefics3 import VisionConfig, image_prompt
from jengine.vision.decode import image_digest, to_rgb
from jengine.vision.idefics3_processor import Idefics3Processor

IMAGE_PLACEHOLDER = "<image>"  # where an image goes in a prompt's text (the chat templates')
DEFAULT_IMAGE_LIMIT = 4  # images per prompt unless `--limit-mm-per-prompt image=N` says


def parse_image_limit(text: str) -> int:
    """`image=N` (vLLM's `--limit-mm-per-prompt`; its JSON form `{"image": N}` too) -> N."""
    spec = text.strip()
    if spec.startswith("{"):
        import json

        try:
            spec = ",".join(f"{k}={v}" for k, v in json.loads(spec).items())
        except (ValueError, AttributeError):
            raise ValueError(f"limit_mm_per_prompt {text!r}: expected image=N") from None
    limits = dict(part.partition("=")[::2] for part in spec.split(",") if part)
    if set(limits) != {"image"} or not limits["image"].strip().isdigit():
        raise ValueError(f"limit_mm_per_prompt {text!r}: expected image=N (images only)")
    return int(limits["image"])


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
    """A text prompt whose `<image>` placeholders take `images` in order (RGB uint8 arrays)."""

    text: str
    images: tuple[np.ndarray, ...]
    add_special_tokens: bool = True  # False for a chat template's text, which has its own

    @classmethod
    def of(cls, prompt: dict[str, Any]) -> ImagePrompt:
        """vLLM's form: {"prompt": str, "multi_modal_data": {"image": one image or a list}};
        images as `decode.to_rgb` takes them."""
        extra = set(prompt) - {"prompt", "multi_modal_data"}
        if extra or not isinstance(prompt.get("prompt"), str):
            raise ValueError("a prompt dict needs 'prompt' (a string) and may have "
                             f"'multi_modal_data'; got keys {sorted(prompt)}")
        data = prompt.get("multi_modal_data") or {}
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data takes 'image' only")
        images = data.get("image", [])
        images = images if isinstance(images, (list, tuple)) else [images]
        return cls(prompt["prompt"], tuple(
            to_rgb(image, f"multi_modal_data.image[{i}]") for i, image in enumerate(images)))


@dataclasses.dataclass(frozen=True)
class PreparedImages:
    """An `ImagePrompt` made ready for the core."""

    token_ids: list[int]
    tiles: np.ndarray  # [N, C, S, S] float32, every image's tiles in prompt order
    row_at: np.ndarray  # [P] int32: each prompt token's row of the encoded tiles, or -1
    cache_ids: list[int]  # token_ids with each placeholder replaced by a content key (< -1)
    # Qwen2.5-VL (`qwen_inputs`): `tiles` are patches [N, i] of images with these (t, h, w)
    # patch grids, and the prompt's multimodal rope positions [3, P] with the decode offset.
    grids: tuple[tuple[int, int, int], ...] = ()
    mrope: np.ndarray | None = None
    rope_delta: int = 0


class ImagePrompter:
    """One vision model's image handling: its processor, placeholder token and limit."""

    def __init__(self, tokenizer, processor: Idefics3Processor, vision: VisionConfig, *,
                 max_images: int = DEFAULT_IMAGE_LIMIT):
        self.tokenizer = tokenizer
        self.processor = processor
        self.vision = vision
        self.max_images = max_images

    def prepare(self, prompt: ImagePrompt) -> PreparedImages:
        """Raises ValueError: too many images, or placeholders that do not match them."""
        images = prompt.images
        if len(images) > self.max_images:
            raise ValueError(f"{len(images)} images in one prompt; the limit is "
                             f"{self.max_images} (--limit-mm-per-prompt image=N)")
        pieces = prompt.text.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} {IMAGE_PLACEHOLDER} "
                             f"placeholders for {len(images)} images")
        seq_len = self.vision.tokens_per_tile
        tiles, text = [], pieces[0]
        for image, piece in zip(images, pieces[1:]):
            image_tiles, rows, cols = self.processor.tiles(image)
            tiles.append(image_tiles)
            text += image_prompt(rows, cols, seq_len) + piece
        ids = list(self.tokenizer(text, add_special_tokens=prompt.add_special_tokens).input_ids)
        is_image = np.asarray(ids) == self.vision.image_token_id
        counts = [len(t) * seq_len for t in tiles]
        if int(is_image.sum()) != sum(counts):
            raise ValueError("the prompt text holds image placeholder tokens of its own")
        row_at = np.full(len(ids), -1, np.int32)
        row_at[is_image] = np.arange(int(is_image.sum()), dtype=np.int32)
        cache_ids = list(ids)
        slots = iter(np.flatnonzero(is_image).tolist())
        for image, count in zip(images, counts):
            digest = image_digest(image)
            for j in range(count):
                cache_ids[next(slots)] = content_key(digest, j)
        return PreparedImages(ids, np.concatenate(tiles) if tiles else np.zeros((0,)),
                              row_at, cache_ids)


def content_key(digest: bytes, index: int) -> int:
    """A negative id for placeholder `index` of the image with `digest` (never a token id,
    never PENDING's -1)."""
    h = hashlib.blake2b(digest + index.to_bytes(4, "little"), digest_size=8).digest()
    return -2 - (int.from_bytes(h, "little") >> 2)
