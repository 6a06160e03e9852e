"""A fresh clone must work on a fresh machine: nothing tracked points outside the repository."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast           # the developer tier (`pytest -m fast`)

REPO = Path(__file__).resolve().parents[1]


def _tracked() -> list[tuple[str, str]]:
    """(mode, path) of every tracked file; skips when this is not a git checkout (an unpacked sdist)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-s", "-z"], capture_output=True, text=True,
                         check=True).stdout
    rows = []
    for entry in filter(None, out.split("\0")):
        meta, path = entry.split("\t", 1)
        rows.append((meta.split()[0], path))
    return rows


def test_no_tracked_symlink_leaves_the_tree():
    bad = []
    for mode, path in _tracked():
        if mode != "120000":
            continue
        target = subprocess.run(["git", "-C", str(REPO), "cat-file", "-p", f":{path}"], capture_output=True,
                                text=True, check=True).stdout
        resolved = (REPO / path).parent / target
        if os.path.isabs(target) or not os.path.normpath(resolved).startswith(str(REPO) + os.sep):
            bad.append(f"{path} -> {target}")
    assert not bad, f"tracked symlinks pointing outside the repository: {bad}"


def test_no_tracked_text_names_this_checkout():
    """No tracked text file spells this checkout's absolute path (a path of one machine)."""
    needle = str(REPO).encode()
    hits = []
    for mode, path in _tracked():
        p = REPO / path
        if mode == "120000" or not p.is_file() or p.stat().st_size > 5_000_000:
            continue
        if needle in p.read_bytes():
            hits.append(path)
    assert not hits, f"tracked files naming {REPO}: {hits}"
