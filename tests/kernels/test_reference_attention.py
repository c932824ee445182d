"""`ragged_paged_attention` (after `write_kv`) against dense causal attention in NumPy float64.

Each case builds a ragged batch: every sequence has `cached` tokens of context already in the
cache (written by an earlier `write_kv`) and `q_len` new query tokens whose K/V are written in
this step; a decode is `q_len == 1`. Pages are drawn shuffled from the pool (never page 0), and
every slot not written holds large finite garbage, so reading a wrong slot, page or layer shows.
The oracle, per sequence and head, is softmax(q·k * scale [soft-capped], masked causal [and to
the sliding window]) · v over the sequence's own keys, in float64.

Conventions checked: query head h reads kv head h // (H / K) (HF `repeat_kv`); a sliding window
W lets the query at position p see keys at positions p-W+1..p; soft-capping applies to the scaled
scores, cap * tanh(s / cap). Tolerance: 1e-5 (relative and absolute) on float32 inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.pallas_kernels import (
    blocked_paged_attention,
    num_query_blocks,
    query_blocks,
    ragged_paged_attention,
    write_kv,
)

TOL = 1e-5
HEAD_DIM = 16
NUM_LAYERS = 2
LAYER = 1  # the layer the test writes and reads; layer 0 holds garbage
GARBAGE = 1e3


def dense_attention(q, k, v, q_positions, *, sm_scale, window=None, soft_cap=None, chunk=None):
    """q [N, H, D] at `q_positions`; k, v [L, K, D] at positions 0..L-1 -> [N, H, D] float64.
    `chunk`: a query sees only the keys of its own `chunk`-position chunk (Llama 4's)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    num_heads, num_kv = q.shape[1], k.shape[1]
    group = num_heads // num_kv
    out = np.zeros(q.shape, np.float64)
    key_pos = np.arange(k.shape[0])
    for t, p in enumerate(q_positions):
        allowed = key_pos <= p
        if window is not None:
            allowed &= key_pos > p - window
        if chunk is not None:
            allowed &= key_pos // chunk == p // chunk
        for h in range(num_heads):
            s = k[allowed, h // group] @ q[t, h] * sm_scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[allowed, h // group]
    return out


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap"))
def _step(k_cache, v_cache, slots, new_k, new_v, q, token_seq, positions, page_table, window,
          *, sm_scale, soft_cap):
    """The engine's order: write this step's K/V, then attend."""
    layer = jnp.int32(LAYER)
    k_cache = write_kv(k_cache, layer, slots, new_k)
    v_cache = write_kv(v_cache, layer, slots, new_v)
    out = ragged_paged_attention(
        q, k_cache, v_cache, layer, token_seq, positions, page_table,
        sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap,
    )
    return out, k_cache, v_cache


class Case:
    """A ragged batch over a shuffled page pool, its cache already holding the cached context."""

    def __init__(self, seqs, *, num_heads, num_kv_heads, page_size, seed=0, extra_pages=3,
                 head_dim=HEAD_DIM):
        """`seqs`: (cached, q_len) per sequence."""
        rng = np.random.default_rng(seed)
        self.rng, self.seqs, self.page_size = rng, seqs, page_size
        self.num_heads, self.num_kv, self.head_dim = num_heads, num_kv_heads, head_dim
        kv_lens = [c + q for c, q in seqs]
        pages_per_seq = [-(-n // page_size) for n in kv_lens]
        self.num_pages = 1 + sum(pages_per_seq) + extra_pages
        pool = rng.permutation(np.arange(1, self.num_pages))
        width = max(pages_per_seq) + 1  # one padding column of page 0, as a bucket would add
        self.page_table = np.zeros((len(seqs), width), np.int32)
        start = 0
        for i, n in enumerate(pages_per_seq):
            self.page_table[i, :n] = pool[start:start + n]
            start += n
        shape = (NUM_LAYERS, num_kv_heads, self.num_pages, page_size, head_dim)
        self.k_cache = jnp.asarray(rng.uniform(-GARBAGE, GARBAGE, shape), jnp.float32)
        self.v_cache = jnp.asarray(rng.uniform(-GARBAGE, GARBAGE, shape), jnp.float32)
        # Full K/V/Q of every sequence, [kv_len, K|H, D].
        self.k = [rng.normal(size=(n, num_kv_heads, head_dim)).astype(np.float32) for n in kv_lens]
        self.v = [rng.normal(size=(n, num_kv_heads, head_dim)).astype(np.float32) for n in kv_lens]
        self.q = [rng.normal(size=(q, num_heads, head_dim)).astype(np.float32) for _, q in seqs]
        # An earlier step wrote the cached context.
        cached_slots = np.concatenate(
            [self.slots(i, np.arange(c)) for i, (c, _) in enumerate(seqs)] + [np.zeros(0, int)]
        )
        if cached_slots.size:
            ck = np.concatenate([k[:c] for k, (c, _) in zip(self.k, seqs)])
            cv = np.concatenate([v[:c] for v, (c, _) in zip(self.v, seqs)])
            self.k_cache = write_kv(self.k_cache, jnp.int32(LAYER), jnp.asarray(cached_slots),
                                    jnp.asarray(ck))
            self.v_cache = write_kv(self.v_cache, jnp.int32(LAYER), jnp.asarray(cached_slots),
                                    jnp.asarray(cv))

    def slots(self, i: int, positions: np.ndarray) -> np.ndarray:
        ps = self.page_size
        return self.page_table[i, positions // ps].astype(np.int64) * ps + positions % ps

    def step_inputs(self):
        """Flat [T] arrays of this step's query tokens (in batch order)."""
        token_seq, positions, slots, new_k, new_v, q = [], [], [], [], [], []
        for i, (c, n) in enumerate(self.seqs):
            pos = np.arange(c, c + n)
            token_seq.append(np.full(n, i))
            positions.append(pos)
            slots.append(self.slots(i, pos))
            new_k.append(self.k[i][c:])
            new_v.append(self.v[i][c:])
            q.append(self.q[i])
        return {
            "slots": np.concatenate(slots).astype(np.int32),
            "new_k": np.concatenate(new_k),
            "new_v": np.concatenate(new_v),
            "q": np.concatenate(q),
            "token_seq": np.concatenate(token_seq).astype(np.int32),
            "positions": np.concatenate(positions).astype(np.int32),
        }

    def run(self, inputs=None, *, window=None, soft_cap=None):
        x = inputs or self.step_inputs()
        out, k_cache, v_cache = _step(
            self.k_cache, self.v_cache, jnp.asarray(x["slots"]), jnp.asarray(x["new_k"]),
            jnp.asarray(x["new_v"]), jnp.asarray(x["q"]), jnp.asarray(x["token_seq"]),
            jnp.asarray(x["positions"]), jnp.asarray(self.page_table),
            None if window is None else jnp.int32(window),
            sm_scale=self.head_dim ** -0.5, soft_cap=soft_cap,
        )
        return np.asarray(out), np.asarray(k_cache), np.asarray(v_cache)

    def expected(self, *, window=None, soft_cap=None, chunk=None):
        rows = []
        for i, (c, n) in enumerate(self.seqs):
            rows.append(dense_attention(self.q[i], self.k[i], self.v[i], np.arange(c, c + n),
                                        sm_scale=self.head_dim ** -0.5, window=window,
                                        soft_cap=soft_cap, chunk=chunk))
        return np.concatenate(rows)


MIXED = [(9, 1), (0, 7), (4, 5), (13, 1), (0, 1), (6, 12)]  # decodes, fresh and chunked prefills
# Batches of one kind each, with the page boundaries the kernels must get right
# ((cached, q_len) per sequence, as `Case` takes them; shared by the kernel tests).
SHAPES = {
    "decode_only": [(9, 1), (4, 1), (15, 1), (0, 1), (30, 1)],
    "prefill_only": [(0, 7), (0, 12), (0, 3)],
    "kv_len_1": [(0, 1)],
    "decodes_on_page_multiples": [(7, 1), (3, 1)],
    "chunks_ending_on_pages": [(0, 8), (4, 4), (8, 8)],
    "chunks_opening_pages": [(8, 1), (0, 9), (15, 2)],
}


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])
def test_ragged_mixed_batch_matches_dense_causal_attention(num_heads, num_kv_heads):
    case = Case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, page_size=4, seed=1)
    out, _, _ = case.run()
    np.testing.assert_allclose(out, case.expected(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("window", [1, 3, 4, 8, 64])
def test_sliding_window(window):
    """Windows smaller than a chunk (3 < 12), equal to a page, and wider than any sequence."""
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=2)
    out, _, _ = case.run(window=window)
    np.testing.assert_allclose(out, case.expected(window=window), rtol=TOL, atol=TOL)
    if window < 18:  # the window must actually change something
        assert not np.allclose(out, case.expected(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 1)],  # kv_len 1: a one-token prompt
        [(7, 1), (3, 1)],  # decodes whose kv_len is a multiple of the page size
        [(0, 8), (4, 4), (8, 8)],  # chunks that end exactly on page boundaries
        [(8, 1), (0, 9), (15, 2)],  # a decode and chunks that open a new page
    ],
)
def test_page_boundaries(seqs):
    case = Case(seqs, num_heads=3, num_kv_heads=1, page_size=4, seed=3)
    out, _, _ = case.run()
    np.testing.assert_allclose(out, case.expected(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("page_size", [1, 16])
def test_other_page_sizes(page_size):
    case = Case(MIXED, num_heads=4, num_kv_heads=2, page_size=page_size, seed=4)
    out, _, _ = case.run()
    np.testing.assert_allclose(out, case.expected(), rtol=TOL, atol=TOL)


def test_soft_cap():
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=5)
    # Scale q up so scores reach the cap's non-linear range.
    case.q = [q * 8 for q in case.q]
    out, _, _ = case.run(soft_cap=5.0)
    np.testing.assert_allclose(out, case.expected(soft_cap=5.0), rtol=TOL, atol=TOL)
    assert not np.allclose(out, case.expected(), rtol=1e-3, atol=1e-3)


def test_soft_cap_with_sliding_window():
    case = Case(MIXED, num_heads=8, num_kv_heads=1, page_size=4, seed=6)
    case.q = [q * 8 for q in case.q]
    out, _, _ = case.run(window=5, soft_cap=10.0)
    np.testing.assert_allclose(out, case.expected(window=5, soft_cap=10.0), rtol=TOL, atol=TOL)


def test_write_kv_writes_only_the_mapped_slots_of_the_layer():
    case = Case(MIXED, num_heads=2, num_kv_heads=2, page_size=4, seed=7)
    before_k = np.asarray(case.k_cache)
    x = case.step_inputs()
    _, k_cache, _ = case.run(x)
    # [L, K, P, O, D] -> [L, slot, K, D]
    flat = np.asarray(k_cache).reshape(NUM_LAYERS, 2, -1, HEAD_DIM).transpose(0, 2, 1, 3)
    flat_before = before_k.reshape(NUM_LAYERS, 2, -1, HEAD_DIM).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(flat[LAYER, x["slots"]], x["new_k"])
    untouched = np.ones(flat.shape[1], bool)
    untouched[x["slots"]] = False
    np.testing.assert_array_equal(flat[LAYER, untouched], flat_before[LAYER, untouched])
    np.testing.assert_array_equal(flat[1 - LAYER], flat_before[1 - LAYER])


def test_padding_tokens_do_not_change_real_outputs():
    """Bucket padding: extra tokens of sequence 0 at position 0 writing into page 0."""
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=8)
    x = case.step_inputs()
    out, k_cache, _ = case.run(x)
    num_pad = 5
    rng = np.random.default_rng(9)
    padded = {
        "slots": np.concatenate([x["slots"], np.arange(num_pad) % case.page_size]),
        "new_k": np.concatenate([x["new_k"], rng.normal(size=(num_pad, 2, HEAD_DIM)) * 50]),
        "new_v": np.concatenate([x["new_v"], rng.normal(size=(num_pad, 2, HEAD_DIM)) * 50]),
        "q": np.concatenate([x["q"], rng.normal(size=(num_pad, 6, HEAD_DIM))]),
        "token_seq": np.concatenate([x["token_seq"], np.zeros(num_pad, int)]),
        "positions": np.concatenate([x["positions"], np.zeros(num_pad, int)]),
    }
    padded = {name: a.astype(x[name].dtype) for name, a in padded.items()}
    out_padded, k_padded, _ = case.run(padded)
    n = len(x["slots"])
    # A different token count compiles a different program: equal up to rounding, not bitwise.
    np.testing.assert_allclose(out_padded[:n], out, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(out_padded[:n], case.expected(), rtol=TOL, atol=TOL)
    assert np.isfinite(out_padded).all()
    # Only the scratch page differs.
    np.testing.assert_array_equal(k_padded[:, :, 1:], k_cache[:, :, 1:])


# -- blocked_paged_attention (the reference backend's prefill-heavy steps) -------------------


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "kv_head_map", "loop"))
def _blocked_step(k_cache, v_cache, slots, new_k, new_v, q, positions, page_table, block_tokens,
                  block_seq, window, chunk=None, *, sm_scale, soft_cap, kv_head_map, loop):
    layer = jnp.int32(LAYER)
    k_cache = write_kv(k_cache, layer, slots, new_k)
    v_cache = write_kv(v_cache, layer, slots, new_v)
    return blocked_paged_attention(
        q, k_cache, v_cache, layer, positions, page_table, block_tokens, block_seq,
        sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap, kv_head_map=kv_head_map,
        attention_chunk=chunk, blocks_per_group=loop[0], pages_per_chunk=loop[1],
    )


def _run_blocked(case, *, block, num_blocks=None, loop=(4, 8), window=None, soft_cap=None,
                 kv_head_map=None, empty_first=0, chunk=None):
    """`case`'s step through `blocked_paged_attention`; `num_blocks` defaults to the runner's
    bound for this many tokens and sequences; `empty_first` empty blocks lead the real ones."""
    x = case.step_inputs()
    q_lens = [n for _, n in case.seqs]
    num_tokens = len(x["slots"])
    if num_blocks is None:
        num_blocks = num_query_blocks(num_tokens, len(q_lens), block)
    tokens, seqs = query_blocks(q_lens, num_tokens, num_blocks, block)
    if empty_first:
        tokens = np.concatenate([np.full((empty_first, block), num_tokens, np.int32), tokens])
        seqs = np.concatenate([np.zeros(empty_first, np.int32), seqs])
    out = _blocked_step(
        case.k_cache, case.v_cache, jnp.asarray(x["slots"]), jnp.asarray(x["new_k"]),
        jnp.asarray(x["new_v"]), jnp.asarray(x["q"]), jnp.asarray(x["positions"]),
        jnp.asarray(case.page_table), jnp.asarray(tokens), jnp.asarray(seqs),
        None if window is None else jnp.int32(window),
        None if chunk is None else jnp.int32(chunk), sm_scale=HEAD_DIM ** -0.5,
        soft_cap=soft_cap, kv_head_map=kv_head_map, loop=loop,
    )
    return np.asarray(out)


def _ragged_with_map(case, kv_head_map):
    x = case.step_inputs()
    k_cache = write_kv(case.k_cache, jnp.int32(LAYER), jnp.asarray(x["slots"]),
                       jnp.asarray(x["new_k"]))
    v_cache = write_kv(case.v_cache, jnp.int32(LAYER), jnp.asarray(x["slots"]),
                       jnp.asarray(x["new_v"]))
    return np.asarray(ragged_paged_attention(
        jnp.asarray(x["q"]), k_cache, v_cache, jnp.int32(LAYER), jnp.asarray(x["token_seq"]),
        jnp.asarray(x["positions"]), jnp.asarray(case.page_table), sm_scale=HEAD_DIM ** -0.5,
        kv_head_map=kv_head_map,
    ))


@pytest.mark.parametrize(
    ("block", "num_blocks", "loop"),
    [
        (4, None, (4, 8)),  # the runner's bound, one group per few blocks
        (4, 40, (2, 1)),  # many empty blocks past the real ones, one page per chunk
        (8, 7, (1, 2)),  # exactly the real block count: one block per group
        (16, None, (8, 3)),  # one group holds every block; chunks not a divisor of the span
    ],
)
def test_blocked_matches_ragged(block, num_blocks, loop):
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=10)
    out = _run_blocked(case, block=block, num_blocks=num_blocks, loop=loop)
    ragged, _, _ = case.run()
    np.testing.assert_allclose(out, ragged, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(out, case.expected(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("seqs", list(SHAPES.values()), ids=list(SHAPES))
def test_blocked_page_and_chunk_boundaries(seqs):
    """Spans ending on pages and on chunks (2 pages of 4 keys), decodes as one-row blocks."""
    case = Case(seqs, num_heads=3, num_kv_heads=1, page_size=4, seed=11)
    out = _run_blocked(case, block=4, loop=(2, 2))
    np.testing.assert_allclose(out, case.expected(), rtol=TOL, atol=TOL)


def test_blocked_empty_blocks_anywhere():
    """Empty blocks before the real ones (a whole empty group, then a mixed one) change
    nothing: the loop runs up to the last group with work, whatever the order."""
    case = Case(MIXED, num_heads=4, num_kv_heads=2, page_size=4, seed=12)
    out = _run_blocked(case, block=4, loop=(2, 4), empty_first=3)
    np.testing.assert_allclose(out, case.expected(), rtol=TOL, atol=TOL)


def test_blocked_long_context():
    """A 40-token chunk over 1000 cached keys (many chunks), a fresh prompt and a decode."""
    case = Case([(1000, 40), (0, 33), (500, 1)], num_heads=9, num_kv_heads=3, page_size=16,
                seed=13)
    out = _run_blocked(case, block=32)
    np.testing.assert_allclose(out, case.expected(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize(("window", "soft_cap"), [(3, None), (9, None), (64, 5.0), (5, 10.0)])
def test_blocked_sliding_window_and_soft_cap(window, soft_cap):
    """Windows narrower than a block (its first visible page moves per block) and wider."""
    case = Case(MIXED + [(40, 9)], num_heads=6, num_kv_heads=2, page_size=4, seed=14)
    if soft_cap is not None:
        case.q = [q * 8 for q in case.q]
    out = _run_blocked(case, block=4, loop=(2, 2), window=window, soft_cap=soft_cap)
    want = case.expected(window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("chunk", [3, 8, 16])
def test_attention_chunks(chunk):
    """Llama 4's chunked attention, per token and per query block: a chunk narrower than a
    page, two pages wide, and wider than the pages of a key chunk (the blocks' first visible
    page moves with it)."""
    case = Case(MIXED + [(40, 9)], num_heads=6, num_kv_heads=2, page_size=4, seed=16)
    want = case.expected(chunk=chunk)
    assert not np.allclose(want, case.expected(), rtol=TOL, atol=TOL)
    x = case.step_inputs()
    k_cache = write_kv(case.k_cache, jnp.int32(LAYER), jnp.asarray(x["slots"]),
                       jnp.asarray(x["new_k"]))
    v_cache = write_kv(case.v_cache, jnp.int32(LAYER), jnp.asarray(x["slots"]),
                       jnp.asarray(x["new_v"]))
    ragged = ragged_paged_attention(
        jnp.asarray(x["q"]), k_cache, v_cache, jnp.int32(LAYER), jnp.asarray(x["token_seq"]),
        jnp.asarray(x["positions"]), jnp.asarray(case.page_table), sm_scale=HEAD_DIM ** -0.5,
        attention_chunk=jnp.int32(chunk))
    np.testing.assert_allclose(np.asarray(ragged), want, rtol=TOL, atol=TOL)
    blocked = _run_blocked(case, block=4, loop=(2, 2), chunk=chunk)
    np.testing.assert_allclose(blocked, want, rtol=TOL, atol=TOL)


def test_blocked_kv_head_map():
    """An explicit q -> kv head map (tensor parallel with replicated kv heads): every q head
    its own row, in any order."""
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=15)
    head_map = (1, 0, 0, 1, 1, 0)
    out = _run_blocked(case, block=4, loop=(2, 2), kv_head_map=head_map)
    np.testing.assert_allclose(out, _ragged_with_map(case, head_map), rtol=TOL, atol=TOL)


def test_blocked_reads_only_visible_pages():
    """Pages no query may see hold NaN (even a masked NaN key or value would poison the sum,
    as 0 * NaN is NaN): pages wholly before the window, and page-table columns past each
    sequence's pages pointing at a NaN page, as a wide pages bucket has. The per-token path
    gathers them all; the blocked one must read none."""
    window = 3
    case = Case([(40, 9), (13, 6), (0, 5)], num_heads=4, num_kv_heads=2, page_size=4, seed=16)
    ps = case.page_size
    used = set(case.page_table.ravel().tolist())
    poison = next(p for p in range(1, case.num_pages) if p not in used)
    hidden = [poison]
    for i, (cached, _) in enumerate(case.seqs):
        first_visible = max(0, cached - window + 1)
        hidden += case.page_table[i, : first_visible // ps].tolist()
    nan = jnp.float32(jnp.nan)
    case.k_cache = case.k_cache.at[LAYER, :, jnp.asarray(hidden)].set(nan)
    case.v_cache = case.v_cache.at[LAYER, :, jnp.asarray(hidden)].set(nan)
    case.page_table[case.page_table == 0] = poison
    case.page_table = np.pad(case.page_table, ((0, 0), (0, 6)), constant_values=poison)
    out = _run_blocked(case, block=4, loop=(2, 2), window=window)
    np.testing.assert_allclose(out, case.expected(window=window), rtol=TOL, atol=TOL)
    assert np.isnan(case.run(window=window)[0]).any()  # the per-token path does read them
