"""Where the project and the shared test data are, and the documentation as one text."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


MNIST_ROOT = ROOT.parent / "shared" / "data" / "mnist10k"


needs_mnist = pytest.mark.skipif(
    not (MNIST_ROOT / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file(),
    reason=f"real MNIST digits not found at {MNIST_ROOT} (only in the project's workspace)",
)


def documentation() -> str:
    """The README and every page of docs/, as one text."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(p.read_text() for p in pages)
