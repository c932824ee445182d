"""Incremental detokenization: generated token ids in, text deltas out, stop strings held back.

A token is not a unit of text. A byte-level BPE token can hold half of a UTF-8 character, and a
SentencePiece token's leading "▁" is a space only in context. So the text of new tokens is never
decoded on its own: a `_DecodeWindow` decodes a few already-emitted tokens plus the new ones and
emits the part of the text past the already-emitted tokens' text (vLLM's prefix_offset /
read_offset technique), and holds the new tokens back while the text ends in U+FFFD, the sign of
a character still incomplete. Each token costs two decodes of a handful of ids, whatever the
length of the sequence.

Stop strings are matched on that text by a `_StopMatcher`, which withholds any trailing text that
could still grow into a stop string, so that no part of one ever reaches the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first generated token, so that the latter decodes as it
# would mid-text (a SentencePiece "▁" stays a space); vLLM uses the same number.
PROMPT_CONTEXT_TOKENS = 5
# A character spans at most 4 bytes, so at most 4 tokens. Tokens are held back at most this long
# (a longer hold means malformed output: endless U+FFFD, or a long run of byte-fallback tokens),
# so that no call's cost grows with the length of the sequence. Past it, text is emitted up to
# the last cut that cannot split a character; malformed output may then show its replacement
# chars differently from a one-shot decode.
MAX_UNEMITTED_TOKENS = 16


def _special_ids_except(backend: Tokenizer, keep: Sequence[str]) -> frozenset[int]:
    """The ids of the tokenizer's special tokens, less those written as one of `keep`; empty
    when none of `keep` is a special token (then plain skipping does the same)."""
    special = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special}
    if not set(keep) & set(special.values()):
        return frozenset()
    return frozenset(i for i, text in special.items() if text not in keep)


@dataclasses.dataclass(frozen=True)
class DetokenizerDelta:
    """Text produced by one `IncrementalDetokenizer` call.

    Attributes:
      text: text new since the previous call, safe to show (whole characters, no stop string
        unless `include_stop_str_in_output`).
      stop_string: the stop string that ended the sequence in this call, or None.
    """

    text: str
    stop_string: str | None = None


class _DecodeWindow:
    """Decodes a token stream piecewise, emitting only whole characters.

    Holds the ids from `prefix_offset` on (earlier ones are dropped): `ids[:read]` were emitted
    already and decode to `prefix_text`; `ids[read:]` are not emitted yet.

    Besides text ending in U+FFFD, a run of SentencePiece byte-fallback tokens ("<0xE4>") is held
    until it ends: the decoder turns a whole run into U+FFFDs when any byte of it is invalid, so
    a valid-looking start of a run can still change.
    """

    def __init__(self, backend: Tokenizer, context_ids: list[int], skip_special_tokens: bool,
                 keep: Sequence[str] = ()):
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._drop: frozenset[int] = frozenset()
        if skip_special_tokens and keep:
            self._drop = _special_ids_except(backend, keep)
            self._skip_special_tokens = not self._drop  # the kept ones are no special tokens
        context = self._decode(context_ids)
        # A prompt cut inside a character would corrupt the first output character; start clean.
        self._ids = [] if context.endswith(REPLACEMENT_CHAR) else list(context_ids)
        self._read = len(self._ids)
        self._prefix_text = context if self._ids else ""
        self._in_byte_run = False

    def _decode(self, ids: list[int]) -> str:
        if self._drop:
            ids = [i for i in ids if i not in self._drop]
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (maybe empty)."""
        self._ids.append(int(token_id))  # device outputs arrive as NumPy integers
        self._track_byte_run(token_id)
        text = self._decode(self._ids)
        incomplete = text.endswith(REPLACEMENT_CHAR)
        if not incomplete and not self._in_byte_run:
            return self._emit(len(self._ids), text)
        if len(self._ids) - self._read < MAX_UNEMITTED_TOKENS:
            return ""
        if not incomplete:
            return self._emit(len(self._ids), text)
        return self._emit(*self._last_safe_cut(text))

    def drain(self) -> str:
        """Returns the text of every unemitted token, complete characters or not."""
        if len(self._ids) == self._read:
            return ""
        return self._emit(len(self._ids), self._decode(self._ids))

    def _track_byte_run(self, token_id: int) -> None:
        token = self._backend.id_to_token(token_id)
        if token is not None and len(token) == 6 and token.startswith("<0x") and token[-1] == ">":
            self._in_byte_run = True
        elif self._in_byte_run and self._decode([token_id]):
            self._in_byte_run = False  # a skipped special token does not end the run

    def _last_safe_cut(self, text: str) -> tuple[int, str]:
        """(end, its text) of the longest window prefix that does not end inside a character.

        A cut is safe when the prefix ends in a whole character, or when decoding both sides
        apart still gives `text` (the prefix ends in malformed bytes, which no later byte can
        complete; a cut inside a character would add replacement chars). A character spans at
        most 4 tokens, so only the last 3 cuts are tried; failing those, everything is emitted.
        """
        for end in range(len(self._ids) - 1, max(self._read, len(self._ids) - 4), -1):
            prefix = self._decode(self._ids[:end])
            if not prefix.endswith(REPLACEMENT_CHAR) or (
                prefix + self._decode(self._ids[end:]) == text
            ):
                return end, prefix
        return len(self._ids), text

    def _emit(self, end: int, text: str) -> str:
        """Emits `ids[read:end]`, whose window decodes to `text`; they become the new context."""
        delta = text[len(self._prefix_text) :]
        self._ids = self._ids[self._read :]
        self._read = end - self._read
        self._prefix_text = self._decode(self._ids[: self._read])
        return delta


class _StopMatcher:
    """Cuts text at the first stop string, withholding text that may be the start of one."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool):
        if any(not s for s in stop):
            raise ValueError(f"stop strings must not be empty, got {list(stop)!r}.")
        self._stop = tuple(stop)
        self._include = include_stop_str_in_output
        self._longest = max((len(s) for s in self._stop), default=0)
        self._held = ""  # always shorter than the longest stop string

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns the text now safe to release, and the stop string found, if any."""
        if not self._stop:
            return text, None
        pending = self._held + text
        match = self._first_match(pending)
        if match is not None:
            start, stop = match
            self._held = ""
            return pending[: start + len(stop) if self._include else start], stop
        keep = self._partial_match_length(pending)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], None

    def flush(self) -> str:
        """Releases the withheld text (the sequence ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first; on a tie, the longer one."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                best = key if best is None or key < best else best
        return None if best is None else (best[1], best[2])

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        for length in range(min(len(text), self._longest - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stop):
                return length
        return 0


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text, a few tokens at a time.

    The concatenated deltas, `flush()` included, equal decoding all the generated tokens at once,
    except that they stop at a stop string, that text decoded in context may differ at the very
    start (a SentencePiece decoder that strips the leading space of a whole text does not strip
    it from a continuation), and that malformed output past MAX_UNEMITTED_TOKENS may differ in
    its replacement characters.

    Example:
      detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["\\n\\n"])
      for token_id in generated:
          delta = detok.add_tokens([token_id])
          print(delta.text, end="")
          if delta.stop_string is not None:
              break
      else:
          print(detok.flush().text)
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        keep_special_tokens: Sequence[str] = (),
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        """Starts a sequence after its prompt.

        Args:
          tokenizer: the model's tokenizer; only its `backend_tokenizer` is used.
          prompt_token_ids: the prompt; its last tokens give the first generated one context.
          skip_special_tokens: leave special tokens out of the text.
          keep_special_tokens: special tokens (by text) left in all the same: the markers a
            tool-call parser reads.
          stop: strings that end the sequence; the text is cut before them.
          include_stop_str_in_output: cut after the stop string instead.
          min_tokens: stop strings are looked for only in the text of the tokens after the first
            `min_tokens` ones (SamplingParams.min_tokens).
        """
        context = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        self._window = _DecodeWindow(tokenizer.backend_tokenizer, context, skip_special_tokens,
                                     keep_special_tokens)
        self._matcher = _StopMatcher(stop, include_stop_str_in_output)
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._finished = False

    @property
    def num_tokens(self) -> int:
        """Generated tokens taken in so far."""
        return self._num_tokens

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Takes newly generated tokens; returns the text they release.

        Tokens after the one that completes a stop string are ignored, and the detokenizer is
        finished: further calls raise RuntimeError.
        """
        self._check_not_finished()
        pieces = []
        for token_id in token_ids:
            self._num_tokens += 1
            text = self._window.push(token_id)
            if self._num_tokens <= self._min_tokens:
                pieces.append(text)
                continue
            released, stop = self._matcher.feed(text)
            pieces.append(released)
            if stop is not None:
                self._finished = True
                return DetokenizerDelta("".join(pieces), stop)
        return DetokenizerDelta("".join(pieces))

    def flush(self) -> DetokenizerDelta:
        """Ends the sequence (EOS, length, abort): returns all text still held back.

        Incomplete characters come out as U+FFFD, as a one-shot decode would show them. A stop
        string completed by that text still cuts it, and is reported.
        """
        self._check_not_finished()
        self._finished = True
        text = self._window.drain()
        if self._num_tokens <= self._min_tokens:
            return DetokenizerDelta(text)
        released, stop = self._matcher.feed(text)
        if stop is not None:
            return DetokenizerDelta(released, stop)
        return DetokenizerDelta(released + self._matcher.flush())

    def _check_not_finished(self) -> None:
        if self._finished:
            raise RuntimeError("this sequence's detokenizer has finished (stop string or flush).")
