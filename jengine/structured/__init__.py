"""Constrained decoding: grammar backends, off-thread compilation, per-step token bitmasks."""

from jengine.structured.backend import Grammar, GrammarBackend, Matcher
from jengine.structured.compiler import GrammarCompiler, spec_key

__all__ = ["Grammar", "GrammarBackend", "GrammarCompiler", "Matcher", "spec_key"]
