"""n-gram speculation on a bf16 model (the AMX CPUs' default dtype) against plain decoding, to the
bit: the engine-level check of the attention kernel's batch-invariant decode rows
(tests/kernels/test_cpu_attention.py checks the kernel's bits). Its own module, so that its two
engines are built early in the suite: late in a full run (94%), building them crashed inside JAX's
compilation-cache write twice, which the module alone never did (docs/engine.md)."""

from __future__ import annotations

import gc

import pytest
from test_speculative import REPETITIVE
from verify_all import verifying_everything  # tests/verify_all.py

from jengine import Engine, SamplingParams, cpu_info

AMX = ("amx_tile", "amx_bf16", "amx_int8")
# The CPUs this machine kind comes with: this one's kernels, and those of an AMD EPYC (AVX-512,
# no AMX) and an AVX2-only CPU, taken by hiding the features they lack (cpu_info.hiding). A
# variant that would run what this CPU runs anyway is skipped.
PATHS = [pytest.param((), id="this-cpu"),
         pytest.param(AMX, id="avx512-no-amx", marks=[pytest.mark.slow, pytest.mark.skipif(
             not set(AMX) & cpu_info.flags(), reason="this CPU has no AMX: the same path")]),
         pytest.param(AMX + ("avx512f",), id="avx2", marks=[pytest.mark.slow, pytest.mark.skipif(
             "avx512f" not in cpu_info.flags(), reason="this CPU has no AVX-512: the same path")])]
# The hidden paths (~25 s each) are in the slow tier: CI runs this CPU's, and the no-AMX and
# AVX2 kernels' engine tokens in tests/kernels/test_packed_bf16.py and test_cpu_matmul.py.


@pytest.mark.slow  # ~22 s; CI: test_speculative's engine greedy unchanged by speculation
@pytest.mark.parametrize("hide", PATHS)
def test_bf16_greedy_tokens_and_logprobs_are_a_plain_decodes(hide):
    """In bf16 (the AMX CPUs' default) a verification's rows give a plain decode's tokens and
    logprobs to the bit: each attention row of a decode-sized block is summed over key chunks at
    fixed positions on the row path whatever its block's extent (tests/kernels/test_cpu_attention.py
    checks the bits), bucket padding no longer joins a lone sequence's block, and the norms and
    the log-normaliser sum a row in one order in any number of rows (`layers.row_sum`: XLA's
    reduce changes its order from 8 rows, which 8-row verifications, k = 7, reach).

    The same prompt again (`again`) finds its full pages cached and computes only its last
    partial page (until session 25 as 6 rows of the row path where the first run's 22-row
    block took the prefill path, whose K/V differ in the last bits; now the first run computes
    that page alone too). Filling that page then meets the first run's copy:
    a sequence that switched to the cache's copy there read other bits from the step after the
    page filled, and a verification that crossed the page's end read its own copy instead, so
    the two engines' logprobs parted (and, on near ties, their greedy text: docs/engine.md,
    "Session 23"). A sequence now keeps reading the pages it computed."""
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    with cpu_info.hiding(*hide):
        outs = [_runs(sp, kw) for kw in ({}, dict(speculative="ngram", num_speculative_tokens=7))]
    for plain, spec in zip(*outs):
        assert spec.token_ids == plain.token_ids
        got = [lp[t].logprob for lp, t in zip(spec.logprobs, spec.token_ids)]
        want = [lp[t].logprob for lp, t in zip(plain.logprobs, plain.token_ids)]
        assert got == want


def _runs(sp: SamplingParams, kw: dict) -> list:
    """Three greedy runs of one engine (`kw`: plain or n-gram) over the prompts below."""
    engine = Engine(config="test", dtype="bfloat16", progress=False, **kw)
    if kw:  # every proposal verified, so the crossing below happens on any machine
        verifying_everything(engine)
    prompt = " ".join(REPETITIVE * 3)  # 333 tokens: verifications cross pages 20-21
    # 342 tokens: after `prompt`'s 20 cached pages the first run computes page 20 and then
    # page 21's 6 rows in a step of their own (`prefix_reuse.chunk_limit`), the second only
    # those 6; its verification [350, 357) crosses page 21's end.
    again = (engine.tokenizer.encode(" ".join(REPETITIVE * 4)) * 2)[:342]
    runs = [engine.generate([p], sp)[0].outputs[0] for p in (prompt, again, again)]
    if kw:
        assert engine.stats().spec_num_accepted_tokens > 0
    assert engine.stats().prefix_cache_duplicate_pages > 0  # the case above was reached
    del engine
    gc.collect()
    return runs
