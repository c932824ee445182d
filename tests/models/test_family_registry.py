"""The family registry is consistent: no HF `model_type` or GGUF architecture is claimed by two
families, every family is reached by each of its names, every `Family` record defined in
`jengine/models/` is registered, and each record's names and network are ones the readers and
the supported-models table can use. Pure Python: nothing is compiled."""

from __future__ import annotations

import importlib
import pkgutil
from collections import Counter
from pathlib import Path

import pytest

import jengine.models
from jengine.models import model_config_from_hf, registry
from jengine.models.family import Family

ROOT = Path(__file__).resolve().parents[2]


def _duplicates(names) -> list[str]:
    return sorted(name for name, n in Counter(names).items() if n > 1)


def test_names_are_unique_across_families():
    families = registry.FAMILIES
    assert _duplicates(f.name for f in families) == []
    assert _duplicates(t for f in families for t in f.model_type_names) == []
    assert _duplicates(arch for f in families for arch, _ in f.gguf_archs) == []


def test_every_family_is_reached_by_its_names():
    for family in registry.FAMILIES:
        assert family.model_types, family.name
        for name in family.model_type_names:
            assert registry.BY_MODEL_TYPE[name] is family, name
        for arch, model_type in family.gguf_archs:
            # An architecture's files read as one of its own family's types.
            assert registry.gguf_family(arch) == (family, model_type), arch
            assert model_type in family.model_type_names, arch
        assert (ROOT / "jengine" / "models" / f"{family.network.name}.py").is_file(), family.name


def test_every_family_record_is_registered():
    """A record written in a family's file but left out of `registry.FAMILIES` would load
    nothing; this finds it."""
    defined = []
    for info in pkgutil.iter_modules(jengine.models.__path__):
        module = importlib.import_module(f"jengine.models.{info.name}")
        defined += [(f"{info.name}.{name}", value) for name, value in vars(module).items()
                    if isinstance(value, Family)]
    assert len(defined) >= len(registry.FAMILIES)
    unregistered = [name for name, value in defined if value not in registry.FAMILIES]
    assert unregistered == []


def test_a_name_claimed_twice_is_refused():
    olmo2 = registry.BY_MODEL_TYPE["olmo2"]
    with pytest.raises(ValueError, match="'olmo2' is claimed by families 'olmo2' and 'olmo2'"):
        registry._index([("olmo2", olmo2), ("olmo2", olmo2)], "model_type")


def test_unknown_model_type_names_every_supported_one():
    with pytest.raises(ValueError, match="unsupported architecture 'bert'") as e:
        model_config_from_hf({"model_type": "bert", "architectures": ["BertModel"]})
    assert all(repr(name) in str(e.value) for name in registry.BY_MODEL_TYPE)


def test_multimodal_gemma3_reads_as_its_text_model():
    text = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "query_pre_attn_scalar": 8}
    cfg = model_config_from_hf({"model_type": "gemma3", "text_config": text})
    assert cfg.model_type == "gemma3_text" and cfg.tie_word_embeddings
    assert registry.family_module(cfg).name == "gemma3"
