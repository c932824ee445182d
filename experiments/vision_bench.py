"""TTFT and decode speed of a request with one 448x448 image against the same text without
it, at 1 and 8 concurrent streams, on a random Idefics3 of SmolVLM-256M's shapes.

Real SmolVLM weights cannot be downloaded here, so the model is random (the timings depend on
shapes only): SmolVLM-256M's SigLIP tower (768 wide, 12 layers, 512-pixel tiles of 16-pixel
patches, pixel shuffle 4: 64 rows per tile) on SmolLM2-135M's text shapes, with a processor
config that keeps a 448x448 image to one 512-pixel tile (`size.longest_edge` 512; SmolVLM's
own 2048 makes 16 tiles + 1). Prefix caching is off and every request has its own image, so
each one encodes and prefills in full. Each setting runs twice; the second round is reported.

    PYTHONPATH=. python -P experiments/vision_bench.py [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build(path: Path) -> None:
    import torch
    import transformers
    from tiny_models import IDEFICS3_SPECIAL
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = 49152
    vocab = {f"t{i}": i for i in range(words)}
    vocab.update({t: words + i for i, t in enumerate(IDEFICS3_SPECIAL)})
    config = transformers.Idefics3Config(
        image_token_id=vocab["<image>"], scale_factor=4, tie_word_embeddings=True,
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                           num_attention_heads=12, image_size=512, patch_size=16),
        text_config=dict(model_type="llama", vocab_size=len(vocab), hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True),
    )
    torch.manual_seed(0)
    transformers.Idefics3ForConditionalGeneration(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
        additional_special_tokens=IDEFICS3_SPECIAL).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 512}, "max_image_size": {"longest_edge": 512},
        "do_image_splitting": True}))


async def run(engine, streams: int, image: bool, max_tokens: int, seed: int) -> dict:
    from jengine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    words = " ".join(f"t{100 + i}" for i in range(40))
    rng = np.random.default_rng(seed)

    async def one(i: int) -> tuple[float, float, int]:
        prompt: str | dict = f"t1 {words} t{200 + i}"
        if image:
            pixels = rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)
            prompt = {"prompt": f"t1 {words} <image> t{200 + i}",
                      "multi_modal_data": {"image": pixels}}
        start = time.perf_counter()
        first = last = None
        tokens = 0
        async for delta in engine.generate(prompt, params):
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += len(delta.outputs[0].token_ids)
        return first - start, last - first, tokens

    wall = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.perf_counter() - wall
    return {
        "ttft_s": statistics.mean(r[0] for r in results),
        "decode_tok_s_per_stream": statistics.mean((r[2] - 1) / r[1] for r in results),
        "total_tok_s": sum(r[2] for r in results) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    from jengine import AsyncEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build(path)
        engine = AsyncEngine(str(path), config="cpu", max_num_seqs=8,
                             enable_prefix_caching=False, progress=False)
        try:
            rows = []
            for streams in (1, 8):
                for image in (False, True):
                    for seed in (0, 1):  # the first round warms XLA's dots up
                        result = asyncio.run(run(engine, streams, image, args.max_tokens, seed))
                    rows.append({"streams": streams, "image": image, **result})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
