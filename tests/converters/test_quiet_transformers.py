"""Without torch (a runtime jengine does not need), loading a model prints nothing of
transformers' "PyTorch was not found" notice (converters/quiet_transformers.py).

Each case runs in a fresh interpreter whose `torch` is hidden (`sys.modules["torch"] = None`:
`importlib.util.find_spec` then says there is none, which is what transformers asks), once with
the tokenizer built from the GGUF and once read back from the tokenizer cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

NOTICE = "PyTorch was not found"
HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"
LOAD = ("from converters.source import load_source\n"
        "print(load_source(None, progress=False).tokenizer('Hello').input_ids)\n")


def _run(code: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE_TORCH + code], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).parents[2],
                          env={**os.environ, "XDG_CACHE_HOME": str(cache)})


def test_transformers_itself_logs_the_notice_without_torch(tmp_path):
    """The condition is real: hidden torch, plain `import transformers`, the notice."""
    r = _run("import transformers\n", tmp_path)
    assert NOTICE in r.stderr, r.stderr


def test_loading_the_bundled_model_without_torch_prints_no_notice(tmp_path):
    for attempt in ("builds the tokenizer", "reads the cached tokenizer"):
        r = _run(LOAD, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert NOTICE not in r.stderr, (attempt, r.stderr)
    assert any((tmp_path / "jengine" / "tokenizers").iterdir())  # the second run hit the cache
