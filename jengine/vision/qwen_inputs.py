"""Qwen2.5-VL's way of turning an `ImagePrompt` into a `PreparedImages`.

Its chat template writes `<|vision_start|><|image_pad|><|vision_end|>` for each image, and so
does a prompt in vLLM's form for this model: each `<|image_pad|>` in the text takes the next
image and becomes as many pads as the image has merged patch blocks (HF's
`Qwen2_5_VLProcessor`). The prompt's multimodal rope positions are computed here, on the
host, once per request (`qwen2_5_vl.mrope_positions`); the steps carry them.
"""

from __future__ import annotations

import numpy as np

from jengine.models.qwen2_5_vl import VisionConfig, mrope_positions
from jengine.vision.decode import image_digest
from jengine.vision.inputs import DEFAULT_IMAGE_LIMIT, ImagePrompt, PreparedImages, content_key
from jengine.vision.qwen2_vl_processor import Qwen2VLProcessor

IMAGE_PAD = "<|image_pad|>"


class QwenImagePrompter:
    """One Qwen2.5-VL model's image handling: its processor, placeholder token and limit."""

    def __init__(self, tokenizer, processor: Qwen2VLProcessor, vision: VisionConfig, *,
                 max_images: int = DEFAULT_IMAGE_LIMIT):
        self.tokenizer = tokenizer
        self.processor = processor
        self.vision = vision
        self.max_images = max_images

    def prepare(self, prompt: ImagePrompt) -> PreparedImages:
        """Raises ValueError: too many images, placeholders that do not match them, or an
        image the processor refuses (an aspect ratio over 200)."""
        images = prompt.images
        if len(images) > self.max_images:
            raise ValueError(f"{len(images)} images in one prompt; the limit is "
                             f"{self.max_images} (--limit-mm-per-prompt image=N)")
        pieces = prompt.text.split(IMAGE_PAD)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} {IMAGE_PAD} placeholders for "
                             f"{len(images)} images")
        patches, grids, counts, text = [], [], [], pieces[0]
        for image, piece in zip(images, pieces[1:]):
            image_patches, grid = self.processor.patches(image)
            patches.append(image_patches)
            grids.append(grid)
            counts.append(grid[1] * grid[2] // self.vision.merge_unit)
            text += IMAGE_PAD * counts[-1] + piece
        ids = list(self.tokenizer(text, add_special_tokens=prompt.add_special_tokens).input_ids)
        is_image = np.asarray(ids) == self.vision.image_token_id
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
        mrope, delta = (None, 0)
        if images:
            mrope, delta = mrope_positions(np.asarray(ids), self.vision.image_token_id, grids,
                                           self.vision.merge_size)
        return PreparedImages(
            ids, np.concatenate(patches) if patches else np.zeros((0, self.vision.patch_in)),
            row_at, cache_ids, grids=tuple(grids), mrope=mrope, rope_delta=delta)
