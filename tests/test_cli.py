"""`--device` and `--dtype` of the commands that load a model: parsed strictly, loaded as asked, reported in JSON."""

import json

import pytest
import torch

from hf_accel.cli import main
from tests.tiny_checkpoints import write_tiny_llama


COMMANDS = [
    ["eval", "ppl", "--text", "t.txt"],
    ["bench", "generate", "--prompts", "humaneval"],
    ["convert", "care", "--kv-keep", "0.5", "--out", "x"],
    ["convert", "palu", "--kv-keep", "0.5", "--out", "x"],
    ["index", "build", "--self-distill", "humaneval", "--out", "x"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize(
    "option, message",
    [
        (["--device", "gpu0"], "not a device: 'gpu0'"),
        (["--device", "meta"], "models run on cpu, cuda, mps or xpu devices"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_a_bad_device_or_dtype_is_one_line_before_any_model_loads(command, option, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, *option])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_this_machine_lacks_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "ppl", "--text", "t.txt", "--device", "cuda:1"])
    assert "'cuda:1': no cuda device is available on this machine" in capsys.readouterr().err


def test_a_device_index_past_the_machine_s_devices_is_refused_by_name(monkeypatch, capsys):
    from hf_accel.cli import device_name

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # two CUDA devices, as the parser sees them
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [device_name(d) for d in ("cuda", "cuda:0", "cuda:1")] == ["cuda", "cuda:0", "cuda:1"]
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "ppl", "--text", "t.txt", "--device", "cuda:2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'cuda:2': this machine has 2 cuda device(s)" in err[0]


def _ppl(model_dir, text, capsys, *options):
    capsys.readouterr()
    assert (
        main(["eval", "ppl", "--model", str(model_dir), "--text", str(text), "--seq-len", "32", "--json", *options])
        == 0
    )
    return json.loads(capsys.readouterr().out)


def test_dtype_is_the_precision_the_model_runs_in_and_is_reported(tmp_path, capsys):
    model_dir = write_tiny_llama(tmp_path / "tiny")
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be: that is the question. " * 8)
    default = _ppl(model_dir, text, capsys)
    assert (default["device"], default["dtype"]) == ("cpu", "float32")
    assert _ppl(model_dir, text, capsys, "--device", "cpu", "--dtype", "float32")["ppl"] == default["ppl"]
    half = _ppl(model_dir, text, capsys, "--dtype", "bfloat16")
    assert half["dtype"] == "bfloat16" and half["tokens"] == default["tokens"]
    assert half["ppl"] != default["ppl"] and half["ppl"] == pytest.approx(default["ppl"], rel=0.05)


def test_bench_generate_runs_in_the_dtype_asked_and_keeps_greedy_identity(tmp_path, capsys):
    model_dir = write_tiny_llama(tmp_path / "tiny")
    argv = ["bench", "generate", "--model", str(model_dir), "--prompts", "humaneval", "--limit", "2"]
    argv += ["--max-new-tokens", "8", "--methods", "vanilla,ngram", "--dtype", "bfloat16", "--json"]
    capsys.readouterr()
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["device"], result["dtype"]) == ("cpu", "bfloat16")
    assert result["methods"]["ngram"]["identical"] is True


def test_a_conversion_in_bfloat16_is_computed_in_it_and_saved_in_the_source_dtype(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.tiny_checkpoints import sample_logits

    source = write_tiny_llama(tmp_path / "fp32")
    logits = {}
    for dtype in ("float32", "bfloat16"):
        argv = ["convert", "care", "--model", str(source), "--kv-keep", "0.5", "--method", "svd", "--dtype", dtype]
        assert main([*argv, "--base-model", "org/tiny", "--out", str(tmp_path / dtype), "--json"]) == 0
        assert {t.dtype for t in load_file(tmp_path / dtype / "model.safetensors").values()} == {torch.float32}
        logits[dtype] = sample_logits(AutoModelForCausalLM.from_pretrained(tmp_path / dtype, trust_remote_code=True))
    assert not torch.equal(logits["bfloat16"], logits["float32"])  # factors of the bfloat16 weights
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("converter", [["care", "--method", "svd"], ["palu", "--ranks", "uniform"]])
def test_factors_a_float16_original_cannot_hold_are_refused_not_saved_as_inf(converter, tmp_path, capsys):
    """Converted in float32 (the default) and cast to the float16 original's dtype to be saved, a factor past 65504
    was saved as inf, exit code 0; float16 conversion refused it, advising float32."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_checkpoints import make_char_tokenizer

    model = AutoModelForCausalLM.from_pretrained(write_tiny_llama(tmp_path / "fp32"), dtype=torch.float16)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.fill_(6e4)  # rank one: U Σ = 6e4 · √16 = 2.4e5 per entry
    model.save_pretrained(tmp_path / "fp16")
    make_char_tokenizer().save_pretrained(tmp_path / "fp16")
    argv = ["convert", *converter, "--model", str(tmp_path / "fp16"), "--kv-keep", "0.5", "--base-model", "org/t"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--json"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the calibration's bars
    assert error.startswith("hf-accel convert: error: ")
    assert "model.layers.1.self_attn.k_down.weight beyond the range of float16" in error
    assert not (tmp_path / "out").exists()


def test_a_cpu_figure_names_its_cpu_and_thread_count(tmp_path, capsys, monkeypatch):
    """Speeds and perplexities are figures of one machine: the JSON names the CPU (as the OS does) and the threads."""
    import platform

    from hf_accel import cli

    model_dir = write_tiny_llama(tmp_path / "tiny")
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be: that is the question. " * 8)
    record = _ppl(model_dir, text, capsys)
    assert record["device_name"] == cli.cpu_name() and record["threads"] == torch.get_num_threads()
    assert cli.cpu_name() and cli.cpu_name() != "unknown CPU"
    monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert cli.cpu_name() == "x86_64"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_commands_on_a_gpu_give_the_cpu_figures(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from tests.tiny_checkpoints import sample_logits

    model_dir = write_tiny_llama(tmp_path / "tiny")
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be: that is the question. " * 8)
    on_gpu = _ppl(model_dir, text, capsys, "--device", "cuda")
    assert on_gpu["device_name"] == torch.cuda.get_device_name()
    assert on_gpu["ppl"] == pytest.approx(_ppl(model_dir, text, capsys)["ppl"], rel=1e-4)
    converted = {}
    for device in ("cpu", "cuda"):
        argv = ["convert", "care", "--model", str(model_dir), "--kv-keep", "0.5", "--method", "svd"]
        assert main([*argv, "--device", device, "--base-model", "org/tiny", "--out", str(tmp_path / device)]) == 0
        model = AutoModelForCausalLM.from_pretrained(tmp_path / device, trust_remote_code=True)
        converted[device] = sample_logits(model)
    torch.testing.assert_close(converted["cuda"], converted["cpu"], atol=1e-4, rtol=1e-4)
    argv = ["bench", "generate", "--model", str(model_dir), "--prompts", "humaneval", "--limit", "2"]
    capsys.readouterr()
    assert main([*argv, "--max-new-tokens", "8", "--methods", "vanilla,ngram", "--device", "cuda", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["methods"]["ngram"]["identical"] is True
