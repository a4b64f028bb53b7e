"""Atomic writes: outputs that an interruption, a killed process or a second writer never leaves half-written.

- [`atomic_output_dir`]: a directory written whole in a temporary sibling and renamed into place (a converted
  checkpoint), after [`check_output_dir`] refused a file or a non-empty folder that holds no checkpoint;
- [`staged_files`]: entries staged inside a directory and moved into it together, some of them last (an index's
  header), the directory's other files kept (an index beside its self-distillation cache);
- [`replace_atomically`]: one file written under a name of this process's own and renamed over its target;
- [`give_usual_permissions`]: the umask's permissions for what `mkdtemp` and safetensors make private.

Scratch entries carry their process's id and host, so a later write removes the ones killed processes left.
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


_WINDOWS = os.name == "nt"


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
    writing the same cache at once, or a reader, never finds `target` missing or half-written. The partial files that
    killed writers left beside `target` (SIGKILL, the OOM killer: a Hub-layout cache's blob can be a whole model's
    weights) are removed first; another running writer's is kept."""
    host = _host_name()
    _remove_dead_scratch(target.parent, f".{target.name}-", host)
    partial = target.with_name(f".{target.name}-{os.getpid()}@{host}-write.incomplete")
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
    """Removes the `{prefix}{pid}@{host}...` entries of `folder` (directories or files) whose process is gone from
    this machine (a normal exit always removes its own; SIGKILL and the OOM killer leave them). `older_names`: also
    those named before the host was added (`{prefix}{pid}-...`). The scratch of `blob-x` beside that of `blob` parses
    as pid `x` of no host, so it stays unless `older_names`."""
    for stale in folder.glob(glob.escape(prefix) + "*"):
        pid, other_host = _scratch_owner(stale.name, prefix)
        if (other_host == host or (older_names and other_host == "")) and not _process_alive(pid):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


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
