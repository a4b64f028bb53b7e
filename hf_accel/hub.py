"""Hub-ready artifacts: saving with a generated model card, pushing, and writing a local cache in the Hub's layout.

Every artifact this project makes is a directory the Hub understands: the files (`config.json`, `*.safetensors`,
remote code, tokenizer, adapter config, index files, ...) plus a `README.md` model card rendered from a template in
`hub_cards/` (one per artifact kind, see `ARTIFACT_KINDS`) with `huggingface_hub.ModelCardData` metadata.

`populate_hub_cache` writes such a directory into a Hugging Face cache (`models--ORG--NAME/{blobs,snapshots,refs}`),
so `from_pretrained("ORG/NAME")` works with `HF_HUB_OFFLINE=1` on a machine without network, exactly as after a
download of the pushed repository.
"""

import fnmatch
import hashlib
import importlib.metadata
import inspect
import json
import os
import posixpath
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


def _find_hub_cards_dir() -> Path:
    """The repository's `hub_cards/` (source checkouts, editable installs), else where the installed wheel put it
    (pyproject data-files: `share/hf_accel/hub_cards` under the scheme's data directory, which is `sys.prefix` in a
    virtual environment but the user base with `pip install --user` and the prefix with `--prefix`): found through the
    distribution's file list, which records it for every scheme."""
    source = Path(__file__).resolve().parents[1] / "hub_cards"
    if source.is_dir():
        return source
    try:
        files = importlib.metadata.distribution("hf-accel").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.parent.parts[-3:] == ("share", "hf_accel", "hub_cards"):
            installed = Path(file.locate()).resolve().parent
            if installed.is_dir():
                return installed
    return source


HUB_CARDS_DIR = _find_hub_cards_dir()
# Trainer checkpoints (optimizer states) and logs are not part of a published artifact, nor a `git clone`'s own folder
# (the Hub refuses any path under `.git/`, as under `.cache/`).
DEFAULT_IGNORE_PATTERNS = (
    ".git",
    ".git/*",
    "*/.git",
    "*/.git/*",
    "checkpoint-*",
    "checkpoint-*/*",
    "runs/*",
    "*/.cache/*",
    ".cache/*",
    ".staging-*",
    ".staging-*/*",
    ".*.tmp",  # a write cut short (the perplexity history is written to `.ppl_history.json.tmp`, then renamed)
    ".*.incomplete",  # the same, by `atomic.replace_atomically` (a self-distillation cache's rewrite)
    ".*.lock",  # an inter-process lock (the self-distillation cache's `.self_distill.jsonl.lock`)
)
# Weight files: a re-push deletes the repository's ones the artifact no longer has (a stale `model.safetensors` beside
# new shards would be loaded first), as `save_pretrained` removes stale shards from a local folder.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
# Aliases of this project that stand for Hub repositories (the card's `base_model` must be a Hub id).
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# A card saved without a repo id shows `<your-namespace>/NAME` in its snippets; publishing fills in the repository.
_PLACEHOLDER_NAMESPACE = "<your-namespace>"
_PLACEHOLDER_REPO_ID = re.compile(re.escape(_PLACEHOLDER_NAMESPACE) + r"/[^\s\"'`)]+")


class HubError(ValueError):
    """A publishing step that cannot proceed (no token, no network, refused by the Hub); the message says why."""


@dataclass(frozen=True)
class ArtifactKind:
    """How one kind of artifact is described on the Hub."""

    template: str
    library_name: str
    base_model_relation: str | None
    tags: tuple[str, ...] = field(default_factory=tuple)
    pipeline_tag: str | None = "text-generation"


ARTIFACT_KINDS = {
    # The Hub's relations are adapter / merge / quantized / finetune; a converted model is the base model compressed
    # (smaller KV cache) like a quantization is, hence "quantized" (a healed one is still that compression).
    "converted-model": ArtifactKind("converted_model.md", "transformers", "quantized", ("hf-accel", "kv-cache")),
    "lora-adapter": ArtifactKind("lora_adapter.md", "peft", "adapter", ("hf-accel", "lora")),
    "drafter-adapter": ArtifactKind("drafter_adapter.md", "hf-accel", "adapter", ("hf-accel", "speculative-decoding")),
    "drafter-index": ArtifactKind(
        "drafter_index.md", "hf-accel", None, ("hf-accel", "speculative-decoding", "ngram-index"), None
    ),
}


def _artifact_kind(kind: str) -> ArtifactKind:
    if kind not in ARTIFACT_KINDS:
        raise ValueError(f"unknown artifact kind {kind!r}; choose one of {sorted(ARTIFACT_KINDS)}")
    return ARTIFACT_KINDS[kind]


def hub_base_model(name_or_path: str) -> str:
    """The Hub id to write as `base_model`: aliases are mapped (`smollm2-135m`), local paths and names the Hub would
    not take as a repository id (spaces, quotes, line breaks: they would also reach the card's snippets) are
    refused."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from .loading import looks_like_local_path

    name = HUB_IDS.get(name_or_path, name_or_path)
    try:
        if not isinstance(name, str) or looks_like_local_path(name):
            raise HFValidationError(name)
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(f"base_model must be a Hub id like ORG/NAME, got {name_or_path!r} (a local path?)") from None
    return name


def hub_id_or_none(name_or_path: str) -> str | None:
    """[`hub_base_model`]`(name_or_path)`, or `None` for a local path (an artifact that cannot name its base)."""
    try:
        return hub_base_model(name_or_path)
    except ValueError:
        return None


def published_name(name: str) -> str:
    """How an input (training text, dataset, prompt file) is named in a published card or header: a local file or
    directory by its own name, not the path it has on this machine (`.` by the working directory's); a Hub id or a
    built-in name as given."""
    from .loading import looks_like_local_path

    if not looks_like_local_path(name):
        return name
    return Path(os.path.abspath(os.path.expanduser(name))).name or name  # made absolute, links kept: `.` has no name


def is_hf_accel_card(path: str | Path) -> bool:
    """Whether `path` is a model card hf-accel wrote (tagged `hf-accel`), not a user's README."""
    import yaml
    from huggingface_hub import ModelCard

    if not Path(path).is_file():
        return False
    try:
        return "hf-accel" in (ModelCard.load(path).data.tags or [])
    except (ValueError, yaml.YAMLError):  # front matter that is not a card's
        return False


def _eval_results(results):
    """`EvalResult`s from measured numbers: dicts with `metric_type`, `metric_value`, `dataset_name` (and optionally
    any other `EvalResult` field), or `EvalResult` objects."""
    from huggingface_hub import EvalResult

    out = []
    for result in results or []:
        if not isinstance(result, EvalResult):
            result = dict(result)
            result.setdefault("task_type", "text-generation")
            result.setdefault("dataset_type", result.get("dataset_name"))
            result = EvalResult(**result)
        out.append(result)
    return out


def _eval_row(result) -> tuple[str, str, str]:
    """An `EvalResult` as the evaluation table's (metric, dataset, value) cells: a dataset named after a local file
    may hold a pipe or a line break."""
    dataset = result.dataset_name + (f" ({result.dataset_split})" if result.dataset_split else "")
    return tuple(map(_table_cell, (result.metric_name or result.metric_type, dataset, result.metric_value)))


def _placeholder_repo_id(name: str) -> str:
    """`<your-namespace>/NAME` for a card saved without a repo id, NAME made a valid repository name (`my model (v2)`
    gives `my-model-v2`): publishing replaces the whole placeholder with the repository, which a space or a bracket
    would cut short, leaving the rest of the name in the snippets."""
    return f"{_PLACEHOLDER_NAMESPACE}/{re.sub(r'[^A-Za-z0-9_.-]+', '-', name).strip('-.') or 'model'}"


def _one_line(value) -> str:
    """`value` as text on one line: a line break ends a markdown table row or heading."""
    return " ".join(str(value).splitlines())


def _table_cell(value) -> str:
    """`value` as one markdown table cell: on one line, its `|` escaped (GFM splits cells at every pipe)."""
    return _one_line(value).replace("|", "\\|")


def _code_cell(value) -> str:
    """`value` as inline code in a markdown table cell, shown as it is: a [`_table_cell`] (GFM splits at a pipe even
    inside code) fenced by more backticks than any run it holds (file names and dataset names reach the settings
    table)."""
    text = _table_cell(value)
    fence = "`" * (1 + max(map(len, re.findall("`+", text)), default=0))
    pad = " " if not text.strip() or text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _local_image(output_dir: Path, image: str | Path | None, default_globs: tuple[str, ...]) -> str | None:
    """A path relative to `output_dir` for an image (copied in when it lives elsewhere), or the first file there
    matching `default_globs`, or `None`."""
    if image is None:
        found = sorted(p for pattern in default_globs for p in output_dir.glob(pattern))
        return found[0].name if found else None
    image = Path(image)
    if not image.is_file():
        raise FileNotFoundError(f"image not found: {image}")
    if output_dir.resolve() not in image.resolve().parents:
        shutil.copy(image, output_dir / image.name)
        return image.name
    return image.resolve().relative_to(output_dir.resolve()).as_posix()


def write_model_card(
    output_dir: str | Path,
    kind: str,
    base_model: str,
    *,
    model_name: str | None = None,
    repo_id: str | None = None,
    description: str = "",
    settings: dict | None = None,
    eval_results: list | None = None,
    kv_bytes_per_token: float | None = None,
    base_kv_bytes_per_token: float | None = None,
    ranks_plot: str | Path | None = None,
    papers: list[dict] | None = None,
    tags: list[str] | tuple = (),
    datasets: list[str] | None = None,
    license: str | None = None,
    base_model_relation: str | None = "default",
    template_dir: str | Path | None = None,
    base_remote_code: bool = False,
):
    """Renders `hub_cards/<kind template>` into `output_dir/README.md` and returns the `ModelCard`.

    Args:
        output_dir (`str` or `Path`): the artifact directory.
        kind (`str`): one of `ARTIFACT_KINDS`: `converted-model`, `lora-adapter`, `drafter-adapter`,
            `drafter-index`.
        base_model (`str`): the Hub id of the model this artifact derives from (or the alias `smollm2-135m`).
        model_name (`str`, *optional*): the card title; defaults to the repo name or the directory name.
        repo_id (`str`, *optional*): the repository id used in the card's loading snippet.
        description (`str`, *optional*): a paragraph under the title.
        settings (`dict`, *optional*): conversion/training settings, rendered as a table (and kept verbatim).
        eval_results (`list`, *optional*): measured numbers, as dicts (`metric_type`, `metric_value`,
            `dataset_name`, ...) or `huggingface_hub.EvalResult`s; they go into the metadata and a table.
        kv_bytes_per_token (`float`, *optional*): KV-cache bytes per token of this model, with 16-bit floats.
        base_kv_bytes_per_token (`float`, *optional*): the same for the base model (the card shows the ratio).
        ranks_plot (`str` or `Path`, *optional*): an image of the per-layer ranks; copied in if elsewhere. Without it,
            a `ranks*.png` in `output_dir` is used if present. A `ppl_curve.png` (healing) is linked when present.
        papers (`list[dict]`, *optional*): the methods' papers, `{"title", "arxiv"}`; each adds an `arxiv:` tag.
        tags (`list[str]`, *optional*): extra tags (the kind's own tags are always there).
        datasets (`list[str]`, *optional*): Hub ids of the data used (calibration, training).
        license (`str`, *optional*): the license id (usually the base model's).
        base_model_relation (`str`, *optional*): `adapter`, `merge`, `quantized`, `finetune` or `None`; defaults to the
            kind's (`quantized` for converted models, `adapter` for adapters).
        template_dir (`str` or `Path`, *optional*): where the templates are; defaults to `HUB_CARDS_DIR`, the
            repository's `hub_cards/` or the one a wheel installed.
        base_remote_code (`bool`, *optional*, defaults to `False`): whether `base_model` runs code shipped with it (a
            converted CARE/Palu checkpoint): a drafter's snippets then load it with `trust_remote_code=True` and
            `--trust-remote-code`, without which they fail.

    Returns:
        `huggingface_hub.ModelCard`.

    Example:
        ```python
        >>> write_model_card("out/care-0.5", "converted-model", "smollm2-135m", settings={"method": "care",
        ...     "kv_keep": 0.5}, eval_results=[{"metric_type": "perplexity", "metric_value": 12.3,
        ...     "dataset_name": "wikitext"}], kv_bytes_per_token=11520, base_kv_bytes_per_token=23040)
        ```
    """
    from huggingface_hub import ModelCard, ModelCardData

    spec = _artifact_kind(kind)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    name = model_name or (repo_id.split("/")[-1] if repo_id else output_dir.resolve().name)
    papers = list(papers or [])
    all_tags = list(dict.fromkeys([*spec.tags, *tags, *(f"arxiv:{p['arxiv']}" for p in papers if p.get("arxiv"))]))
    relation = spec.base_model_relation if base_model_relation == "default" else base_model_relation
    card_data = ModelCardData(
        base_model=hub_base_model(base_model),
        base_model_relation=relation,
        library_name=spec.library_name,
        pipeline_tag=spec.pipeline_tag,
        tags=all_tags,
        datasets=datasets,
        license=license,
        model_name=name,
        eval_results=_eval_results(eval_results) or None,
    )
    ratio = None
    if kv_bytes_per_token and base_kv_bytes_per_token:
        ratio = kv_bytes_per_token / base_kv_bytes_per_token
    template = Path(template_dir or HUB_CARDS_DIR) / spec.template
    if not template.is_file():
        where = "" if template_dir else " (hf-accel's hub_cards/ is not installed: reinstall hf-accel)"
        raise FileNotFoundError(f"no model-card template {template}{where}")
    card = ModelCard.from_template(
        card_data,
        template_path=str(template),
        model_name=_one_line(name),
        repo_id=repo_id or _placeholder_repo_id(name),
        base_model=card_data.base_model,
        description=description,
        settings={_code_cell(key): _code_cell(value) for key, value in (settings or {}).items()},
        eval_rows=[_eval_row(r) for r in card_data.eval_results or []],  # the shipped templates' table cells
        eval_results=card_data.eval_results or [],  # as before, for a `template_dir` written against them
        kv_bytes_per_token=kv_bytes_per_token,
        base_kv_bytes_per_token=base_kv_bytes_per_token,
        kv_ratio=ratio,
        papers=papers,
        ranks_plot=_local_image(output_dir, ranks_plot, ("ranks*.png",)),
        ppl_plot=_local_image(output_dir, None, ("ppl_curve.png",)),
        custom_generate=(output_dir / "custom_generate" / "generate.py").is_file(),
        base_remote_code=base_remote_code,
    )
    # Jinja leaves blank lines where optional sections are skipped.
    card = ModelCard(re.sub(r"\n{3,}", "\n\n", str(card)))
    card.save(output_dir / "README.md")
    return card


def _auto_map_files(config) -> set[str]:
    """The module files named by a config's `auto_map` (local references only, not `repo--module.Class`). A reference
    is `module.Class`, the module a file beside the config, as transformers reads it: one naming a path (`/...`,
    `../...`: a crafted config.json) names no file, so nothing outside the model's code folder is copied."""
    names = set()
    for value in (getattr(config, "auto_map", None) or {}).values():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(ref, str) and "--" not in ref and re.fullmatch(r"[\w-]+\.\w+", ref):
                names.add(ref.rsplit(".", 1)[0] + ".py")
    return names


_PALU_KERNELS_SHIM = (Path(__file__).parent / "models" / "palu_kernels.py").resolve()


def _relative_import_files(path: Path) -> list[str]:
    """The files `path` imports relatively, recursively (transformers' own walk), or a one-line error naming the one
    that is not there."""
    from transformers.dynamic_module_utils import get_relative_import_files

    try:
        return get_relative_import_files(str(path))
    except FileNotFoundError as err:
        missing = Path(err.filename).name
        raise FileNotFoundError(
            f"{path.name} needs {missing} (a relative import), but it is not in {path.parent}"
        ) from None


def copy_remote_code(model, output_dir: str | Path, source_dir: str | Path | None = None) -> list[str]:
    """Copies the modeling/configuration files that a trust_remote_code model's `auto_map` names into `output_dir`.

    `save_pretrained` already does this for models loaded through an Auto class; this fills the gap otherwise (a
    model built by hand, or files a converter writes itself). Files are looked up next to the model's class (for a
    loaded model, transformers' dynamic-module copy) and then in `source_dir`; their relative imports come along.

    Returns:
        `list[str]`: the names of the files copied.
    """
    output_dir = Path(output_dir)
    search = [Path(inspect.getfile(type(model))).parent]
    if source_dir is not None and Path(source_dir).is_dir():
        search.append(Path(source_dir))
    sources = {}  # every file and the modules it imports found before any is copied: a missing one changes nothing
    for name in sorted(_auto_map_files(model.config)):
        if (output_dir / name).is_file():
            continue
        found = next((d / name for d in search if (d / name).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"auto_map names {name}, but it is in none of {[str(d) for d in search]}")
        for path in [found, *map(Path, _relative_import_files(found))]:
            if not (output_dir / path.name).is_file():
                sources.setdefault(path.name, path)
    copied = []
    for name, path in sources.items():
        if path.resolve() == _PALU_KERNELS_SHIM:  # imports hf_accel: write the self-contained version instead
            from .compress.palu import write_palu_kernels_file

            write_palu_kernels_file(output_dir / name)
        else:  # a new file's permissions: a read-only install's would make it read-only
            shutil.copyfile(path, output_dir / name)
        copied.append(name)
    return copied


def _is_peft_model(model) -> bool:
    """Whether `model` saves an adapter, not a checkpoint: a PEFT model (`PeftModel`, `PeftMixedModel`), or a
    transformers model with PEFT adapters loaded (`add_adapter`, `load_adapter`, or read from an adapter's folder),
    whose `save_pretrained` writes its active adapter alone."""
    if not isinstance(getattr(model, "peft_config", None), dict):
        return False
    return callable(getattr(model, "get_base_model", None)) or bool(getattr(model, "_hf_peft_config_loaded", False))


def name_base_model_in_adapters(model, output_dir: Path, base_model: str | None) -> None:
    """Writes `base_model` (a Hub id) as `base_model_name_or_path` into the `adapter_config.json` files the PEFT `model`
    saved in `output_dir`, where PEFT wrote the local directory the base was loaded from: the adapter then points
    where the card does, and loads on another machine (`None`: no base named, rather than a local path). The model's
    own configs are left as they are."""
    # a PeftModel saves its `default` adapter at the top and the others in folders of their names; a transformers
    # model saves its active adapter, whatever its name, at the top
    folders = {"", *(name for name in model.peft_config if name != "default")}
    for folder in sorted(folders):
        path = output_dir / folder / "adapter_config.json"
        if path.is_file():
            config = json.loads(path.read_text(encoding="utf-8"))
            config["base_model_name_or_path"] = base_model
            path.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def _save_model(model, output_dir: Path, base_model: str) -> None:
    """`model.save_pretrained(output_dir)`, plus the remote code its config's `auto_map` names. A PEFT model saves an
    adapter that names the Hub id `base_model`, and no remote code: its config is the base model's, whose own
    repository holds that code."""
    model.save_pretrained(output_dir)
    if _is_peft_model(model):
        name_base_model_in_adapters(model, output_dir, base_model)
    elif getattr(getattr(model, "config", None), "auto_map", None):
        copy_remote_code(model, output_dir)


def write_custom_generate(output_dir: str | Path, drafter: str, artifact: str | Path) -> None:
    """Writes `custom_generate/generate.py` (a copy of [`hf_accel.speculative.repo_generate`] drafting with `drafter`
    from `artifact`) and `custom_generate/requirements.txt` (this `hf-accel` version) into `output_dir`.

    transformers runs that file for `model.generate(custom_generate=<directory or repository>,
    trust_remote_code=True)`. `artifact` is where the drafter's files are: the directory here;
    [`push_to_hub`] and [`populate_hub_cache`] publish the file pointing at the repository instead.
    """
    from importlib.metadata import version

    from .speculative import repo_generate
    from .speculative.drafters import available_drafters

    if drafter not in available_drafters():
        raise ValueError(f"unknown drafter {drafter!r}; available: {', '.join(available_drafters())}")
    if Path(artifact).is_dir():  # a local folder, named absolutely: the file runs from any working directory
        artifact = Path(artifact).resolve()
    folder = Path(output_dir) / "custom_generate"
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(repo_generate.__file__).read_text(encoding="utf-8")
    source = _set_constant(_set_constant(source, "DRAFTER", drafter), "ARTIFACT", str(artifact))
    (folder / "generate.py").write_text(source, encoding="utf-8")
    (folder / "requirements.txt").write_text(f"hf-accel>={version('hf-accel')}\n", encoding="utf-8")


def _constant_line(name: str) -> re.Pattern:
    """The top-level line `NAME = ...` of a module's source."""
    return re.compile(rf"^{name} = .*$", re.MULTILINE)


def _set_constant(source: str, name: str, value: str) -> str:
    """`source` with its top-level line `NAME = ...` replaced by `NAME = 'value'`."""
    pattern = _constant_line(name)
    if len(pattern.findall(source)) != 1:
        raise ValueError(f"expected one top-level `{name} = ...` line in custom_generate/generate.py")
    return pattern.sub(lambda _: f"{name} = {value!r}", source)


def _published_bytes(path: Path, folder: Path, repo_id: str) -> bytes | Path:
    """What a repository gets for `path`: the file itself, except that a drafter's `custom_generate/generate.py`
    drafts from the repository `repo_id` (it was saved naming its local directory; a folder's own decoding code, with
    no `ARTIFACT = ...` line, is published as it is) and a model card saved without a repo id names `repo_id` in its
    snippets instead of the `<your-namespace>/NAME` placeholder."""
    name = path.relative_to(folder).as_posix()
    if name == "custom_generate/generate.py":
        source = path.read_text(encoding="utf-8")
        if not _constant_line("ARTIFACT").search(source):
            return path
        published = _set_constant(source, "ARTIFACT", repo_id)
        current = _current_custom_generate(source, repo_id)
        if current is not None and published != current:
            from .log import get_logger

            get_logger(__name__).warning(
                f"{path} is not the one this hf-accel writes (an earlier version's, or edited); it is published as it "
                f"is: re-save it with hf_accel.hub.write_custom_generate(FOLDER, DRAFTER, FOLDER) for the current one"
            )
        return published.encode()
    if name == "README.md":
        card = path.read_text(encoding="utf-8")
        published = _PLACEHOLDER_REPO_ID.sub(lambda _: repo_id, _replace_unsanitized_placeholder(card, repo_id))
        return published.encode() if published != card else path
    return path


def _current_custom_generate(source: str, artifact: str) -> str | None:
    """What [`write_custom_generate`] writes now for the drafter `source` names, drafting from `artifact` (`None` if
    `source` names no drafter this version has)."""
    import ast

    from .speculative import repo_generate
    from .speculative.drafters import available_drafters

    line = _constant_line("DRAFTER").search(source)
    try:
        drafter = ast.literal_eval(line.group(0).split("=", 1)[1].strip()) if line else None
    except (ValueError, SyntaxError):
        return None
    if drafter not in available_drafters():
        return None
    current = Path(repo_generate.__file__).read_text(encoding="utf-8")
    return _set_constant(_set_constant(current, "DRAFTER", drafter), "ARTIFACT", artifact)


def _replace_unsanitized_placeholder(card: str, repo_id: str) -> str:
    """`card` with `<your-namespace>/NAME` replaced by `repo_id`, NAME being the card's `model_name` as it is: cards
    written before [`_placeholder_repo_id`] put the name there unchanged, which [`_PLACEHOLDER_REPO_ID`] would cut at
    its first space or bracket (`custom_generate="me/idx index (v2)"`)."""
    import yaml
    from huggingface_hub import ModelCard

    if _PLACEHOLDER_NAMESPACE not in card:
        return card
    try:
        name = ModelCard(card, ignore_metadata_errors=True).data.model_name
    except (ValueError, yaml.YAMLError):  # a README that is no card
        return card
    return card.replace(f"{_PLACEHOLDER_NAMESPACE}/{name}", repo_id) if isinstance(name, str) and name else card


def save_artifact(
    output_dir: str | Path, kind: str, base_model: str, *, model=None, tokenizer=None, files=(), drafter=None, **card
):
    """Saves an artifact in the Hub's layout with its model card.

    The files are added to what `output_dir` already holds (same names are replaced). They are first written to a
    hidden directory inside it and moved in only when all of them are written ([`staged_files`]), so a failed save
    leaves `output_dir` as it was (and removes it if it created it); the card is written last.

    Args:
        output_dir (`str` or `Path`): the directory to write.
        kind (`str`): see [`write_model_card`].
        base_model (`str`): see [`write_model_card`]. A PEFT model's saved `adapter_config.json` names it too (as a
            Hub id), so that `AutoPeftModelForCausalLM.from_pretrained` finds the base on another machine.
        model (*optional*): anything with `save_pretrained(dir)` (a model, a `PeftModel`, a drafter adapter); remote
            code named by its config's `auto_map` is copied in (not for a `PeftModel`: its base has that code).
        tokenizer (*optional*): saved beside the model.
        files (`list`, *optional*): extra files to copy in (an index, a plot, a JSON report).
        drafter (`str`, *optional*): the registered drafter name (`ngram`, ...) of a drafter artifact: writes
            `custom_generate/` ([`write_custom_generate`]) so that `model.generate(custom_generate=<repository>,
            trust_remote_code=True)` drafts with it.
        card: the other keyword arguments of [`write_model_card`].

    Returns:
        `Path`: the artifact directory.
    """
    from .atomic import staged_files

    if model is not None and not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(
            f"model must have save_pretrained(dir) (a PreTrainedModel, a PeftModel, a huggingface_hub "
            f"PyTorchModelHubMixin module); a {type(model).__name__} has none"
        )
    base_model = hub_base_model(base_model)
    # The card is written last, once the files are in: its arguments (kind, image, evaluation results, the keywords
    # themselves) are checked first, by rendering it where nothing is kept, so that a bad one leaves no new files
    # beside the old card.
    with tempfile.TemporaryDirectory() as scratch:
        write_model_card(scratch, kind, base_model, **card)
    with staged_files(output_dir) as tmp:
        if model is not None:
            _save_model(model, tmp, base_model)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for file in files:
            shutil.copy(file, tmp / Path(file).name)
        if drafter is not None:
            write_custom_generate(tmp, drafter, str(Path(output_dir).resolve()))
    output_dir = Path(output_dir)
    write_model_card(output_dir, kind, base_model, **card)
    return output_dir


def _connection_errors() -> tuple[type[BaseException], ...]:
    """The exception types meaning "the Hub cannot be reached" (huggingface_hub's HTTP backend varies by version)."""
    import importlib

    from huggingface_hub.errors import OfflineModeIsEnabled

    errors = [OSError, OfflineModeIsEnabled]
    for module_name, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)), ("requests", ())):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        errors += [getattr(module, n) for n in names if hasattr(module, n)]
    return tuple(errors)


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    ignore_patterns=DEFAULT_IGNORE_PATTERNS,
) -> str:
    """Creates (if needed) the model repository `repo_id` and uploads `folder` to it, in one commit (a drafter's
    `custom_generate/generate.py`, see [`write_custom_generate`], and a card saved without `repo_id` are published
    naming the repository). Weight files already in the repository that `folder` does not have, in the folders it
    writes to, are deleted in the same commit ([`stale_weight_files`]), so that a re-push never leaves an earlier
    checkpoint's weights beside the new ones.

    Args:
        folder (`str` or `Path`): an artifact directory (see [`save_artifact`]).
        repo_id (`str`): `ORG/NAME` or `NAME` (in the token owner's namespace).
        private (`bool`, *optional*, defaults to `False`): create the repository private.
        token (`str`, *optional*): a write token; defaults to the saved/`HF_TOKEN` one (`huggingface_hub.get_token`).
        commit_message (`str`, *optional*): the commit message.
        ignore_patterns (*optional*): files not uploaded (`fnmatch` patterns on paths in `folder`); defaults to
            `DEFAULT_IGNORE_PATTERNS`: Trainer checkpoints and logs, a `.git/` folder, staging folders and hidden
            `.*.tmp` / `.*.incomplete` / `.*.lock` files.

    Returns:
        `str`: the repository URL.

    Raises:
        `HubError`: no card, a PEFT adapter naming its base by a local path, no token, the Hub unreachable (or
            `HF_HUB_OFFLINE=1`), or the Hub refusing the upload.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"not a directory: {folder}")
    if not (folder / "README.md").is_file():
        raise HubError(f"{folder} has no README.md model card: save it with hf_accel.hub.save_artifact first")
    _check_adapter_bases(folder, _artifact_files(folder, ignore_patterns))
    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: run `hf auth login` or set HF_TOKEN to a token with write access")
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        operations = [
            CommitOperationAdd(path.relative_to(folder).as_posix(), _published_bytes(path, folder, url.repo_id))
            for path in _artifact_files(folder, ignore_patterns)
        ]
        stale = stale_weight_files(
            api.list_repo_files(url.repo_id, repo_type="model"), [op.path_in_repo for op in operations]
        )
        operations += [CommitOperationDelete(name) for name in stale]
        api.create_commit(url.repo_id, operations, commit_message=commit_message or f"Upload {folder.name}")
    except HfHubHTTPError as err:  # before OSError: it is one
        raise HubError(f"the Hub refused the push to {repo_id}: {str(err).splitlines()[0]}") from err
    except _connection_errors() as err:
        raise HubError(
            f"cannot reach the Hugging Face Hub to push {repo_id} ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "check the network and that HF_HUB_OFFLINE is not set"
        ) from err
    return str(url)


def stale_weight_files(repo_files, uploaded) -> list[str]:
    """The weight files of `repo_files` that a push of `uploaded` (paths in the repository) makes stale: those in a
    folder the push writes to (the root, `adapter/`) that it does not write. Weight files in folders the artifact has
    no file in (a Trainer's pushed `checkpoint-N/`, a user's own subfolder) are not the artifact's and stay."""
    uploaded = set(uploaded)
    folders = {posixpath.dirname(name) for name in uploaded}
    return [
        name
        for name in repo_files
        if name not in uploaded
        and posixpath.dirname(name) in folders
        and any(fnmatch.fnmatch(posixpath.basename(name), pattern) for pattern in WEIGHT_PATTERNS)
    ]


def _check_adapter_bases(folder: Path, files) -> None:
    """Refuses, in one line, to publish a PEFT adapter whose `adapter_config.json` names its base model by a local path
    (as `PeftModel.save_pretrained` writes it for a base loaded from a directory, in its card too): the repository
    would name a directory of this machine, and `AutoPeftModelForCausalLM.from_pretrained` would find no base
    elsewhere. `None` (no base named, as `train heal` writes for a local student) is published as it is."""
    from .loading import looks_like_local_path

    for path in files:
        if path.name != "adapter_config.json":
            continue
        try:
            base = json.loads(path.read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (ValueError, AttributeError):  # not a PEFT config: published as it is
            continue
        if isinstance(base, str) and looks_like_local_path(base):
            raise HubError(
                f"{path.relative_to(folder).as_posix()} names its base model by the local path {base!r}, which "
                "would be published: save the adapter with hf_accel.hub.save_artifact(DIR, 'lora-adapter', "
                "'ORG/BASE', model=peft_model), which names the base's Hub id in it and in the card"
            )


def _artifact_files(folder: Path, ignore_patterns) -> list[Path]:
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if not any(fnmatch.fnmatch(rel, pattern) for pattern in ignore_patterns):
            files.append(path)
    return files


def _read(data: bytes | Path) -> bytes:
    return data if isinstance(data, bytes) else data.read_bytes()


def populate_hub_cache(
    folder: str | Path,
    repo_id: str,
    cache_dir: str | Path | None = None,
    revision: str = "main",
    commit_hash: str | None = None,
    ignore_patterns=DEFAULT_IGNORE_PATTERNS,
) -> Path:
    """Writes `folder` into a Hugging Face cache as if `repo_id` had been downloaded from the Hub (published as
    [`push_to_hub`] would: a drafter's `custom_generate/generate.py`, and a card saved without a repo id, name
    `repo_id`).

    Layout (the Hub client's): `models--ORG--NAME/blobs/<sha256>` holds each file's bytes,
    `snapshots/<commit>/<path>` links to its blob (a copy where symlinks are not allowed), and `refs/<revision>`
    holds the commit hash. Afterwards, with `HF_HUB_OFFLINE=1` and `HF_HUB_CACHE` (or `HF_HOME`) pointing at the
    cache, `AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True)` loads the artifact: the way to
    prepare a machine without network.

    Args:
        folder (`str` or `Path`): an artifact directory.
        repo_id (`str`): `ORG/NAME`.
        cache_dir (`str` or `Path`, *optional*): the hub cache; defaults to `huggingface_hub.constants.HF_HUB_CACHE`.
        revision (`str`, *optional*, defaults to `"main"`): the ref to point at the snapshot.
        commit_hash (`str`, *optional*): 40 hex digits; defaults to a hash of the files' names and contents. A
            snapshot already under it is made to hold exactly the folder's files.
        ignore_patterns (*optional*): files left out, as for [`push_to_hub`].

    Returns:
        `Path`: the snapshot directory.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from .atomic import replace_atomically

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"not a directory: {folder}")
    try:
        validate_repo_id(repo_id)
        valid = repo_id.count("/") == 1
    except HFValidationError:
        valid = False
    if not valid:
        raise ValueError(f"repo_id must be ORG/NAME (letters, digits, '-', '_', '.'), got {repo_id!r}")
    files = _artifact_files(folder, ignore_patterns)
    _check_adapter_bases(folder, files)
    published = {path: _published_bytes(path, folder, repo_id) for path in files}  # a path, or edited bytes
    digests = {path: hashlib.sha256(_read(data)).hexdigest() for path, data in published.items()}
    if commit_hash is None:
        commit = hashlib.sha1()
        for path in files:
            commit.update(f"{path.relative_to(folder).as_posix()}\0{digests[path]}\n".encode())
        commit_hash = commit.hexdigest()
    repo = Path(cache_dir or constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit_hash
    # a snapshot written before under the same (given) commit: files the folder no longer has must not be loaded
    _remove_other_files(snapshot, [path.relative_to(folder).as_posix() for path in files])
    for path in files:
        blob = repo / "blobs" / digests[path]
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():  # written under another name first: a blob cut short would be kept by every rerun
            replace_atomically(blob, Path.write_bytes, _read(published[path]))
        target = snapshot / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(target, _link_or_copy, blob)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    replace_atomically(repo / "refs" / revision, Path.write_text, commit_hash)
    return snapshot


def _link_or_copy(target: Path, blob: Path) -> None:
    try:
        target.symlink_to(os.path.relpath(blob, target.parent))
    except OSError:  # no symlinks (Windows without developer mode): the Hub client copies too
        shutil.copyfile(blob, target)


def _remove_other_files(snapshot: Path, names: list[str]) -> None:
    """Removes from `snapshot` every file that is not one of `names` (paths relative to it) and every folder that holds
    none of them, as a download of the commit would not have them (a stale `model.safetensors` beside new shards would
    be loaded first)."""
    keep, folders = set(names), set()
    for name in keep:  # every folder above a kept file
        folder = posixpath.dirname(name)
        while folder:
            folders.add(folder)
            folder = posixpath.dirname(folder)
    if not snapshot.is_dir():
        return
    for path in sorted(snapshot.rglob("*"), reverse=True):  # a folder's files before the folder
        rel = path.relative_to(snapshot).as_posix()
        if path.is_dir() and not path.is_symlink():
            if rel not in folders:
                shutil.rmtree(path, ignore_errors=True)
        elif rel not in keep and not path.name.endswith(".incomplete"):  # not another process's file being written
            path.unlink(missing_ok=True)


def add_cli(commands) -> None:
    push = commands.add_parser("push", help="upload an artifact directory to the Hugging Face Hub")
    push.add_argument("dir", help="the artifact directory (with its README.md model card)")
    push.add_argument(
        "--repo-id", required=True, help="ORG/NAME, or NAME under your account (an upload; --to-cache needs ORG/NAME)"
    )
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--token", default=None, help="a write token (default: the saved one or $HF_TOKEN)")
    push.add_argument("--message", default=None, help="the commit message")
    push.add_argument(
        "--to-cache",
        metavar="CACHE_DIR",
        default=None,
        help="write into a local Hugging Face cache in the Hub's layout instead of uploading (offline machines)",
    )
    push.set_defaults(func=_run_push)


def _run_push(args) -> int:
    if args.to_cache is not None:
        cache = Path(args.to_cache).expanduser().resolve()  # the setting printed works from any directory
        snapshot = populate_hub_cache(args.dir, args.repo_id, cache_dir=cache)
        print(f"wrote {snapshot}; load with HF_HUB_CACHE={shlex.quote(str(cache))} HF_HUB_OFFLINE=1")
        return 0
    url = push_to_hub(args.dir, args.repo_id, private=args.private, token=args.token, commit_message=args.message)
    print(f"pushed {args.dir} to {url}")
    return 0
