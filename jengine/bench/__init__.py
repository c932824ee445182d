"""`jengine bench`: offline throughput, prefix-cache and served (OpenAI client) benchmarks."""
