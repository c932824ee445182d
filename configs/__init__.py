"""Bundled YAML presets (`--config NAME`); a package so they ship in installed distributions."""
