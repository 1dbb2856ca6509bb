"""The documentation: the README's front page stays short, the mkdocs site builds strictly
(a broken link or a page missing from the nav fails), and every extension page's worked
example runs as written: its files written, its commands run in a copy of the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launch import child_env
from helpers.paths import ROOT

DOCS = ROOT / "docs"
EXTENSION_PAGES = sorted((DOCS / "extend").glob("*.md"))
# <!-- file: PATH --> / <!-- append: PATH --> / <!-- run --> right before a fenced block
STEP = re.compile(r"<!-- (file|append|run):? ?(\S*) -->\n```[a-z]*\n(.*?)\n```", re.S)


def test_the_readme_front_page_is_at_most_300_lines_and_links_only_to_real_pages():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).is_file(), target


def test_the_docs_build_strictly(tmp_path):
    proc = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict",
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "extend" / "strategy" / "index.html").is_file()


def steps(page: Path) -> list[tuple[str, str, str]]:
    found = STEP.findall(page.read_text())
    assert any(kind == "run" for kind, _, _ in found), f"{page.name} runs nothing"
    return found


def repository_copy(dest: Path) -> Path:
    """What a clone holds for running the scripts (the package copied: a page may add to it),
    with the project's .venv."""
    for name in ("train.py", "eval.py", "generate.py"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("conf", "ddp_utils"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / ".venv").symlink_to(ROOT / ".venv")
    return dest


@pytest.mark.parametrize("page", EXTENSION_PAGES, ids=lambda p: p.stem)
def test_an_extension_page_runs_as_written(page, tmp_path):
    repo = repository_copy(tmp_path)
    for kind, path, body in steps(page):
        if kind == "file":
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(body + "\n")
        elif kind == "append":
            with open(repo / path, "a") as f:  # after the file's last definition
                f.write("\n\n" + body + "\n")
        else:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=repo,
                                  env=child_env(), capture_output=True, text=True,
                                  timeout=600)  # fmt: skip
            assert proc.returncode == 0, (
                f"{page.name}: {body}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
                f"{proc.stderr[-5000:]}"
            )


def test_the_extension_pages_examples_are_the_tested_ones():
    """The task page's example is the suite's custom task, line for line."""
    code = (ROOT / "tests" / "custom_tasks.py").read_text()
    example = code.split("\n\n\nclass NoEvalStep")[0].split("\n", 1)[1].strip()
    written = {path: body for kind, path, body in steps(DOCS / "extend" / "task.md")}
    assert written["my_tasks.py"].strip() == example
