"""Tiny random HF models for the oracle tests: a word-level tokenizer and O(1)-scaled random
weights, so that every weight (norms and biases included) moves the logits."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def save_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer over `vocab` tokens t0..t{vocab-1} (t1 bos, t2 eos): `load_source`
    loads one with every HF model."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(path)


def randomize(model: torch.nn.Module, *, norm_offset: float) -> None:
    """Every parameter random and O(1)-scaled: projections ~ 1/sqrt(fan_in), norms around
    `norm_offset` (1 for Llama's `w * x`, 0 for Gemma's `(1 + w) * x`), biases ~ 0.5."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(norm_offset + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def random_hf_model(path: Path, config, model_cls, *, norm_offset: float = 1.0):
    """Builds, randomizes and saves (with a tokenizer) an eager-attention HF model; returns the
    torch model, the oracle for what is saved at `path`."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    randomize(model, norm_offset=norm_offset)
    model.save_pretrained(path)
    save_tokenizer(path, config.vocab_size)
    return model


def llama_16x8(path: Path) -> None:
    """A random Llama (16 q / 8 kv heads, untied lm_head) with a word-level tokenizer over its 96
    tokens: 8 kv heads split evenly over tp=8, the sharding and multi-host tests' model."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=8, head_dim=8, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    save_tokenizer(path, 96)


def llama_heads(path: Path, heads: int, kv_heads: int, *, bias: bool = False,
                tied: bool = False) -> Path:
    """A random 64-token Llama with the given head counts (head dim 4) and nonzero biases when
    `bias`: the sharded-loading and quantization tests' model."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=4 * heads, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=4,
        max_position_embeddings=64, attention_bias=bias, tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # biases start at zero: make them count
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_()
    model.save_pretrained(path)
    save_words(path, 64)
    return path


def save_words(path: Path, vocab: int) -> None:
    """A bare word-level tokenizer (no pre-tokenizer, no special tokens) over t0..t{vocab-1}."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(
        path)


# Qwen3's chat template, cut to what the reasoning tests read: the ChatML turns, and the
# generation prompt's empty think block when `enable_thinking` is false (Qwen3's own lines).
QWEN3_THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def save_byte_tokenizer(path: Path, *, added: list[str], special: list[str],
                        chat_template: str | None = None) -> int:
    """A byte-level BPE tokenizer without merges (one token per byte, any text encodes and
    decodes exactly) plus `added` tokens (Qwen3's `<think>`: added, not special) and `special`
    ones (the first is EOS); returns the vocabulary size."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special[0])
    fast.add_special_tokens({"additional_special_tokens": special[1:]})
    fast.add_tokens(added)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return len(fast)


def qwen3_thinking(path: Path) -> Path:
    """A tiny random Qwen3 with a byte-level tokenizer, `<think>` / `</think>` tokens and a
    Qwen3-style chat template: the reasoning tests' model."""
    vocab = save_byte_tokenizer(path, added=["<think>", "</think>"],
                                special=["<|im_end|>", "<|im_start|>"],
                                chat_template=QWEN3_THINKING_TEMPLATE)
    eos = transformers.AutoTokenizer.from_pretrained(path).eos_token_id
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None)
    random_hf_model(path, config, transformers.Qwen3ForCausalLM)
    save_byte_tokenizer(path, added=["<think>", "</think>"], special=["<|im_end|>", "<|im_start|>"],
                        chat_template=QWEN3_THINKING_TEMPLATE)  # random_hf_model wrote words
    return path


# Harmony's special tokens (the first, `<|return|>`, ends the answer: EOS) and a chat template
# of its layout (openai/harmony docs/format.md): each message `<|start|>ROLE<|message|>...<|end|>`,
# an assistant turn on its final channel, the generation prompt `<|start|>assistant`.
HARMONY_SPECIAL = ["<|return|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                   "<|call|>", "<|constrain|>"]
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}"
                    "{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
                    "<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def gpt_oss_harmony(path: Path) -> Path:
    """A tiny random gpt-oss with a byte-level tokenizer, harmony's special tokens and a
    harmony chat template: the harmony reasoning tests' model."""
    vocab = save_byte_tokenizer(path, added=[], special=HARMONY_SPECIAL,
                                chat_template=HARMONY_TEMPLATE)
    eos = transformers.AutoTokenizer.from_pretrained(path).eos_token_id
    config = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 128},
        tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None)
    random_hf_model(path, config, transformers.GptOssForCausalLM)
    save_byte_tokenizer(path, added=[], special=HARMONY_SPECIAL,
                        chat_template=HARMONY_TEMPLATE)  # random_hf_model wrote words
    return path


IDEFICS3_SPECIAL = (["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
                    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
IDEFICS3_WORDS = 64  # t0..t63, then the special tokens
IDEFICS3_TILE = 32  # pixels; patches of 4 -> 64 patches -> 16 rows per tile after the shuffle
# SmolVLM's chat template (an image part is `<image>`), over the word-level vocabulary.
IDEFICS3_CHAT = (
    "t1 {% for message in messages %}{{ 't4' if message['role'] == 'user' else 't5' }} "
    "{% if message['content'] is string %}{{ message['content'] }} {% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }} "
    "{% elif part['type'] == 'image' %}<image> {% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance> {% endfor %}{% if add_generation_prompt %}t5 {% endif %}")


def idefics3_tiny(path: Path):
    """A random Idefics3 (2-layer SigLIP tower of 32 wide on 32-pixel tiles, 2-layer Llama of
    64 wide) saved as transformers writes it, with a word-level tokenizer holding the image
    tokens, SmolVLM's chat template and a preprocessor config of 64-pixel images in 32-pixel
    tiles. Returns the torch model (eager attention), the oracle."""
    import json

    vocab = {f"t{i}": i for i in range(IDEFICS3_WORDS)}
    vocab.update({t: IDEFICS3_WORDS + i for i, t in enumerate(IDEFICS3_SPECIAL)})
    config = transformers.Idefics3Config(
        image_token_id=vocab["<image>"], scale_factor=2, tie_word_embeddings=False,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=IDEFICS3_TILE, patch_size=4),
        text_config=dict(model_type="llama", vocab_size=len(vocab), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0),
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    randomize(model, norm_offset=1.0)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
        additional_special_tokens=IDEFICS3_SPECIAL)
    fast.chat_template = IDEFICS3_CHAT
    fast.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Idefics3ImageProcessor", "do_resize": True,
        "size": {"longest_edge": 2 * IDEFICS3_TILE},
        "max_image_size": {"longest_edge": IDEFICS3_TILE}, "do_image_splitting": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255}))
    return model


QWEN_VL_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                   "<|image_pad|>", "<|video_pad|>"]
QWEN_VL_WORDS = 64  # t0..t63, then the special tokens
QWEN_VL_PATCH = 4  # pixels; merged 2x2, so an image's sides come in multiples of 8
# Qwen2.5-VL's chat template, cut to what the tests send (text and image parts).
QWEN_VL_CHAT = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen2_5_vl_published(vocab: int) -> dict:
    """A tiny Qwen2.5-VL `config.json` in the published checkpoints' layout: the text fields at
    the top level, `rope_scaling` of type "mrope", a nested `vision_config` with `in_chans`."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "sliding_window": 512, "use_sliding_window": False, "max_window_layers": 2,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "image_token_id": QWEN_VL_WORDS + 4, "video_token_id": QWEN_VL_WORDS + 5,
        "vision_start_token_id": QWEN_VL_WORDS + 2, "vision_end_token_id": QWEN_VL_WORDS + 3,
        "vision_config": {
            "depth": 3, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 48,
            "num_heads": 4, "in_chans": 3, "out_hidden_size": 64, "patch_size": QWEN_VL_PATCH,
            "spatial_merge_size": 2, "spatial_patch_size": QWEN_VL_PATCH,
            "temporal_patch_size": 2, "window_size": 16, "fullatt_block_indexes": [1],
            "tokens_per_second": 2},
    }


def qwen2_5_vl_tiny(path: Path):
    """A random Qwen2.5-VL (3-block tower of 32 wide, windows of 2x2 merged blocks, block 1
    full attention; 2-layer Qwen2 text model of 64 wide) whose `config.json` is in the published
    layout, with a word-level tokenizer holding the special tokens, a cut chat template and a
    preprocessor config for 4-pixel patches. Returns the torch model (eager), the oracle."""
    import json

    vocab = {f"t{i}": i for i in range(QWEN_VL_WORDS)}
    vocab.update({t: QWEN_VL_WORDS + i for i, t in enumerate(QWEN_VL_SPECIAL)})
    published = qwen2_5_vl_published(len(vocab))
    config = transformers.Qwen2_5_VLConfig(**published)
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    randomize(model, norm_offset=1.0)
    with torch.no_grad():  # the conv's fan-in is all its pixels, not its last axis
        w = model.model.visual.patch_embed.proj.weight
        w.mul_((w.shape[-1] / w[0].numel()) ** 0.5)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(published))
    _qwen_vl_files(path, vocab)
    return model


def _qwen_vl_files(path: Path, vocab: dict[str, int]) -> None:
    """The word-level tokenizer with Qwen's special tokens, the cut chat template and a
    preprocessor config for 4-pixel patches (images of 4 to 24 merged blocks)."""
    import json

    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
        additional_special_tokens=QWEN_VL_SPECIAL)
    fast.chat_template = QWEN_VL_CHAT
    fast.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": 8 * 8 * 4, "max_pixels": 8 * 8 * 24, "patch_size": QWEN_VL_PATCH,
        "temporal_patch_size": 2, "merge_size": 2}))


def qwen3_vl_published(vocab: int) -> dict:
    """A tiny Qwen3-VL `config.json` in the published checkpoints' layout: a nested
    `text_config` with `rope_scaling` (interleaved mrope), a nested `vision_config`."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "image_token_id": QWEN_VL_WORDS + 4, "video_token_id": QWEN_VL_WORDS + 5,
        "vision_start_token_id": QWEN_VL_WORDS + 2, "vision_end_token_id": QWEN_VL_WORDS + 3,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": vocab, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "attention_bias": False,
            "rope_theta": 10000.0, "rope_scaling": {"rope_type": "default",
                                                    "mrope_section": [2, 3, 3],
                                                    "mrope_interleaved": True},
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
        "vision_config": {
            "model_type": "qwen3_vl", "depth": 3, "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 32, "intermediate_size": 48, "num_heads": 4, "in_channels": 3,
            "out_hidden_size": 64, "patch_size": QWEN_VL_PATCH, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0, 1]},
    }


def qwen3_vl_tiny(path: Path):
    """A random Qwen3-VL (3-block tower of 32 wide, a 4x4 learned position table, DeepStack
    after blocks 0 and 1; 3-layer Qwen3 text model of 64 wide) whose `config.json` is in the
    published layout, with Qwen2.5-VL's tiny tokenizer, template and preprocessor config.
    Returns the torch model (eager), the oracle."""
    import json

    vocab = {f"t{i}": i for i in range(QWEN_VL_WORDS)}
    vocab.update({t: QWEN_VL_WORDS + i for i, t in enumerate(QWEN_VL_SPECIAL)})
    published = qwen3_vl_published(len(vocab))
    config = transformers.Qwen3VLConfig(**published)
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    randomize(model, norm_offset=1.0)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(published))
    _qwen_vl_files(path, vocab)
    return model
