"""The OpenAI-compatible HTTP server over `AsyncEngine` (see `jengine.server.app`)."""
