"""CARE converter: bad input, atomic output, the `convert care` command, and the real default model."""

import json
import os

import pytest
import torch

from hf_accel.compress.calibration import chunk_token_ids
from hf_accel.compress.care import (
    CareConversionConfig,
    allocate_ranks,
    build_care_model,
    convert_care,
    factorize_kv,
    kv_cache_bytes_per_token,
    run_care_conversion,
    save_care_model,
)
from hf_accel.compress.factorize import LowRankFactors
from tests.compress.care_helpers import make_tiny, tiny_calibration
from tests.conftest import requires_transformers_adapters


def test_unknown_family_is_an_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="does not know model family 'gpt2'"):
        convert_care(gpt2, kv_keep=0.5, method="svd")


@pytest.mark.parametrize(
    "wrap", ["peft_model", pytest.param("transformers_adapter", marks=requires_transformers_adapters)]
)
def test_a_model_with_peft_adapters_is_refused_before_calibration(wrap, monkeypatch):
    # the adapters' deltas are not in the base weights that are factorized and copied: merge first
    from peft import LoraConfig, get_peft_model

    import hf_accel.compress.care as care_module

    model, lora = make_tiny("llama"), LoraConfig(target_modules=["q_proj", "v_proj"], r=2, init_lora_weights=False)
    if wrap == "peft_model":
        model = get_peft_model(model, lora)
    else:  # what from_pretrained of an adapter directory gives
        model.add_adapter(lora)
    monkeypatch.setattr(care_module, "prepare_calibration", lambda *a, **k: pytest.fail("calibrated"))
    with pytest.raises(ValueError, match="CARE converts plain weights, and this model has PEFT adapters loaded"):
        convert_care(model, kv_keep=0.5)


@pytest.mark.parametrize("kv_keep", [0.0, 1.01, -1])
def test_budget_outside_unit_interval_is_an_error(kv_keep):
    with pytest.raises(ValueError, match="kv_keep"):
        convert_care(make_tiny("llama"), kv_keep=kv_keep, method="svd")


def test_unknown_method_is_an_error():
    with pytest.raises(ValueError, match="unknown CARE method"):
        CareConversionConfig(method="magic")


@pytest.mark.parametrize(
    "option", [{"alpha": 1.0}, {"lam_frac": -1.0}, {"rank_floor_frac": 0.6}, {"rank_floor_frac": -0.1}]
)
def test_shrinkage_and_rank_floor_outside_their_range_are_errors(option):
    """A negative λ made the shrunk moment indefinite; its clamped root then gave silently wrong factors."""
    from hf_accel.compress.palu import PaluConversionConfig

    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        CareConversionConfig(**option)
    if name != "rank_floor_frac":
        with pytest.raises(ValueError, match=name):
            PaluConversionConfig(**option)


@pytest.mark.parametrize("method", ["svd", "asvd", "care-u"])
def test_a_rank_floor_with_uniform_ranks_is_refused_in_one_line(method):
    """The floor bounds water-filled ranks only; uniform methods used to ignore it silently."""
    with pytest.raises(ValueError, match=rf"^rank_floor_frac applies to water-filled ranks; method '{method}' has"):
        CareConversionConfig(method=method, rank_floor_frac=0.1)
    assert CareConversionConfig(method="care-e-raw", rank_floor_frac=0.1).rank_floor_frac == 0.1


def test_rank_above_matrix_width_is_an_error():
    model = make_tiny("llama")
    factors = factorize_kv(model, None, "svd", CareConversionConfig())
    with pytest.raises(ValueError, match="layer 1 V rank 17 is outside"):
        build_care_model(model, factors, [16, 16], [16, 17])


def test_too_short_calibration_is_an_error():
    with pytest.raises(ValueError, match="calibration text too short"):
        chunk_token_ids(list(range(100)), num_samples=8, seq_len=32)


def test_failed_save_leaves_no_output(tmp_path, monkeypatch):
    from hf_accel.compress import care

    model = make_tiny("llama")
    result = run_care_conversion(model, None, CareConversionConfig(kv_keep=0.5, method="svd"), None, False)

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(care, "plot_ranks", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_care_model(result, None, tmp_path / "out", "org/tiny")
    assert os.listdir(tmp_path) == []  # neither the output nor a temporary directory is left


def test_a_killed_conversion_s_scratch_directory_is_removed_by_the_next_one(tmp_path):
    """A conversion killed while writing (the OOM killer, SIGKILL: no `except` runs) leaves its scratch directory,
    a whole checkpoint's weights for a large model; the next conversion to the same `--out` removes it, and leaves
    those of running processes and of other machines (shared storage) alone."""
    import signal
    import socket
    import subprocess
    import sys

    from hf_accel.atomic import atomic_output_dir

    out = tmp_path / "care"
    script = (
        "import os, signal, sys\n"
        "from hf_accel.atomic import atomic_output_dir\n"
        "with atomic_output_dir(sys.argv[1]) as tmp:\n"
        "    (tmp / 'model.safetensors').write_bytes(b'half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    killed = subprocess.run([sys.executable, "-c", script, str(out)], cwd=repo, check=False)
    assert killed.returncode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".care-tmp-")  # what the kill left
    host = socket.gethostname().replace("-", "_")
    live = tmp_path / f".care-tmp-{os.getppid()}@{host}-xyz"  # a running process's (pytest's parent)
    elsewhere = tmp_path / ".care-tmp-999999999@another_host-xyz"  # another machine's
    other_out = tmp_path / ".care-tmp-x-tmp-999999999@host-xyz"  # `--out care-tmp-x`'s, not this output's
    for folder in (live, elsewhere, other_out):
        folder.mkdir()
    with atomic_output_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["care", live.name, elsewhere.name, other_out.name])


def test_existing_output_needs_overwrite_and_must_be_a_checkpoint(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    result = run_care_conversion(make_tiny("llama"), None, CareConversionConfig(method="svd"), None, False)
    with pytest.raises(ValueError, match="pass --overwrite"):
        save_care_model(result, None, tmp_path / "out", "org/tiny")
    for config in (None, '{"eslint": true}'):  # a project folder, `--out .`, even one with a config.json: kept
        if config:
            (tmp_path / "out" / "config.json").write_text(config)
        with pytest.raises(ValueError, match="holds none"):
            save_care_model(result, None, tmp_path / "out", "org/tiny", overwrite=True)
        assert (tmp_path / "out" / "keep.txt").exists()
    result.model.save_pretrained(tmp_path / "out")  # an earlier checkpoint is replaced as a whole
    save_care_model(result, None, tmp_path / "out", "org/tiny", overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").exists()


def test_kv_cache_bytes_helper_matches_ranks():
    model = make_tiny("qwen3")
    care = convert_care(model, kv_keep=0.25, calibration=tiny_calibration(model), progress=False)
    assert kv_cache_bytes_per_token(model) == 2 * 2 * 2 * 8 * 4
    assert kv_cache_bytes_per_token(care) == (sum(care.config.care_k_ranks) + sum(care.config.care_v_ranks)) * 4
    assert sum(care.config.care_k_ranks) + sum(care.config.care_v_ranks) == 16


@pytest.fixture(scope="module")
def tiny_dir_with_tokenizer(tmp_path_factory, default_model):
    """A tiny random Llama saved with the default model's tokenizer, so the CLI can load it by path."""
    _, tokenizer = default_model
    path = tmp_path_factory.mktemp("tiny-llama")
    from tests.conftest import make_tiny_llama

    make_tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("calib", ["text", "generated"])
def test_convert_care_cli(tmp_path, tiny_dir_with_tokenizer, calib, capsys):
    from hf_accel.cli import main

    if calib == "text":
        calib = str(tmp_path / "calib.txt")
        with open(calib, "w") as f:
            f.write("To be, or not to be, that is the question. " * 40)
    out = tmp_path / "out"
    argv = [
        "convert",
        "care",
        "--model",
        str(tiny_dir_with_tokenizer),
        "--kv-keep",
        "0.5",
        "--calib",
        calib,
        "--calib-samples",
        "4",
        "--calib-seq-len",
        "16",
        "--out",
        str(out),
        "--base-model",
        "org/tiny",
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["cache_values_per_token"] == 32 and summary["method"] == "care"  # half of 2 layers × (16 + 16)
    ranks = json.loads((out / "care_ranks.json").read_text())
    assert ranks["k_ranks"] == summary["k_ranks"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not the temporary directory's private 0700
    # too short calibration text: one clear error, exit code 2, no output directory
    if calib.endswith(".txt"):
        argv[argv.index("--calib-samples") + 1] = "1000"
        argv[argv.index("--out") + 1] = str(tmp_path / "out2")
        assert main(argv) == 2
        assert "calibration text too short" in capsys.readouterr().err
        assert not (tmp_path / "out2").exists()


@pytest.mark.slow
def test_default_model_full_rank_and_cache_bytes(default_model):
    """SmolLM2-135M: full-rank CARE reproduces the logits; at kv-keep 0.5 the measured cache is half the original's."""
    from hf_accel.eval.care_quality import measured_cache_bytes_per_token

    model, tokenizer = default_model
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 8, return_tensors="pt")["input_ids"]
    calibration = tiny_calibration(model, n=4, seq_len=32, with_output_grads=False)
    full = convert_care(model, kv_keep=1.0, method="care-u", calibration=calibration, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(full(ids).logits, model(ids).logits, atol=2e-3, rtol=0)
    half = convert_care(model, kv_keep=0.5, method="care-e-rel", calibration=calibration, progress=False)
    original_bytes = measured_cache_bytes_per_token(model, model.config.vocab_size)
    assert original_bytes == 2 * 30 * 3 * 64 * 4
    assert measured_cache_bytes_per_token(half, model.config.vocab_size) == original_bytes / 2


def test_convert_care_cli_saves_the_source_dtype_and_a_hub_card(tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_accel.cli import main
    from tests.tiny_checkpoints import write_tiny_llama

    source = write_tiny_llama(tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            (tmp_path / "bf16" / name).write_bytes((source / name).read_bytes())
    out = tmp_path / "care"
    argv = ["convert", "care", "--model", str(tmp_path / "bf16"), "--kv-keep", "0.5", "--method", "svd"]
    assert main(argv + ["--out", str(out), "--base-model", "org/tiny", "--json"]) == 0
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    card = (out / "README.md").read_text()
    assert "base_model: org/tiny" in card and "`kv_keep_achieved`" in card and "care_ranks.png" in card
    text = tmp_path / "private" / "corpus.txt"  # a calibration file is published by its name, not its path
    text.parent.mkdir()
    text.write_text("some calibration text, repeated. " * 200)
    argv = ["convert", "care", "--model", str(source), "--kv-keep", "0.5", "--method", "care-u", "--calib", str(text)]
    argv += ["--calib-samples", "4", "--calib-seq-len", "16", "--out", str(tmp_path / "calibrated")]
    assert main(argv + ["--base-model", "org/tiny", "--json"]) == 0
    published = (tmp_path / "calibrated" / "README.md").read_text()
    published += (tmp_path / "calibrated" / "care_ranks.json").read_text()
    assert "corpus.txt" in published and str(text.parent) not in published


def test_a_care_card_written_to_out_dot_is_titled_after_the_directory(tmp_path, monkeypatch):
    """`--out .` (an empty directory): the card's title and snippets named the temporary directory the checkpoint was
    written in (`.my-care-tmp-XXXX`), since `Path(".").name` is empty."""
    from huggingface_hub import ModelCard

    from hf_accel.cli import main
    from tests.tiny_checkpoints import write_tiny_llama

    source = write_tiny_llama(tmp_path / "src")
    (tmp_path / "my-care").mkdir()
    monkeypatch.chdir(tmp_path / "my-care")
    argv = ["convert", "care", "--model", str(source), "--kv-keep", "0.5", "--method", "svd", "--out", "."]
    assert main(argv + ["--base-model", "org/tiny", "--json"]) == 0
    card = ModelCard.load(tmp_path / "my-care" / "README.md")
    assert card.data.model_name == "my-care" and "-tmp-" not in card.content


def test_a_local_calibration_dataset_is_published_by_its_name(tmp_path):
    """`hf:` also reads a dataset saved on this machine: the card names it like a text file, without the path."""
    import datasets

    from hf_accel.compress.calibration import published_calibration_source
    from hf_accel.compress.care import prepare_calibration
    from tests.tiny_checkpoints import make_char_tokenizer

    saved = tmp_path / "private" / "corpus"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["calibration text. " * 50]})}).save_to_disk(
        str(saved)
    )
    model, tokenizer = make_tiny("llama", vocab_size=128), make_char_tokenizer()
    calibration = prepare_calibration(model, tokenizer, calib=f"hf:{saved}", num_samples=2, seq_len=8, progress=False)
    assert calibration.meta["source"] == "hf:corpus"
    assert published_calibration_source(f"hf:{saved}:cfg") == "hf:corpus:cfg"
    assert published_calibration_source("hf:wikitext:wikitext-2-raw-v1") == "hf:wikitext:wikitext-2-raw-v1"  # Hub id
    assert published_calibration_source(str(tmp_path / "a.txt")) == "a.txt"
    assert published_calibration_source("generated") == "generated"


def test_calibration_reads_the_split_and_column_asked_for(tmp_path):
    """`split` / `text_column` choose from an `hf:` dataset (defaults `train` / `text`) and are recorded with the
    source; for a text file or `generated` they are refused rather than ignored."""
    import datasets

    from hf_accel.compress.calibration import load_calibration_ids, tokenize_calibration_text
    from hf_accel.compress.care import prepare_calibration
    from tests.tiny_checkpoints import make_char_tokenizer

    saved = tmp_path / "corpus"
    train = datasets.Dataset.from_dict({"text": ["train text. " * 40], "content": ["train content. " * 40]})
    held = datasets.Dataset.from_dict({"text": ["held text. " * 40], "content": ["held-out content! " * 40]})
    datasets.DatasetDict({"train": train, "validation": held}).save_to_disk(str(saved))
    model, tokenizer = make_tiny("llama", vocab_size=128), make_char_tokenizer()
    source = f"hf:{saved}"
    for split, column, text in [(None, None, "train text. "), ("validation", "content", "held-out content! ")]:
        ids = load_calibration_ids(model, tokenizer, source, 2, 8, split=split, text_column=column)
        assert torch.equal(ids, tokenize_calibration_text(tokenizer, text * 40, 2, 8, seed=0))
    calibration = prepare_calibration(
        model, tokenizer, source, 2, 8, progress=False, split="validation", text_column="content"
    )
    assert calibration.meta["split"] == "validation" and calibration.meta["text_column"] == "content"
    with pytest.raises(ValueError, match="no split 'test'"):
        load_calibration_ids(model, tokenizer, source, 2, 8, split="test")
    with pytest.raises(ValueError, match="not from 'generated'"):
        load_calibration_ids(model, tokenizer, "generated", 2, 8, split="validation")


def test_convert_care_cli_refuses_bad_input_before_loading(tmp_path, capsys, monkeypatch):
    import hf_accel.loading
    from hf_accel.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("loaded the model before checking the arguments")

    monkeypatch.setattr(hf_accel.loading, "load_model_and_tokenizer", no_load)
    from tests.tiny_checkpoints import write_tiny_remote_model

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text("{}")
    converted = write_tiny_remote_model(tmp_path / "converted")
    capsys.readouterr()
    cases = [
        (["--calib-samples", "0", "--out", str(tmp_path / "o")], "--calib-samples must be ≥ 1"),
        (["--calib-seq-len", "1", "--out", str(tmp_path / "o")], "--calib-seq-len ≥ 2"),
        (["--out", str(a_file / "sub")], "cannot be created"),
        (["--model", str(tmp_path / "local"), "--out", str(tmp_path / "o")], "pass --base-model ORG/NAME"),
        (["--model", str(tmp_path), "--out", str(tmp_path / "o")], "holds no config.json: it is not a saved model"),
        (["--model", str(converted), "--out", str(tmp_path / "o")], "is already a converted checkpoint"),
        (["--calib", str(a_file), "--calib-text-column", "body", "--out", str(tmp_path / "o")], "(--calib hf:NAME)"),
    ]
    for converter, checks in (("care", cases), ("palu", cases[2:])):  # the model checks are shared
        for extra, message in checks:
            assert main(["convert", converter, "--kv-keep", "0.5", *extra]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_convert_care_refuses_unknown_keyword_arguments():
    model = make_tiny("llama")
    with pytest.raises(TypeError, match="absorb_vaule"):
        convert_care(model, kv_keep=0.5, method="svd", absorb_vaule=True)
    with pytest.raises(TypeError, match="alhpa"):
        convert_care(model, kv_keep=0.5, calibration=tiny_calibration(model), alhpa=0.5, progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", ["care", "asvd"])
def test_conversion_of_a_model_on_a_gpu_matches_the_cpu_one(method):
    # the statistics live on the CPU: the factorization must not mix them with GPU weights
    model = make_tiny("qwen2")  # k/v biases; absorb_value adds the value bias to a bias-free o_proj
    calibration = tiny_calibration(model)
    config = CareConversionConfig(kv_keep=0.5, method=method, absorb_value=True)
    cpu = run_care_conversion(model, None, config, calibration, False).model
    gpu = run_care_conversion(model.cuda(), None, config, calibration, False).model
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(gpu(ids.cuda()).logits.cpu(), cpu(ids).logits, atol=1e-4, rtol=1e-4)


def test_converted_models_keep_the_source_generation_config(tmp_path):
    # EOS ids and sampling defaults of instruct models live in generation_config.json, not config.json
    from transformers import GenerationConfig

    from hf_accel.compress.palu import convert_palu, save_palu

    settings = {"eos_token_id": [2, 5], "do_sample": True, "temperature": 0.6, "top_p": 0.9, "pad_token_id": 0}
    model = make_tiny("llama")
    model.generation_config = GenerationConfig(**settings)
    care = run_care_conversion(model, None, CareConversionConfig(kv_keep=0.5, method="svd"), None, False)
    ids = torch.randint(3, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    palu, info = convert_palu(model, None, kv_keep=0.5, ranks="uniform", calibration_ids=ids, progress=False)
    for converted in (care.model, palu):
        assert {k: getattr(converted.generation_config, k) for k in settings} == settings
    save_care_model(care, None, tmp_path / "care", "org/tiny")
    save_palu(palu, None, tmp_path / "palu", info, "org/tiny")
    for name in ("care", "palu"):
        saved = GenerationConfig.from_pretrained(tmp_path / name)
        assert {k: getattr(saved, k) for k in settings} == settings


def test_converted_models_are_built_without_random_initialisation(monkeypatch):
    """Every weight is then loaded (strictly): random init only cost time (23 s at 1B shapes) and memory. The
    converted models still reproduce their source at full rank (RoPE buffers are computed at construction)."""
    from hf_accel.compress.palu import convert_palu

    model = make_tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits

    def fail(tensor, *args, **kwargs):
        if tensor.device.type != "meta":  # initialising a meta tensor allocates and computes nothing
            raise AssertionError("a converted model's weights were randomly initialised")

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", fail)  # nn.Linear's reset_parameters
    care = run_care_conversion(model, None, CareConversionConfig(kv_keep=1.0, method="svd"), None, False)
    palu, _ = convert_palu(model, None, kv_keep=1.0, ranks="uniform", calibration_ids=ids, progress=False)
    for converted in (care.model, palu):
        torch.testing.assert_close(converted(ids).logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tie", [True, False])
def test_converted_models_keep_tied_embeddings_tied(tie):
    """Loading the weights by assignment unties the output embedding from the input one (`no_init_weights` used to
    skip the tying): a converted model of a tied source (SmolLM2, Llama-3.2-1B) then held two embeddings, which
    healing trained apart."""
    from hf_accel.compress.palu import convert_palu

    model = make_tiny("llama", tie_word_embeddings=tie)
    ids = torch.randint(3, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    care = run_care_conversion(model, None, CareConversionConfig(kv_keep=1.0, method="svd"), None, False).model
    palu, _ = convert_palu(model, None, kv_keep=1.0, ranks="uniform", calibration_ids=ids, progress=False)
    for converted in (care, palu):
        assert (converted.lm_head.weight is converted.model.embed_tokens.weight) == tie
        torch.testing.assert_close(converted.lm_head.weight, model.lm_head.weight)


def test_conversions_share_the_weights_they_keep_with_the_source():
    """A converted model was built with every weight allocated, then the source's copied in: a conversion held two
    copies of the embeddings and MLPs at its peak (2.9 GB above a 2.1 GB source). The kept weights are now the
    source's own tensors, and the new ones are real tensors (none left on the meta device)."""
    from hf_accel.compress.palu import convert_palu

    model = make_tiny("llama", tie_word_embeddings=False)
    ids = torch.randint(3, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    care = run_care_conversion(model, None, CareConversionConfig(kv_keep=0.5, method="svd"), None, False).model
    palu, _ = convert_palu(model, None, kv_keep=0.5, ranks="uniform", calibration_ids=ids, progress=False)
    source = dict(model.named_parameters())
    for converted in (care, palu):
        for name, param in converted.named_parameters():
            assert param.device.type == "cpu", name
            if name in source and "o_proj" not in name:  # palu folds the values into o_proj
                assert param.data_ptr() == source[name].data_ptr(), name


@pytest.mark.parametrize("method", ["care", "care-u"])
def test_kv_keep_is_a_fraction_of_the_cache_width_when_it_exceeds_the_hidden_size(method):
    # K/V width 4 heads × 16 = 64 against a hidden size of 32: a matrix's rank is at most 32, yet kv_keep 0.5 keeps
    # half of the 64-wide cache (it kept half of 32 before: a quarter of the cache)
    model = make_tiny("llama", head_dim=16, num_key_value_heads=4)
    config = CareConversionConfig(kv_keep=0.5, method=method)
    result = run_care_conversion(model, None, config, tiny_calibration(model), False)
    assert result.summary()["kv_keep_achieved"] == 0.5
    assert kv_cache_bytes_per_token(result.model) == kv_cache_bytes_per_token(model) // 2


def test_rope_that_changes_at_run_time_is_refused():
    # cached keys are RoPE'd at attention time with the current frequencies: dynamic NTK would drift from the
    # original past the trained length (the original keeps each key as rotated when cached)
    parameters = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    model = make_tiny("llama", rope_parameters=parameters, max_position_embeddings=64)
    with pytest.raises(ValueError, match="CARE does not support rope_type 'dynamic'"):
        convert_care(model, kv_keep=0.5, method="svd", progress=False)


def test_generated_calibration_with_a_tokenizer_without_a_pad_token():
    """Llama and Mistral tokenizers have no pad token: the prompts are padded with EOS, and the tokenizer is left as
    it was."""
    from hf_accel.compress.calibration import generate_calibration_ids
    from tests.tiny_checkpoints import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    tokenizer.pad_token = None
    ids = generate_calibration_ids(make_tiny("llama", vocab_size=128), tokenizer, 3, 5, progress=False)
    assert ids.shape == (3, 5)
    assert tokenizer.pad_token is None and tokenizer.padding_side == "right"


def test_generated_calibration_is_seeded_without_reseeding_the_caller():
    # it seeded torch's global generator: the caller's sampling after a conversion followed the calibration seed
    from hf_accel.compress.calibration import generate_calibration_ids
    from tests.tiny_checkpoints import make_char_tokenizer

    model, tokenizer = make_tiny("llama", vocab_size=128), make_char_tokenizer()
    torch.manual_seed(123)
    first = generate_calibration_ids(model, tokenizer, 2, 6, seed=5, progress=False)
    after = torch.rand(4)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(7)
    again = generate_calibration_ids(model, tokenizer, 2, 6, seed=5, progress=False)
    assert torch.equal(after, expected) and torch.equal(first, again)


def _factors(sigma):
    # full-rank factors of a width-4 projection with singular values `sigma` (only the shapes and σ matter here)
    return LowRankFactors(down=torch.zeros(8, 4), up=torch.zeros(4, 4), sigma=torch.tensor(sigma))


def test_allocation_returns_k_then_v_and_honours_the_rank_floor():
    factors = [(_factors([10.0, 9.0, 8.0, 7.0]), _factors([1.0, 0.5, 0.2, 0.1]))]
    # budget 0.5 · 8 = 4: one rank each, then K's σ² = 81 and 64 beat V's 0.25
    assert allocate_ranks(factors, 0.5, "care") == ([3], [1])
    # a floor of half the largest rank: V keeps 2, K takes what is left
    assert allocate_ranks(factors, 0.5, "care", rank_floor_frac=0.5) == ([2], [2])
    # the caller's gains replace σ²: here they favour V
    gains = [torch.tensor([1.0, 0.5, 0.2, 0.1]), torch.tensor([9.0, 8.0, 7.0, 6.0])]
    assert allocate_ranks(factors, 0.5, "care", gains=gains) == ([1], [3])


def test_bench_care_script_refuses_a_kv_keep_outside_the_budget_range_when_parsing(capsys):
    # a bad budget used to fail only after the calibration and every row of the budgets before it
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "bench_care.py"), run_name="x")
    assert script["parse_args"](["--kv-keep", "0.5", "1.0"]).kv_keep == [0.5, 1.0]
    for bad in ("1.5", "0"):
        with pytest.raises(SystemExit) as exit_info:
            script["parse_args"](["--kv-keep", "0.5", bad])
        assert exit_info.value.code == 2 and "kv_keep must be in (0, 1]" in capsys.readouterr().err


def test_bench_care_caches_are_reused_only_with_the_settings_they_were_made_with(tmp_path):
    # --calib-cache / --generated-cache were read back whatever the run's seed, sizes or text: another run's
    # statistics were benchmarked as this one's
    import runpy
    from pathlib import Path

    cached = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "bench_care.py"), run_name="x")[
        "cached"
    ]
    path, made = str(tmp_path / "cal.pt"), []
    assert cached(path, {"seed": 0}, lambda: made.append(1) or torch.ones(2)).tolist() == [1.0, 1.0]
    assert cached(path, {"seed": 0}, lambda: made.append(1) or torch.zeros(2)).tolist() == [1.0, 1.0]  # reused
    assert made == [1] and [p.name for p in tmp_path.iterdir()] == ["cal.pt"]  # no temporary file left
    with pytest.raises(SystemExit, match="was made with {'seed': 0}"):
        cached(path, {"seed": 1}, lambda: torch.zeros(2))
    assert cached(None, {"seed": 1}, lambda: "not saved") == "not saved"


def _bench_care_on_a_tiny_model(tmp_path, monkeypatch):
    """`scripts/bench_care.py`'s namespace, with the default model replaced by a tiny one, and the arguments of its
    smallest run (one method, `--json`) on a text file in `tmp_path`."""
    import runpy
    from pathlib import Path

    import hf_accel.loading
    from tests.conftest import make_tiny_llama
    from tests.tiny_checkpoints import VOCAB_SIZE, make_char_tokenizer

    monkeypatch.setattr(
        hf_accel.loading,
        "load_model_and_tokenizer",
        lambda *a, **k: (make_tiny_llama(vocab_size=VOCAB_SIZE), make_char_tokenizer()),
    )
    (tmp_path / "t.txt").write_text("To be, or not to be: that is the question. " * 20)
    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "bench_care.py"), run_name="x")
    argv = ["--text", str(tmp_path / "t.txt"), "--kv-keep", "0.5", "--methods", "care", "--calib-text-samples", "2"]
    argv += ["--calib-generated-samples", "1", "--calib-seq-len", "16", "--eval-tokens", "64"]
    argv += ["--eval-generated-tokens", "16", "--eval-seq-len", "32", "--json"]
    return script, argv


def test_bench_care_caches_load_without_unpickling_code(tmp_path, monkeypatch, capsys):
    # --calib-cache was read with torch.load(weights_only=False), which runs whatever code a crafted file pickles: the
    # calibration is saved as its fields, read back with weights_only=True; an older file is refused in one line
    from hf_accel.compress.calibration import KvCalibration

    script, argv = _bench_care_on_a_tiny_model(tmp_path, monkeypatch)
    cache = tmp_path / "cal.pt"
    argv += ["--calib-cache", str(cache)]
    reports = []
    for _ in range(2):  # made, then read back
        assert script["main"](argv) == 0
        reports.append(
            [(r["k_ranks"], r["v_ranks"], r["ppl"]) for r in json.loads(capsys.readouterr().out)["results"]]
        )
    assert reports[1] == reports[0]
    saved = torch.load(cache, weights_only=True)
    assert KvCalibration(**saved["value"]).tokens == saved["value"]["tokens"] > 0
    torch.save({"settings": saved["settings"], "value": KvCalibration(**saved["value"])}, cache)  # the old format
    with pytest.raises(SystemExit, match="was made with an older bench_care"):
        script["main"](argv)


def test_a_calibration_of_another_model_is_refused():
    """Reused statistics must come from this model: more layers than it has were used silently, fewer failed deep."""
    model, other = make_tiny("llama"), make_tiny("llama", num_hidden_layers=3)
    for calibration in (tiny_calibration(other), tiny_calibration(make_tiny("llama", hidden_size=64))):
        with pytest.raises(ValueError, match="calibration does not fit this model"):
            convert_care(model, kv_keep=0.5, method="care-u", calibration=calibration, progress=False)


def test_float16_model_calibrated_on_one_repeated_token_converts():
    """One repeated token makes every key identical, so the loss gradient at k_proj vanishes (G ≈ 1e-20): √G's inverse
    went into k_up (≈ 1e10), past float16's range, and the conversion failed with 'non-finite values'."""
    from hf_accel.compress.calibration import collect_kv_calibration

    model = make_tiny("llama").to(torch.float16)
    calibration = collect_kv_calibration(model, torch.full((1, 4), 5), with_output_grads=True, progress=False)
    care = convert_care(model, kv_keep=1.0, calibration=calibration, progress=False)
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(care(ids).logits, model(ids).logits, atol=5e-3, rtol=0)


def test_a_numpy_kv_keep_is_taken_as_a_float():
    """`kv_keep` from a numpy grid (np.float32) was refused as 'must be in (0, 1], got np.float32(0.5)'; it is a
    fraction like any other, stored as a plain float so that the saved JSON can hold it."""
    import json

    import numpy as np

    from hf_accel.compress.palu import PaluConversionConfig

    config = CareConversionConfig(kv_keep=np.float32(0.5))
    assert type(config.kv_keep) is float and json.dumps(config.kv_keep) == "0.5"
    palu = PaluConversionConfig(kv_keep=np.float32(0.5))
    assert type(palu.kv_keep) is float and palu.kv_keep == 0.5
    for bad in (np.float32(1.5), "0.5", None):
        with pytest.raises(ValueError, match="kv_keep must be in"):
            CareConversionConfig(kv_keep=bad)
        with pytest.raises(ValueError, match="kv_keep must be in"):
            PaluConversionConfig(kv_keep=bad)


def test_bench_care_json_is_the_only_thing_on_stdout(tmp_path, monkeypatch, capsys):
    # the table, the calibration line and one progress line per row went to stdout before the JSON
    script, argv = _bench_care_on_a_tiny_model(tmp_path, monkeypatch)
    assert script["main"](argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out)
    assert out.count("\n") == 1 and [row["method"] for row in report["results"]] == ["care"]


def test_a_checkpoint_does_not_depend_on_how_long_its_conversion_took(tmp_path):
    """`care_ranks.json` is published with the checkpoint: it held the calibration and factorization seconds, so two
    conversions of one model with one calibration gave checkpoints that differ (and another Hub commit)."""
    import dataclasses

    model = make_tiny("llama")
    result = run_care_conversion(
        model, None, CareConversionConfig(kv_keep=0.5, method="care-u"), tiny_calibration(model)
    )
    slower = dataclasses.replace(result, calibration_seconds=12.5, factorization_seconds=3.25)
    for name, converted in (("a", result), ("b", slower)):
        save_care_model(converted, None, tmp_path / name / "care", "org/tiny")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    for file in files:
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


def test_the_calibration_seed_is_part_of_the_published_record(tmp_path):
    """`--seed` picks the calibration windows of a text (and the model's samples with `generated`): a card and
    `care_ranks.json` that name the source and sizes but not the seed do not say how to make the checkpoint again."""
    from hf_accel.compress.care import prepare_calibration
    from tests.tiny_checkpoints import make_char_tokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i} of the calibration text.\n" for i in range(200)))
    model, tokenizer = make_tiny("llama", vocab_size=128), make_char_tokenizer()
    config = CareConversionConfig(kv_keep=0.5, method="care-u")
    calibrations = [
        prepare_calibration(model, tokenizer, str(text), 4, 16, False, seed=seed, progress=False) for seed in (0, 7)
    ]
    assert not torch.equal(calibrations[0].moments[0], calibrations[1].moments[0])  # other windows
    result = run_care_conversion(model, None, config, calibrations[1], False)
    save_care_model(result, None, tmp_path / "out", "org/tiny")
    assert json.loads((tmp_path / "out" / "care_ranks.json").read_text())["calibration"]["seed"] == 7
    assert "seed 7" in (tmp_path / "out" / "README.md").read_text()


def alive_at_build(monkeypatch, name: str, tensors_of) -> tuple[list, list]:
    """Watches `hf_accel.compress.care.<name>`: weak references to `tensors_of(its result)`, and, when the converted
    model is built (the conversion's peak), those still alive."""
    import gc
    import weakref

    from hf_accel.compress import care

    watched, alive = [], []
    function = getattr(care, name)

    def watching(*args, **kwargs):
        result = function(*args, **kwargs)
        watched.extend(weakref.ref(t) for t in tensors_of(result))
        return result

    def build_and_check(*args, **kwargs):
        gc.collect()
        alive.extend(ref for ref in watched if ref() is not None)
        return build_care_model(*args, **kwargs)

    monkeypatch.setattr(care, name, watching)
    monkeypatch.setattr(care, "build_care_model", build_and_check)
    return watched, alive


def test_full_rank_factors_are_freed_before_the_converted_model_is_built(monkeypatch):
    """The original and the converted model coexist while the latter is built (the conversion's peak); the full-rank
    float64 factors (33 GB at Llama-2-7B's shapes) are cut to their ranks before that, as Palu's are, and the
    conversion is unchanged."""
    model = make_tiny("llama")
    calibration = tiny_calibration(model)
    config = CareConversionConfig(kv_keep=0.5)
    expected = run_care_conversion(model, None, config, calibration, False).model.state_dict()
    full_rank, alive = alive_at_build(
        monkeypatch, "factorize_kv", lambda factors: [t for pair in factors for f in pair for t in (f.down, f.up)]
    )
    converted = run_care_conversion(model, None, config, calibration, False).model
    assert full_rank and not alive
    for name, tensor in converted.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


def test_float64_results_of_every_layer_are_not_held_until_the_converted_weights_are_loaded(monkeypatch):
    """Each layer's float64 `o_proj` (CARE's absorbed value projection, Palu's folded one) is converted as it is
    made: held until the load, every layer's were kept together with their converted copies, three times the new
    `o_proj` weights (which are larger than the original's) beside the two models."""
    import gc
    import weakref

    from hf_accel.compress import care, palu

    model = make_tiny("llama")
    ids = torch.randint(3, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    made, alive = [], []

    def watch(fold):
        def folded(*args, **kwargs):
            result = fold(*args, **kwargs)
            made.extend(weakref.ref(t) for t in (result if isinstance(result, tuple) else (result,)))
            return result

        return folded

    def check_then_load(load):
        def loaded(*args, **kwargs):
            gc.collect()
            alive.extend(ref for ref in made if ref() is not None)
            return load(*args, **kwargs)

        return loaded

    for module, fold in ((care, "_absorbed_o_proj"), (palu, "fold_values_into_o_proj")):
        monkeypatch.setattr(module, fold, watch(getattr(module, fold)))
        monkeypatch.setattr(module, "load_converted_state", check_then_load(module.load_converted_state))
    config = CareConversionConfig(kv_keep=0.5, method="care-u", absorb_value=True)
    run_care_conversion(model, None, config, tiny_calibration(model, with_output_grads=False), False)
    palu.convert_palu(model, None, kv_keep=0.5, ranks="uniform", calibration_ids=ids, progress=False)
    assert len(made) == 3 * model.config.num_hidden_layers and not alive


def test_a_calibration_made_by_the_conversion_is_freed_before_the_converted_model_is_built(monkeypatch):
    # CareResult kept the whole calibration (float64 [hidden, hidden] moments: 4.3 GB at Llama-3-8B's shapes) through
    # the build, the conversion's peak; only its description is published
    from tests.tiny_checkpoints import make_char_tokenizer

    made, alive = alive_at_build(monkeypatch, "prepare_calibration", lambda calibration: calibration.moments)
    model = make_tiny("llama", vocab_size=128)
    config = CareConversionConfig(kv_keep=0.5, method="care-u")
    result = run_care_conversion(model, make_char_tokenizer(), config, None, False, num_samples=2, seq_len=8)
    assert made and not alive
    assert result.calibration == {"source": "generated", "num_samples": 2, "seq_len": 8, "seed": 0, "tokens": 16}


def test_factors_past_float32_s_range_do_not_suggest_converting_in_float32():
    model = make_tiny("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.fill_(1e38)  # U Σ = 4e38 per entry, past float32's 3.4e38
    with pytest.raises(ValueError) as error:
        convert_care(model, kv_keep=0.5, method="svd", progress=False)
    assert str(error.value) == (
        "CARE conversion produced non-finite values in model.layers.1.self_attn.k_down.weight (float32); "
        "convert with a larger shrinkage alpha"
    )


def test_method_care_refuses_a_calibration_without_gradient_moments():
    model = make_tiny("llama")
    calibration = tiny_calibration(model, with_output_grads=False)
    with pytest.raises(
        ValueError, match="^method 'care' needs output-gradient moments: calibrate with with_output_gr"
    ):
        convert_care(model, kv_keep=0.5, method="care", calibration=calibration, progress=False)
    assert convert_care(model, kv_keep=0.5, method="care-u", calibration=calibration, progress=False)  # others can


def test_calibrating_without_a_tokenizer_is_refused_in_one_line():
    with pytest.raises(ValueError, match="^a tokenizer is needed to build calibration data$"):
        convert_care(make_tiny("llama"), None, kv_keep=0.5, method="care-u", progress=False)


def test_factors_past_the_checkpoint_dtype_s_range_are_refused_naming_the_weight():
    """A float16 projection whose plain-SVD factor `U Σ` exceeds 65504 gives inf weights: refused, naming them."""
    model = make_tiny("llama").to(torch.float16)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.fill_(6e4)  # rank one: U Σ = 6e4 · √16 = 2.4e5 per entry
    with pytest.raises(
        ValueError,
        match=r"^CARE conversion produced non-finite values in model\.layers\.1\.self_attn\.k_down\.weight \(float16\); "
        r"convert the model in float32",
    ):
        convert_care(model, kv_keep=0.5, method="svd", progress=False)


def test_a_checkpoint_without_a_hub_id_or_tokenizer_holds_the_model_alone(tmp_path):
    result = run_care_conversion(
        make_tiny("llama"), config=CareConversionConfig(kv_keep=0.5, method="svd"), progress=False
    )
    out = save_care_model(result, None, tmp_path / "care", base_model=None)
    assert sorted(p.name for p in out.iterdir()) == [
        "care_ranks.json",
        "care_ranks.png",
        "config.json",
        "configuration_care.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_care.py",
    ]  # no card, no tokenizer files


def test_the_care_benchmark_table_by_hand():
    from hf_accel.eval.care_quality import format_care_table

    report = {
        "original": {"ppl": {"wiki": 13.2249, "code": 4.5}, "cache_bytes_per_token": 46080.0},
        "results": [
            {"kv_keep": 0.5, "method": "care", "ppl": {"wiki": 24.371, "code": 12345.6},
             "cache_bytes_per_token": 23040.0, "factorization_seconds": 3.14},
            {"kv_keep": 0.25, "method": "svd", "ppl": {"wiki": float("inf"), "code": float("nan")},
             "cache_bytes_per_token": 11520.0, "factorization_seconds": 0.5},
        ],
    }  # fmt: skip
    assert format_care_table(report, ["wiki", "code"]).splitlines() == [
        "| kv-keep | method | ppl wiki | ppl code | KV bytes/token | factorize s |",
        "|---|---|---|---|---|---|",
        "| 1.0 | original | 13.22 | 4.50 | 46080 | – |",
        "| 0.5 | care | 24.37 | 12,346 | 23040 | 3.1 |",
        "| 0.25 | svd | inf | nan | 11520 | 0.5 |",
    ]
