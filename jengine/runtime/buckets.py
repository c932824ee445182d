"""`Buckets`: the declared step shapes (tokens T, sequences S, pages per sequence P) that every
step is padded to, so the engine runs a small, fixed set of compiled programs."""

from __future__ import annotations

import dataclasses

from jengine.pallas_kernels import num_query_blocks

QUERY_BLOCK = 32  # query rows per block in prefill-heavy steps (see pallas_kernels/reference.py)


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The step shapes the engine compiles: token counts, sequence counts, pages per sequence."""

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    pages: tuple[int, ...]

    @classmethod
    def default(cls, max_tokens: int, max_seqs: int, max_pages: int,
                min_tokens: int = 8, min_pages: int = 16) -> Buckets:
        """Powers of two from `min_tokens` (1 on CPU: XLA:CPU's dots run near memory speed
        for 1-2 rows but at half that for 8, so a lone decode padded to 8 took twice as long
        in its GEMMs) to `max_tokens`; pages likewise from `min_pages`."""
        tokens = _powers_of_two(min(min_tokens, max_tokens), max_tokens)
        pages = _powers_of_two(min(min_pages, max_pages), max_pages)
        return cls(
            tokens=tokens,
            seqs=tuple(sorted({min(t, max_seqs) for t in tokens})),
            pages=pages,
        )

    def pick(self, num_tokens: int, num_rows: int, num_pages: int) -> tuple[int, int, int]:
        """The bucket of a batch; `num_rows` (sampled rows, at least one per sequence) sizes S,
        which is both the page table's rows and the sampler's."""
        t = _first_at_least(self.tokens, max(num_tokens, num_rows, 1))
        return t, self.seqs_for(t), _first_at_least(self.pages, num_pages)

    def seqs_for(self, t: int) -> int:
        """The sequence bucket of token bucket `t`: the smallest seq bucket >= t, capped at the
        largest. Tying S to T keeps the program count at |tokens| x |pages|; a prefill-heavy
        step pays only for a few extra rows of logits."""
        return next((s for s in self.seqs if s >= t), self.seqs[-1])

    def blocked(self, t: int) -> bool:
        """Whether token bucket `t` groups queries into per-sequence blocks: only when it can
        hold more tokens than sequences (prefill chunks), where it saves re-reading KV."""
        return t > self.seqs_for(t)

    def num_blocks(self, t: int) -> int:
        """The block count of blocked bucket `t`: enough for any batch it holds (a sequence of
        n tokens fills ceil(n / B) blocks, at most (T + S (B - 1)) / B in all). One bound per
        bucket, not a bucket of its own: the attention stops after the last live block, so the
        bound's empty blocks cost no work and no extra program."""
        return num_query_blocks(t, self.seqs_for(t), QUERY_BLOCK)

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, P) `pick` can return."""
        return sorted({(t, self.seqs_for(t), p) for t in self.tokens for p in self.pages})


def _first_at_least(values: tuple[int, ...], n: int) -> int:
    for v in values:
        if v >= n:
            return v
    raise ValueError(f"{n} exceeds the largest bucket {values[-1]}")
