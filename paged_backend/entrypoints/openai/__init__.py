"""The OpenAI-compatible server: vLLM's command line, flags and endpoints."""
