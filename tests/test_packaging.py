"""The installed (non-editable) package: the wheel holds every data file the code reads at run time, and an install
outside the virtual environment's prefix (`pip install --user`, `--prefix`) finds them."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]


def _pip(*args, cwd=None):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built offline from a copy of the sources (the checkout gets no build/ nor egg-info)."""
    pytest.importorskip("setuptools", minversion="68")  # the build backend pyproject.toml asks for
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".*.lock")
    for name in ("hf_accel", "hub_cards"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src))
    (found,) = (tmp / "dist").glob("hf_accel-*.whl")
    return found


def test_wheel_holds_the_files_read_at_run_time(wheel):
    from hf_accel.eval.prompts import _BUILTIN_DIR
    from hf_accel.hub import ARTIFACT_KINDS, HUB_CARDS_DIR
    from hf_accel.kernels import CHECKPOINT_SOURCES
    from hf_accel.speculative.drafters.index import INDEX_FILES

    names = set(zipfile.ZipFile(wheel).namelist())
    package = REPO / "hf_accel"

    def in_wheel(path: Path) -> str:
        return path.resolve().relative_to(REPO).as_posix()

    expected = {in_wheel(p) for p in _BUILTIN_DIR.glob("*.jsonl")}
    expected |= {in_wheel(p) for p in (package / "models").glob("*.py")}  # copied into converted checkpoints
    expected |= {in_wheel(package / "kernels" / name) for name in CHECKPOINT_SOURCES}  # read by the Palu converter
    expected.add(in_wheel(package / "speculative" / "repo_generate.py"))  # a drafter repository's custom_generate
    for index in (package / "data" / "indexes").iterdir():
        expected |= {in_wheel(index / name) for name in INDEX_FILES}
    data = "-".join(wheel.name.split("-")[:2]) + ".data/data"  # pyproject data-files
    expected |= {f"{data}/share/hf_accel/hub_cards/{spec.template}" for spec in ARTIFACT_KINDS.values()}
    assert len(list(_BUILTIN_DIR.glob("*.jsonl"))) >= 2 and HUB_CARDS_DIR.is_dir()
    assert not expected - names, sorted(expected - names)


def test_installed_outside_the_environment_prefix_finds_its_card_templates(wheel, tmp_path):
    # `pip install --user` (or `--prefix`) puts the package and its data files under another base than sys.prefix
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it pip uninstalls this environment's own hf-accel (the editable install) first
    _pip("install", "--no-deps", "--no-index", "--ignore-installed", "-q", "--prefix", str(prefix), str(wheel))
    site = Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))
    script = (
        "import hf_accel.hub as hub\n"
        "print(hub.__file__)\n"
        "print(hub.HUB_CARDS_DIR)\n"
        "print(*sorted(spec.template for spec in hub.ARTIFACT_KINDS.values()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,  # nothing imports from the checkout
        env={**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, cards, templates = proc.stdout.strip().splitlines()[-3:]
    assert Path(module).is_relative_to(prefix)
    assert Path(cards) == (prefix / "share" / "hf_accel" / "hub_cards").resolve()
    assert all((Path(cards) / name).is_file() for name in templates.split())


def test_the_wheel_carries_the_version_the_package_reports(wheel):
    # a drafter repository's requirements.txt asks for `hf-accel>=<installed version>`: the two must not drift apart
    import hf_accel

    assert wheel.name.startswith(f"hf_accel-{hf_accel.__version__}-")
