"""Progress into a log (stderr not a terminal) is a few whole lines, not tqdm's `\\r` redraws
(jengine/progress.py), seen through a real bar: loading the bundled model's weights."""

from __future__ import annotations

from converters.source import load_source


def test_progress_into_a_log_is_lines_not_redraws(capsys):
    load_source(None, progress=True)  # ~270 tensors: tqdm alone redraws dozens of times
    err = capsys.readouterr().err  # (pytest's capture is no TTY, as a log file is not)
    assert "\r" not in err, err[:500]
    lines = [line for line in err.splitlines() if line.startswith("loading weights")]
    # the start and the end (a load longer than 15 s adds a line per 15 s)
    assert 2 <= len(lines) <= 6, lines
    assert lines[-1].split(":")[1].strip().startswith("100%"), lines
