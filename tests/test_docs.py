"""The docs site builds with ``mkdocs build --strict``: a broken link, a missing anchor or a page left out of the
nav fails the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_docs_site_builds_strict(tmp_path) -> None:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "from-vllm" / "index.html").exists()


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [page.relative_to(ROOT / "docs").as_posix() for page in (ROOT / "docs").rglob("*.md")]
    assert pages and all(page in nav for page in pages)
