"""Structured outputs: a request's output held to a JSON schema, a regex, a choice or a grammar by masking, at
every step, the tokens that would break it (xgrammar). Install with the ``[structured]`` extra."""
