"""The supported-models tables of README.md and docs/models.md are what
scripts/supported_models.py generates from the family registry, every registered `model_type`
has a row, and every parity test a row names exists."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import test_deepseek
import test_deepseek_v3
import test_gemma4
import test_glm4_moe
import test_gpt_oss
import test_granite4
import test_idefics3
import test_llama4
import test_models_parity
import test_nemotron_h
import test_qwen2_5_vl
import test_qwen3_5
import test_qwen3_next
import test_qwen3_vl

from jengine.models.registry import BY_MODEL_TYPE, FAMILIES

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "supported_models", ROOT / "scripts" / "supported_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_is_generated_and_complete():
    script = _script()
    assert [row[0].strip("`") for row in script.rows()] == list(BY_MODEL_TYPE)
    assert {doc.name for doc in script.DOCS} == {"README.md", "models.md"}
    for doc in script.DOCS:
        text = doc.read_text()
        assert script.updated(text) == text, f"{doc.name}: run scripts/supported_models.py"
    tested = [t.parity_test for f in FAMILIES for t in f.model_types if t.parity_test]
    for name in tested:
        homes = (test_models_parity, test_deepseek, test_deepseek_v3, test_glm4_moe,
                 test_gemma4, test_idefics3, test_llama4, test_qwen2_5_vl, test_qwen3_5,
                 test_qwen3_vl, test_granite4, test_nemotron_h, test_gpt_oss,
                 test_qwen3_next)
        assert any(callable(getattr(home, name, None)) for home in homes), name
    assert len(tested) >= 15
