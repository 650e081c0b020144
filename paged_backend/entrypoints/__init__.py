"""User-facing entry points: the LLM class, the CLI."""
