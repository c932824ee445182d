"""Progress bars on stderr that suit where stderr goes.

On a terminal, tqdm's bar redraws in place. Into a log (a file, a pipe, journald: not a TTY)
every redraw would be one more `\\r`-joined fragment, tens of them for one warm-up; there the
bar writes a whole line at most every `LOG_INTERVAL_S` seconds, and one at the end.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, Any

from tqdm import tqdm

LOG_INTERVAL_S = 15.0


class _Lines:
    """A file for tqdm that turns its redraws (`\\r` + bar) into lines."""

    def __init__(self, stream: IO[str]):
        self.stream = stream

    def write(self, text: str) -> None:
        if text.startswith("\r"):
            text = text[1:].rstrip()
            if text:
                self.stream.write(text + "\n")
        elif text.strip():  # tqdm's closing "\n" after a bar: already a line
            self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True,
                 **kwargs: Any) -> tqdm:
    """`tqdm(iterable, **kwargs)` on stderr; off unless `enabled`; lines, not redraws, when
    stderr is not a terminal."""
    stream = sys.stderr
    if enabled and not stream.isatty():
        # leave: the last line says how far it got (a cleared bar is a blank line in a log)
        kwargs.update(file=_Lines(stream), mininterval=LOG_INTERVAL_S,
                      maxinterval=LOG_INTERVAL_S, ncols=100, leave=True)
    else:
        kwargs.setdefault("file", stream)
    return tqdm(iterable, disable=not enabled, **kwargs)
