import re
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def _layout() -> str:
    """The code block of the README's "Layout" section."""
    return (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Layout\n", 1)[1].split("```")[1]


def _tracked() -> list[str]:
    """The repository's files, or a skip outside a git checkout (an unpacked sdist)."""
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        files = ""
    if not files:
        pytest.skip("not a git checkout")
    return files.split()


def test_readme_layout_names_every_folder_and_top_level_module():
    """A newcomer finds a piece from the README's layout: every folder of the repository and of the package, and every
    module of the package's top level, is named there (`hf_accel/log.py` and `docs/` were not)."""
    tracked = _tracked()
    layout = _layout()
    folders = {path.split("/")[0] for path in tracked if "/" in path and not path.startswith(".")}
    folders |= {
        "hf_accel/" + path.split("/")[1] for path in tracked if path.count("/") >= 2 and path.startswith("hf_accel/")
    }
    modules = {path for path in tracked if re.fullmatch(r"hf_accel/\w+\.py", path) and path != "hf_accel/__init__.py"}
    missing = [f"{f}/" for f in sorted(folders) if f"{f}/" not in layout] + [
        m for m in sorted(modules) if m not in layout
    ]
    assert not missing, f"README's Layout does not name {missing}"


def test_readme_layout_names_only_files_that_exist():
    tracked = _tracked()
    names = {Path(path).name for path in tracked}
    stale = sorted({name for name in re.findall(r"\b\w+\.py\b", _layout()) if name not in names})
    assert not stale, f"README's Layout names files that do not exist: {stale}"
