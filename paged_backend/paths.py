"""Model names on disk told apart from hub ids, without torch or transformers: the command line checks a model's
path before its heavy imports, so a mistyped path is refused at once."""

from __future__ import annotations

import os


def looks_local(name: str) -> bool:
    """A name no hub id can be: absolute, ``./``, ``../`` or ``~`` first, or more than one ``/`` (hub ids are
    ``name`` or ``owner/name``)."""
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def is_gguf_path(name: str) -> bool:
    """A GGUF file's name (``model="x.gguf"``, as vLLM takes one)."""
    return name.lower().endswith(".gguf")


def missing_local_model(name: str) -> bool:
    """A model that can only be a local path (or a ``.gguf`` file, which is always one) and is not there."""
    path = os.path.expanduser(name)
    if is_gguf_path(name):
        return not os.path.isfile(path)
    return looks_local(name) and not os.path.exists(path)
