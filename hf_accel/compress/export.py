"""Finishing and writing converted checkpoints: loading the converted weights, atomic output directories, copied
remote code, rank reports and model cards.

Shared by the CARE and Palu converters. A checkpoint is written to a temporary sibling directory and renamed into
place at the end, so a failure never leaves a half-written output directory.
"""

import glob
import json
import os
import shutil
import socket
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch


MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
_WINDOWS = os.name == "nt"


def card_base_model(name: str) -> str:
    """The Hub id a converted checkpoint's model card names as its base model (`--base-model`, else `--model`)."""
    from ..hub import hub_base_model

    try:
        return hub_base_model(name)
    except ValueError:
        raise ValueError(
            f"the model card needs the Hub id of the original model, not {name!r}; pass --base-model ORG/NAME"
        ) from None


# RoPE whose frequencies change with the sequence length at run time: CARE and Palu models RoPE cached keys at
# attention time with the current frequencies, the original keeps each key as rotated when it was cached, so the two
# would drift apart past the trained length.
RUNTIME_ROPE_TYPES = ("dynamic", "longrope")


def check_rope_type(config, converter: str) -> None:
    """Refuses, in one line, a model whose RoPE frequencies change at run time ([`RUNTIME_ROPE_TYPES`])."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in RUNTIME_ROPE_TYPES:
        raise ValueError(f"{converter} does not support rope_type {rope_type!r} (frequencies that change at run time)")


def check_no_adapters(model, converter: str) -> None:
    """Refuses, in one line, a model with PEFT adapters loaded (a `PeftModel`, or adapters added to a transformers
    model, as `from_pretrained` of an adapter directory does): the converters factorize the base `k_proj`/`v_proj`
    weights and copy every other weight by name, so the adapters' deltas would be lost, and their modules' weights do
    not fit the converted model."""
    if getattr(model, "peft_config", None):
        raise ValueError(
            f"{converter} converts plain weights, and this model has PEFT adapters loaded: merge them first "
            "(merge_and_unload() of a PeftModel, then save) and convert the merged model"
        )


def check_source_model(name: str, path: str) -> None:
    """Refuses, in one line, a directory that holds no model, and a checkpoint that is already converted (it ships its
    own modeling code)."""
    from ..loading import check_model_dir, remote_code_model_type

    check_model_dir(name, path)
    model_type = remote_code_model_type(path)
    if model_type:
        raise ValueError(
            f"model {name!r} is already a converted checkpoint ({model_type}): convert the original model"
        )


def uninitialized_model(model_class, config, dtype):
    """`model_class` built from `config` in `dtype` with its parameters on the meta device: [`load_converted_state`]
    then assigns every one of them (strictly). Allocating and initialising weights that are overwritten cost a second
    copy of the model at peak (2.9 GB above a 2.1 GB source) and 23 s at 1B shapes. Buffers computed at construction
    (RoPE frequencies) are made as usual."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return model_class._from_config(config, dtype=dtype)


def as_converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as [`load_converted_state`] loads it: in `dtype`, contiguous (the same tensor when it already is). The
    builders convert each layer's float64 results as they make them: kept in float64 until the load, every layer's
    were held together with their converted copies, three times the converted weights of a float32 model (five of a
    16-bit one)."""
    return tensor.to(dtype, memory_format=torch.contiguous_format)


def load_converted_state(converted, state: dict, source, converter: str):
    """Assigns `state` to the parameters of `converted` (built by [`uninitialized_model`]) in the dtype of `source`,
    refusing non-finite values, and gives it `source`'s generation config (its EOS ids and sampling defaults live
    there, not in `config.json`).

    Weights the conversion leaves as they are (embeddings, MLPs, norms, query projections) are `source`'s own
    tensors, not copies, when `source` is on one device in one dtype: a conversion holds the source model plus the
    new attention weights. Training the converted model in the same process therefore changes `source` too; convert
    a `copy.deepcopy` of it to keep both.

    Returns:
        `converted`, on `source`'s device, in eval mode.
    """
    import copy

    dtype = next(source.parameters()).dtype
    state = {k: as_converted(v, dtype) for k, v in state.items()}
    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(
                f"{converter} conversion produced non-finite values in {name}; try a larger shrinkage alpha"
            )
    converted.load_state_dict(state, strict=True, assign=True)
    converted.tie_weights()  # assigned, the tied output and input embeddings are two parameters again
    converted.generation_config = copy.deepcopy(source.generation_config)
    return converted.to(next(source.parameters()).device).eval()


def check_output_path(out_dir: str | os.PathLike, option: str = "--out") -> Path:
    """The resolved output directory, or `ValueError` if it is a file or lies under one (it may exist)."""
    out = Path(out_dir).expanduser().resolve()
    existing = next(p for p in (out, *out.parents) if p.exists())  # `out`, or the directory it would be made in
    if existing == out and not out.is_dir():
        raise ValueError(f"{option} {out} is an existing file, not a directory")
    if not existing.is_dir():
        raise ValueError(f"{option} {out} cannot be created: {existing} is an existing file")
    return out


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool = False, option: str = "--out") -> Path:
    """The resolved directory a converted checkpoint will replace as a whole, or `ValueError` if it is a file, or a
    non-empty directory without `overwrite`, or (even with it) one that holds no checkpoint: `--out .` or a project
    folder would lose every file (the converters call it before loading the model, so that a bad `--out` fails in a
    second)."""
    out = check_output_path(out_dir, option)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"output directory {out} exists and is not empty; pass --overwrite or another {option}")
        if not _is_checkpoint(out):
            raise ValueError(
                f"--overwrite replaces a checkpoint, and {out} holds none (a config.json with a model_type, and "
                f"weights): its files would be deleted; choose another {option}"
            )
    return out


def _is_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a transformers checkpoint: a `config.json` naming a `model_type`, and weights."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    has_weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    return isinstance(config, dict) and "model_type" in config and has_weights


def replace_atomically(target: Path, write, *args) -> None:
    """`write(partial, *args)` at a name of this process's own beside `target`, then renamed over it: a process
    writing the same cache at once, or a reader, never finds `target` missing or half-written."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.incomplete")
    partial.unlink(missing_ok=True)
    try:
        write(partial, *args)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def give_usual_permissions(path: Path) -> None:
    """Gives `path`, and everything under it if it is a directory, the permissions that the umask gives new files
    and directories. `mkdtemp` makes a folder private (0700), and safetensors 0.8 writes weights 0600 whatever the
    umask (huggingface/safetensors#782): a checkpoint made in a shared folder was readable by its owner only."""
    umask = os.umask(0)
    os.umask(umask)
    for entry in [path, *(path.rglob("*") if path.is_dir() and not path.is_symlink() else ())]:
        if not entry.is_symlink():  # directories and the owner's executables (a script) stay executable
            executable = entry.is_dir() or entry.stat().st_mode & stat.S_IXUSR
            entry.chmod((0o777 if executable else 0o666) & ~umask)


@contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, overwrite: bool = False):
    """Yields a temporary directory that becomes `out_dir` when the block succeeds (and is deleted if it fails).

    The directory's name carries this process's id and host, so a later call for the same `out_dir` removes the ones
    killed processes left (no `except` runs on SIGKILL or the OOM killer, and they hold a whole checkpoint's weights);
    the same holds for the earlier checkpoint set aside during the swap. The swap holds a lock on the parent
    directory, so two processes finishing at once replace `out_dir` one after the other.

    Raises:
        `ValueError` from [`check_output_dir`].
    """
    out = check_output_dir(out_dir, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    host = _host_name()
    for kind in ("tmp", "old"):
        _remove_dead_scratch(out.parent, f".{out.name}-{kind}-", host)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-tmp-{os.getpid()}@{host}-", dir=out.parent))
    try:
        yield tmp
        give_usual_permissions(tmp)
        with _directory_lock(out.parent):
            old = None
            if out.exists():
                old = out.parent / f".{out.name}-old-{os.getpid()}@{host}"
                os.replace(out, old)
            os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def _directory_lock(directory: Path):
    """An exclusive `flock` on `directory` itself for the block: no lock file is left in an artifact's folder. Where
    the platform or filesystem has no `flock` (Windows, some network mounts), the block runs unlocked."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_dead_scratch(folder: Path, prefix: str, host: str, older_names: bool = False) -> None:
    """Removes the `{prefix}{pid}@{host}...` entries of `folder` whose process is gone from this machine (a normal
    exit always removes its own; SIGKILL and the OOM killer leave them). `older_names`: also those named before the
    host was added (`{prefix}{pid}-...`)."""
    for stale in folder.glob(glob.escape(prefix) + "*"):
        pid, other_host = _scratch_owner(stale.name, prefix)
        if (other_host == host or (older_names and other_host == "")) and not _process_alive(pid):
            shutil.rmtree(stale, ignore_errors=True)


def _host_name() -> str:
    """This machine's name as scratch directories carry it (`-`, their field separator, replaced)."""
    return socket.gethostname().replace("-", "_")


def _scratch_owner(name: str, prefix: str) -> tuple[str, str]:
    """`(pid, host)` of a scratch directory named `{prefix}{pid}@{host}[-...]` (`host` is empty in older names)."""
    pid, _, host = name.removeprefix(prefix).partition("-")[0].partition("@")
    return pid, host


def _process_alive(pid: str) -> bool:
    """Whether the process `pid` (from a staging directory's name: `.staging-<pid>@<host>-...`; not a number: none)
    is running on this machine. On Windows `os.kill(pid, 0)` is no probe: signal 0 is `CTRL_C_EVENT`, sent to the
    console's processes (this one included), and a gone process raises `OSError` (WinError 87); psutil asks the
    system instead."""
    if not pid.isdigit():
        return False
    if _WINDOWS:
        import psutil

        return psutil.pid_exists(int(pid))
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


@contextmanager
def staged_files(out_dir: str | os.PathLike, last: tuple[str, ...] = ()):
    """Yields a scratch directory inside `out_dir` (created if needed); when the block succeeds, its entries replace
    the entries of the same names in `out_dir`, whose other files stay (an index beside its self-distillation cache,
    an artifact added to a directory).

    Entries named in `last` are removed from `out_dir` before anything moves and moved in after everything else, so
    an interrupted swap leaves no `last` file beside a mix of old and new ones (an index's header); the swap holds a
    lock on `out_dir`, so two processes swapping into it at once do so one after the other. Staging inside
    `out_dir` keeps every move on its filesystem (it may be a mount point or a link elsewhere). On failure the scratch
    directory, and the directories this call created for `out_dir` while they are still empty, are removed.

    Raises:
        `ValueError` from [`check_output_path`] when `out_dir` is a file.
    """
    out = check_output_path(out_dir)
    created = [d for d in (out, *out.parents) if not d.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    host = _host_name()
    _remove_dead_scratch(out, ".staging-", host, older_names=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".staging-{os.getpid()}@{host}-", dir=out))
    try:
        yield tmp
        for entry in tmp.iterdir():
            give_usual_permissions(entry)
        with _directory_lock(out):  # two builds swapping at once would leave one's header beside the other's data
            for name in last:
                (out / name).unlink(missing_ok=True)
            staged = sorted(p.name for p in tmp.iterdir())
            for name in [n for n in staged if n not in last] + [n for n in last if n in staged]:
                target = out / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                os.replace(tmp / name, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for directory in created:
            if any(directory.iterdir()):
                break
            directory.rmdir()
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def copy_remote_code(out_dir: Path, names: list[str]) -> None:
    """Copies `hf_accel/models/<name>` files (configuration/modeling code) next to the weights, as new files (the
    umask's permissions, not those of a read-only install, which a later `save_pretrained` into it could not
    overwrite)."""
    for name in names:
        shutil.copyfile(MODELS_DIR / name, Path(out_dir) / name)


def write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def plot_ranks(path: Path, k_ranks: list[int], v_ranks: list[int], width: int, title: str) -> None:
    """Saves a PNG of the per-layer K and V ranks."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    layers = range(len(k_ranks))
    ax.plot(layers, k_ranks, marker="o", label="K rank")
    ax.plot(layers, v_ranks, marker="s", label="V rank")
    ax.axhline(width, color="grey", linestyle=":", label=f"full width ({width})")
    ax.set_xlabel("layer")
    ax.set_ylabel("latent rank")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
