"""Text in and out: incremental detokenization, chat templates and tool-call parsing."""
