"""The engine end to end on the real SmolLM2 (f32): batching invariance, chunked prefill,
preemption, seeded sampling, n > 1, streaming, async abort, bad input, no recompiles."""

from __future__ import annotations

import asyncio
import random

import pytest
from kv_pool import small_kv_pool  # tests/kv_pool.py

from jengine import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _prompts(tokenizer) -> list[str | list[int]]:
    """16 prompts of mixed lengths: plain text, chat-templated, and raw token ids."""
    topics = [
        "the history of the printing press", "how vaccines train the immune system",
        "why the sky is blue", "the rules of chess", "making sourdough bread",
        "the life cycle of stars", "how a bicycle stays upright", "the causes of inflation",
    ]
    prompts: list[str | list[int]] = []
    for i, topic in enumerate(topics):
        chat = [{"role": "user", "content": f"Explain {topic}" + " in detail, please" * (i % 4)}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompts.append(list(tokenizer(text, add_special_tokens=False).input_ids))
        prompts.append(f"Once upon a time, {topic}" + " was told again and again" * (i % 3))
    return prompts


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def solo(smol_engine):
    """Each prompt's greedy output when it runs alone."""
    prompts = _prompts(smol_engine.tokenizer)
    return prompts, [smol_engine.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


def test_batch_equals_solo(smol_engine, solo):
    prompts, expected = solo
    assert _token_ids(smol_engine.generate(prompts, GREEDY)) == expected
    assert smol_engine.stats().kv_pages_used == 0


def test_small_prefill_chunks_equal_solo(smol_engine, solo):
    prompts, expected = solo
    sched = smol_engine.core.scheduler
    saved = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 7  # every prompt is split over several steps
    try:
        assert _token_ids(smol_engine.generate(prompts, GREEDY)) == expected
    finally:
        sched.max_num_batched_tokens = saved


def test_preempted_requests_finish_with_same_output(smol_engine, solo):
    prompts, expected = solo
    core = smol_engine.core
    before = core.scheduler.num_preemptions
    # 13 usable pages: far fewer than 16 requests need
    with small_kv_pool(core, 14):
        assert _token_ids(smol_engine.generate(prompts, GREEDY)) == expected
        assert core.scheduler.num_preemptions > before
        assert core.stats().kv_pages_used == 0


def test_seeded_sample_independent_of_batch(smol_engine):
    prompt = "Write a short poem about the sea."
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = smol_engine.generate([prompt], params)[0].outputs[0].token_ids
    others = [
        SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=7),
        SamplingParams(max_tokens=30, temperature=0),
        SamplingParams(max_tokens=25, temperature=1.2, min_p=0.1, seed=99),
    ]
    prompts = ["Tell me about Paris.", prompt, "List three fruits:", "Count: one, two,"]
    outs = smol_engine.generate(prompts, [others[0], params, others[1], others[2]])
    assert outs[1].outputs[0].token_ids == alone
    different = smol_engine.generate([prompt], SamplingParams(
        max_tokens=20, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def test_n_samples(smol_engine):
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    [out] = smol_engine.generate(["The weather today is"], params)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.usage.completion_tokens == 30
    again = smol_engine.generate(["The weather today is"], params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_stream_deltas_join_to_generate(smol_engine):
    params = SamplingParams(max_tokens=20, temperature=0)
    full = smol_engine.generate(["Name the planets of the solar system:"], params)[0].outputs[0]
    deltas = list(smol_engine.stream("Name the planets of the solar system:", params))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas if d.outputs) == full.text
    assert sum((d.outputs[0].token_ids for d in deltas if d.outputs), []) == full.token_ids
    assert deltas[-1].outputs[0].finish_reason == full.finish_reason


def test_stop_string_never_leaks(smol_engine):
    base = smol_engine.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=16, temperature=0))
    text = base[0].outputs[0].text
    stop = text.strip()[2:5]
    assert stop and stop in text
    out = smol_engine.generate(["1, 2, 3, 4,"], SamplingParams(
        max_tokens=16, temperature=0, stop=[stop]))[0].outputs[0]
    assert stop not in out.text and text.startswith(out.text)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = smol_engine.generate(["1, 2, 3, 4,"], SamplingParams(
        max_tokens=16, temperature=0, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text.endswith(stop)


def test_stop_token_ids_and_min_tokens(smol_engine):
    greedy = smol_engine.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, temperature=0))
    ids = greedy[0].outputs[0].token_ids
    out = smol_engine.generate(["1, 2, 3, 4,"], SamplingParams(
        max_tokens=12, temperature=0, stop_token_ids=[ids[3]]))[0].outputs[0]
    first = ids.index(ids[3])
    assert out.token_ids == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ids[3]
    delayed = smol_engine.generate(["1, 2, 3, 4,"], SamplingParams(
        max_tokens=12, temperature=0, stop_token_ids=[ids[3]], min_tokens=8))[0].outputs[0]
    assert len(delayed.token_ids) >= 8


def test_eos_stops_unless_ignored(smol_engine):
    chat = smol_engine.render_chat([{"role": "user", "content": "Say hi."}])
    out = smol_engine.generate([chat], SamplingParams(max_tokens=200, temperature=0))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] in smol_engine.core.eos_token_ids
    ignored = smol_engine.generate([chat], SamplingParams(
        max_tokens=len(out.outputs[0].token_ids) + 5, temperature=0, ignore_eos=True))[0]
    assert ignored.outputs[0].finish_reason == "length"


def test_logprobs(smol_engine):
    out = smol_engine.generate(["The capital of France is"], SamplingParams(
        max_tokens=5, temperature=0, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) in (3, 4)
        assert entry[token].rank == 1  # greedy: the chosen token is the most likely
        ranked = sorted(v.logprob for v in entry.values())
        assert all(v <= 0 for v in ranked)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "empty"),
        ("word " * 600, SamplingParams(), "context length"),
        ("hello", SamplingParams(max_tokens=600), "exceeds the context length"),
        ([10**9], SamplingParams(), "out of range"),
    ],
)
def test_bad_requests_rejected_and_engine_keeps_serving(smol_engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        smol_engine.generate([prompt], params)
    assert smol_engine.stats().kv_pages_used == 0
    assert not smol_engine.core.requests
    out = smol_engine.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"stop": 42}, "stop"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_async_engine_streams_and_abort_frees_pages(smol_engine):
    from jengine.async_engine import AsyncEngine

    engine = AsyncEngine.__new__(AsyncEngine)  # share the session engine's core (one model)
    AsyncEngine._start(engine, smol_engine.core)

    async def run():
        params = SamplingParams(max_tokens=12, temperature=0)
        texts = []
        async for delta in engine.generate("The capital of France is", params):
            texts.append(delta.outputs[0].text if delta.outputs else "")
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        got = 0
        stream = engine.generate("Tell me a long story.", long, request_id="to-abort")
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()  # closing the stream aborts the request
        for _ in range(200):  # the engine thread applies the abort on its next turn
            if "to-abort" not in engine.core.requests:
                break
            await asyncio.sleep(0.05)
        assert "to-abort" not in engine.core.requests
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate("", params):
                pass
        return "".join(texts)

    try:
        text = asyncio.run(run())
    finally:
        engine.shutdown()  # before this thread steps the same core again
    assert smol_engine.stats().kv_pages_used == 0 and not smol_engine.core.requests
    expected = smol_engine.generate(["The capital of France is"], SamplingParams(
        max_tokens=12, temperature=0))[0].outputs[0].text
    assert text == expected


def test_no_recompiles_after_warmup(smol_engine):
    rng = random.Random(0)
    words = "alpha beta gamma delta the of and a to in is it that was for on".split()
    prompts, params = [], []
    for _ in range(24):
        prompts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))))
        kind = rng.randrange(5)
        common = dict(max_tokens=rng.randint(1, 16), seed=rng.randrange(1000))
        params.append([
            SamplingParams(temperature=0, **common),
            SamplingParams(temperature=0.8, **common),
            SamplingParams(temperature=1.0, top_k=rng.randint(1, 50), **common),
            SamplingParams(temperature=0.7, top_p=rng.uniform(0.1, 1.0), **common),
            SamplingParams(temperature=0.9, min_p=0.05, stop=["the"], **common),
        ][kind])
    before = smol_engine.core.compiles_since_ready
    outs = smol_engine.generate(prompts, params)
    assert len(outs) == 24
    assert smol_engine.core.compiles_since_ready == before


def test_prompt_logprobs_match_a_full_forward(smol_engine):
    """prompt_logprobs (computed chunk by chunk in the step) equal log_softmax of HF-style
    teacher-forced logits from the paged model path in one go."""
    import jax
    import numpy as np
    from paged import run_paged

    prompt = "The quick brown fox jumps over the lazy dog because"
    sched = smol_engine.core.scheduler
    saved = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 5  # several prefill chunks
    try:
        [out] = smol_engine.generate([prompt], SamplingParams(
            max_tokens=2, temperature=0, prompt_logprobs=2))
    finally:
        sched.max_num_batched_tokens = saved
    ids = out.prompt_token_ids
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    core = smol_engine.core
    logits = run_paged((core.model_config, core.runner.params), ids, prefill_chunk=64,
                       decode_steps=0, page_size=16)
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert ids[pos] in entry and 2 <= len(entry) <= 3
        np.testing.assert_allclose(entry[ids[pos]].logprob, ref[pos - 1, ids[pos]], atol=2e-4)
        best = int(np.argmax(ref[pos - 1]))
        assert best in entry and entry[best].rank == 1
