"""Reasoning parsers (the server's ``--reasoning-parser``, vLLM's; ``ChatPagedBackend(reasoning_parser=...)``): a
thinking model's ``<think>...</think>`` goes to ``reasoning_content``, the rest to ``content``, whole or as a
stream's deltas.

``deepseek_r1``: the chat template opens the thinking, so the output starts inside it (a ``<think>`` the model
writes anyway is dropped); what precedes ``</think>`` is reasoning. ``qwen3``: thinking is what the model puts
between ``<think>`` and ``</think>``; an output without them (``enable_thinking: false``) is all content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass
class ReasoningSplitter:
    """Splits an output's text, fed whole or piece by piece, into (reasoning, content) pieces. A tag cut between
    two pieces is held back until the next one decides it."""

    parser: str
    inside: bool = field(init=False)
    started: bool = field(init=False)  # whether the output may still open with <think>
    held: str = ""

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {list(REASONING_PARSERS)}, got {self.parser!r}")
        self.inside = self.parser == "deepseek_r1"
        self.started = False

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The new (reasoning, content) text that ``text`` adds; ``final`` releases what was held back."""
        text, self.held = self.held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if not self.started:
                stripped = text.lstrip()
                if START.startswith(stripped) and not final and len(stripped) < len(START):
                    self.held = text  # maybe the opening tag, cut
                    break
                self.started = True
                if stripped.startswith(START):
                    self.inside, text = True, stripped[len(START) :]
                    continue
            tag = END if self.inside else START
            at = text.find(tag)
            if at < 0:
                keep = _partial_tag(text, tag) if not final else 0
                (reasoning if self.inside else content).append(text[: len(text) - keep])
                self.held = text[len(text) - keep :]
                break
            (reasoning if self.inside else content).append(text[:at])
            text = text[at + len(tag) :]
            if self.inside:
                self.inside = False
            elif self.parser == "qwen3":
                self.inside = True
            else:  # deepseek_r1 after its thinking: a later <think> is content
                content.append(tag)
        return "".join(reasoning), "".join(content)


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole output's (reasoning or None, content)."""
    reasoning, content = ReasoningSplitter(parser).feed(text, final=True)
    return reasoning or None, content


def _partial_tag(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
