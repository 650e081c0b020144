"""Speculative decoding's proposers: cheap guesses of a sequence's next tokens, which one forward verifies."""
