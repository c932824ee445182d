"""Stop rules: EOS (the scheduler's ids only, unless ignored), stop token ids, max_tokens,
max_model_len and min_tokens, with their finish and stop reasons; the fake runner of
`tests/scheduler_harness.py`."""

from __future__ import annotations

import pytest
from scheduler_harness import (  # tests/ is on sys.path under pytest
    EOS,
    VOCAB,
    Harness,
    params,
    prompt_of,
    solo_tokens,
)


def _natural(prompt, seed, num=40):
    return solo_tokens(prompt, seed, num)


def _seed_with_eos_at(prompt, index):
    """A seed whose natural output has its first EOS at `index`."""
    for seed in range(10_000):
        out = _natural(prompt, seed)
        if EOS in out and out.index(EOS) == index:
            return seed, out
    raise AssertionError("no such seed")


def test_eos_stops_with_stop_reason_none():
    prompt = prompt_of(6)
    seed, natural = _seed_with_eos_at(prompt, 4)
    h = Harness()
    h.add("a", prompt, params(max_tokens=20), seed)
    h.run()
    assert h.result("a") == [(natural[:5], "stop", None)]
    assert h.allocator.num_used == 0


def test_ignore_eos_keeps_going_to_max_tokens():
    prompt = prompt_of(6)
    seed, natural = _seed_with_eos_at(prompt, 4)
    h = Harness()
    h.add("a", prompt, params(max_tokens=20, ignore_eos=True), seed)
    h.run()
    assert h.result("a") == [(natural[:20], "length", None)]
    assert natural[4] == EOS


def test_eos_is_only_a_stop_for_the_schedulers_eos_ids():
    prompt = prompt_of(6)
    seed, natural = _seed_with_eos_at(prompt, 4)
    h = Harness(eos_token_ids=())
    h.add("a", prompt, params(max_tokens=20), seed)
    h.run()
    assert h.result("a") == [(natural[:20], "length", None)]


def test_stop_token_id_stops_with_the_id_as_stop_reason():
    prompt = prompt_of(6)
    natural = _natural(prompt, 4)
    stop = natural[5]
    first = natural.index(stop)
    h = Harness(eos_token_ids=())
    h.add("a", prompt, params(max_tokens=30, stop_token_ids=[stop, VOCAB + 1]), 4)
    h.run()
    assert h.result("a") == [(natural[: first + 1], "stop", stop)]


def test_stop_token_ids_apply_with_ignore_eos():
    prompt = prompt_of(6)
    seed, natural = _seed_with_eos_at(prompt, 4)
    first = next(i for i in range(5, 40) if natural[i] not in natural[:i])
    stop = natural[first]
    h = Harness()
    h.add("a", prompt, params(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]), seed)
    h.run()
    assert h.result("a") == [(natural[: first + 1], "stop", stop)]


def test_max_tokens_finishes_with_length():
    h = Harness(eos_token_ids=())
    h.add("a", prompt_of(6), params(max_tokens=7), 2)
    h.run()
    assert h.result("a") == [(_natural(prompt_of(6), 2)[:7], "length", None)]


def test_max_model_len_finishes_with_length():
    h = Harness(eos_token_ids=(), max_model_len=16)
    seq, = h.add("a", prompt_of(10), params(max_tokens=None), 2)
    assert seq.max_tokens == 6
    h.run()
    assert h.result("a") == [(_natural(prompt_of(10), 2)[:6], "length", None)]


@pytest.mark.parametrize("stop_kind", ["eos", "stop_token_ids"])
def test_min_tokens_delays_stops(stop_kind):
    """A stop token among the first `min_tokens` outputs is kept; the first one after ends it."""
    prompt = prompt_of(6)
    for seed in range(10_000):
        natural = _natural(prompt, seed)
        hits = [i for i, t in enumerate(natural) if t == EOS]
        if len(hits) >= 2 and hits[0] >= 1 and hits[1] - hits[0] >= 2:
            break
    min_tokens = hits[0] + 1  # the first stop token is output number min_tokens
    kw = {"stop_token_ids": [EOS]} if stop_kind == "stop_token_ids" else {}
    h = Harness(eos_token_ids=(EOS,) if stop_kind == "eos" else ())
    h.add("a", prompt, params(max_tokens=40, min_tokens=min_tokens, **kw), seed)
    h.add("b", prompt, params(max_tokens=40, **kw), seed)
    h.run()
    stop_reason = EOS if stop_kind == "stop_token_ids" else None
    assert h.result("a") == [(natural[: hits[1] + 1], "stop", stop_reason)]
    assert h.result("b") == [(natural[: hits[0] + 1], "stop", stop_reason)]


def test_min_tokens_does_not_delay_length():
    h = Harness()
    seed = 3
    h.add("a", prompt_of(4), params(max_tokens=5, min_tokens=5, ignore_eos=True), seed)
    h.run()
    assert h.result("a") == [(_natural(prompt_of(4), seed)[:5], "length", None)]
