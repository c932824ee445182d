"""n-gram speculation on a bf16 model (the AMX CPUs' default dtype) against plain decoding, to the
bit: the engine-level check of the attention kernel's batch-invariant decode rows
(tests/test_cpu_attention.py checks the kernel's bits). Its own module, so that its two engines
are built early in the suite: late in a full run (94%), building them crashed inside JAX's
compilation-cache write twice, which the module alone never did (docs/engine.md)."""

from __future__ import annotations

import gc

from test_speculative import REPETITIVE

from jengine import Engine, SamplingParams


def test_bf16_greedy_tokens_and_logprobs_are_a_plain_decodes():
    """In bf16 (the AMX CPUs' default) a verification's rows give a plain decode's tokens and
    logprobs to the bit: each attention row of a decode-sized block is summed over key chunks at
    fixed positions on the row path whatever its block's extent (tests/test_cpu_attention.py
    checks the bits), bucket padding no longer joins a lone sequence's block, and the norms and
    the log-normaliser sum a row in one order in any number of rows (`layers.row_sum`: XLA's
    reduce changes its order from 8 rows, which 8-row verifications, k = 7, reach)."""
    prompt = " ".join(REPETITIVE * 3)  # 333 tokens: verifications cross pages 20-21
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    outs = []
    for kw in ({}, dict(speculative="ngram", num_speculative_tokens=7)):
        engine = Engine(config="test", dtype="bfloat16", progress=False, **kw)
        outs.append(engine.generate([prompt], sp)[0].outputs[0])
        if kw:
            assert engine.stats().spec_num_accepted_tokens > 0
        del engine
        gc.collect()
    plain, spec = outs
    assert spec.token_ids == plain.token_ids
    got = [lp[t].logprob for lp, t in zip(spec.logprobs, spec.token_ids)]
    want = [lp[t].logprob for lp, t in zip(plain.logprobs, plain.token_ids)]
    assert got == want
