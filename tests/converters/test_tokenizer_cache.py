"""Tokenizers kept on disk (converters/tokenizer_cache.py): a warm start unpickles the tokenizer
that the first one built from the bundled SmolLM2 GGUF, which behaves exactly as a fresh build;
other metadata or an unreadable file builds afresh."""

from __future__ import annotations

import pytest

from converters import tokenizer_cache
from converters.gguf_file import GGUFModel
from converters.source import default_model_path

TEXTS = ["Hi", "The three primary colors are", "  two  spaces, émojis 🙂 and\ttabs\n",
         "<|im_start|>user\nhello<|im_end|>", "<|endoftext|> after eos"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def _behaviour(tok) -> dict:
    return {
        "encode": [tok(t).input_ids for t in TEXTS],
        "encode_plain": [tok(t, add_special_tokens=False).input_ids for t in TEXTS],
        "decode": [tok.decode(tok(t).input_ids) for t in TEXTS],
        "chat": tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        "specials": (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id,
                     tok.all_special_ids),
        "vocab": tok.get_vocab(),
        "backend": tok.backend_tokenizer.to_str(),
    }


def test_a_warm_start_loads_the_tokenizer_a_fresh_build_would_make(cache_home, monkeypatch):
    gg = GGUFModel(default_model_path())
    fresh = gg.tokenizer()
    assert len(list((cache_home / "jengine" / "tokenizers").glob("*.pkl"))) == 1

    from transformers.integrations.gguf import gguf_tokenizer_mapping

    def no_build(*args):
        raise AssertionError("built again although the cache holds it")

    monkeypatch.setattr(gguf_tokenizer_mapping, "convert_gguf_tokenizer", no_build)
    warm = GGUFModel(default_model_path()).tokenizer()
    assert type(warm) is type(fresh)
    assert _behaviour(warm) == _behaviour(fresh)


def test_other_metadata_builds_afresh(cache_home):
    gg = GGUFModel(default_model_path())
    built = []

    def build():
        built.append(1)
        return gg._build_tokenizer()

    inputs = {"arch": gg.arch, "tokenizer.ggml.tokens": ["a", "b"]}
    tokenizer_cache.cached_tokenizer(inputs, build)
    tokenizer_cache.cached_tokenizer(inputs, build)
    assert built == [1]
    tokenizer_cache.cached_tokenizer({**inputs, "tokenizer.ggml.tokens": ["a", "c"]}, build)
    assert built == [1, 1]


def test_an_unreadable_file_is_built_again_and_replaced(cache_home, caplog):
    gg = GGUFModel(default_model_path())
    gg.tokenizer()
    (path,) = (cache_home / "jengine" / "tokenizers").glob("*.pkl")
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    with caplog.at_level("WARNING", logger="jengine"):
        tok = GGUFModel(default_model_path()).tokenizer()
    assert "unreadable" in caplog.text
    assert tok("Hi").input_ids == gg._build_tokenizer()("Hi").input_ids
    assert len(path.read_bytes()) > 1000
