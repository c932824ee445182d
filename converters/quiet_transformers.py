"""HF transformers, imported without the notice it logs when torch is absent.

jengine uses transformers for tokenizers, configs and the GGUF tokenizer converter, none of which
needs torch, and torch is no runtime dependency; yet `import transformers` without torch logs
"PyTorch was not found. Models won't be available ..." at WARNING, so every `jengine serve`
started with it. `import_transformers` drops that one record while the package first imports;
every other message of transformers' is left alone.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

_NOTICE = "PyTorch was not found."


class _DropNoTorchNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NOTICE)


def import_transformers() -> ModuleType:
    """`import transformers` (once per process; later calls return the module)."""
    if "transformers" not in sys.modules:
        logger = logging.getLogger("transformers")  # the logger the notice is logged on
        quiet = _DropNoTorchNotice()
        logger.addFilter(quiet)
        try:
            import transformers  # noqa: F401
        finally:
            logger.removeFilter(quiet)
    return sys.modules["transformers"]
