"""Progress bars and log messages follow the switches transformers users set: every bar obeys
`transformers.utils.logging.disable_progress_bar()`, `HF_HUB_DISABLE_PROGRESS_BARS` and `TQDM_DISABLE`, every message
transformers' verbosity."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

from hf_accel.compress.calibration import collect_kv_calibration
from hf_accel.compress.fisher import collect_fisher_scores
from hf_accel.eval.perplexity import compute_perplexity
from hf_accel.eval.prompts import BenchPrompt
from hf_accel.speculative.drafters.build import self_distill
from tests.tiny_checkpoints import make_char_tokenizer, write_tiny_llama


REPO = Path(__file__).resolve().parents[1]
TEXT = "the cat sat on the mat. " * 20


def _long_work(model, tokenizer, out_dir):
    """Library calls that show a bar by default (perplexity, calibration, Fisher scores, self-distillation)."""
    compute_perplexity(model, tokenizer, TEXT, 32)
    ids = torch.randint(4, 100, (2, 8))
    collect_kv_calibration(model, ids)
    collect_fisher_scores(model, ids)
    prompts = [BenchPrompt("0", "c", "hello"), BenchPrompt("1", "c", "cat")]
    self_distill(model, tokenizer, prompts, out_dir, max_new_tokens=2, use_speculation=False)


@pytest.fixture
def tiny(tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_tiny_llama(tmp_path / "tiny")
    return AutoModelForCausalLM.from_pretrained(path).eval(), make_char_tokenizer()


def test_bars_shown_by_default_and_hidden_by_disable_progress_bar(tiny, tmp_path, capsys):
    model, tokenizer = tiny
    assert hf_logging.is_progress_bar_enabled()
    _long_work(model, tokenizer, tmp_path / "a")
    shown = capsys.readouterr().err
    for desc in ("perplexity", "calibration", "fisher", "self-distill"):
        assert f"{desc}:" in shown
    hf_logging.disable_progress_bar()
    try:
        _long_work(model, tokenizer, tmp_path / "b")
    finally:
        hf_logging.enable_progress_bar()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("switch", ["TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"])
def test_environment_switches_hide_every_bar(tmp_path, switch):
    """Read at import (tqdm's and huggingface_hub's), so in a fresh process; `convert care` shows two of our bars."""
    model = write_tiny_llama(tmp_path / "tiny")
    (tmp_path / "calib.txt").write_text(TEXT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", switch: "1"}
    args = ["convert", "care", "--model", str(model), "--kv-keep", "0.5", "--calib", str(tmp_path / "calib.txt")]
    args += ["--calib-samples", "4", "--calib-seq-len", "8", "--base-model", "org/tiny"]
    args += ["--out", str(tmp_path / "out"), "--json"]
    command = [sys.executable, "-m", "hf_accel.cli", *args]
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "%|" not in done.stderr, done.stderr


def test_log_messages_follow_transformers_verbosity():
    """hf-accel's warnings obey `set_verbosity_error()` (and a Trainer's `log_level`), its info messages show under
    `set_verbosity_info()`, as transformers' own do."""
    from types import SimpleNamespace

    from transformers.testing_utils import CaptureLogger

    from hf_accel.training import heal

    before = hf_logging.get_verbosity()
    not_a_hub_id = SimpleNamespace(teacher_model_name_or_path="/a/local/dir", model_name_or_path="/a/local/dir")
    try:
        with CaptureLogger(heal.logger) as shown:
            heal._write_card(not_a_hub_id, {}, {})  # warns: no card for a base model that is not a Hub id
        assert "no model card written" in shown.out
        hf_logging.set_verbosity_error()
        with CaptureLogger(heal.logger) as hidden:
            heal._write_card(not_a_hub_id, {}, {})
        assert hidden.out == ""
        hf_logging.set_verbosity_info()
        with CaptureLogger(heal.logger) as info:
            heal.logger.info("LoRA on 2 linear layers")
        assert "LoRA on 2 linear layers" in info.out
    finally:
        hf_logging.set_verbosity(before)


def test_index_build_shows_the_documents_it_has_indexed(tmp_path, capsys):
    """Tokenizing a dataset as it streams into the index is an index build's long part: it had no bar at all."""
    from hf_accel.speculative.drafters.index import build_index

    documents = ([3, 7, i % 50] for i in range(5))  # a generator, as the CLI's text and dataset sources are
    build_index(documents, tmp_path / "idx", "tiny", "hash", 100)
    assert "indexing: 5doc" in capsys.readouterr().err
    header = build_index(([3, 7, i] for i in range(5)), tmp_path / "idx", "tiny", "hash", 100, progress=False)
    assert capsys.readouterr().err == "" and header.num_documents == 5  # a library caller can turn it off


def test_self_distillation_bar_can_be_turned_off_by_a_library_caller(tiny, tmp_path, capsys):
    """Every other long call takes `progress=`; self-distillation showed its bar whatever the caller asked."""
    model, tokenizer = tiny
    prompts = [BenchPrompt("0", "c", "hello"), BenchPrompt("1", "c", "cat")]
    answers = self_distill(
        model, tokenizer, prompts, tmp_path, max_new_tokens=2, use_speculation=False, progress=False
    )
    assert capsys.readouterr().err == "" and len(answers) == 2
