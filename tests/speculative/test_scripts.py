"""The speculative-decoding scripts of `scripts/` (pass cost, time split, offline simulation) on tiny inputs."""

import json
import runpy
from pathlib import Path

import pytest

import hf_accel.loading
from tests.conftest import make_tiny_llama
from tests.tiny_checkpoints import make_char_tokenizer


SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run_script(name: str) -> dict:
    return runpy.run_path(str(SCRIPTS / name), run_name="script")


@pytest.fixture
def tiny_loaded(monkeypatch):
    """`load_model_and_tokenizer` returns a tiny Llama and the character tokenizer (the scripts import it lazily)."""
    monkeypatch.setattr(
        hf_accel.loading, "load_model_and_tokenizer", lambda *a, **k: (make_tiny_llama(), make_char_tokenizer())
    )


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--tokens", "2", "-1"], ["--context", "0"], ["--repeats", "0"]])
def test_pass_cost_refuses_sizes_below_one(tiny_loaded, capsys, bad):
    with pytest.raises(SystemExit) as exit_info:
        run_script("pass_cost.py")["main"](bad)
    assert exit_info.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_pass_cost_json_holds_the_printed_ratios(tiny_loaded, capsys):
    main = run_script("pass_cost.py")["main"]
    assert main(["--tokens", "4", "2", "--context", "8", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["ms"]) == list(report["relative"]) == list(report["head_ms"]) == ["1", "2", "4"]
    assert report["relative"]["1"] == 1.0 and report["context"] == 8
