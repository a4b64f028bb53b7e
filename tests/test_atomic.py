import os
import socket
import threading

import pytest

from hf_accel.atomic import atomic_output_dir, staged_files


fcntl = pytest.importorskip("fcntl")


def _lock(directory):
    """Another process's lock on `directory`, as the swaps take it (an exclusive `flock` on the directory itself)."""
    fd = os.open(directory, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _visible(folder):
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


def _write_index(out):
    with staged_files(out, last=("header.json",)) as tmp:
        (tmp / "sa.bin").write_bytes(b"new")
        (tmp / "header.json").write_text("{}")


def _write_checkpoint(out):
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text('{"model_type": "llama"}')
        (tmp / "model.safetensors").write_bytes(b"new")


@pytest.mark.parametrize("write, locked", [(_write_index, "out"), (_write_checkpoint, "parent")])
def test_a_swap_waits_for_another_process_s_swap_into_the_same_directory(tmp_path, write, locked):
    """Two index builds swapping their files into one directory at once could leave one's header beside the other's
    suffix array (and it loads when the token counts agree); two conversions could both move the old checkpoint."""
    out = tmp_path / "artifact"
    out.mkdir()
    fd = _lock(out if locked == "out" else tmp_path)
    writer = threading.Thread(target=write, args=(out,))
    try:
        writer.start()
        writer.join(timeout=0.5)
        assert writer.is_alive() and _visible(out) == []  # written, waiting to swap
    finally:
        os.close(fd)
    writer.join(timeout=30)
    assert not writer.is_alive() and _visible(out) in (["header.json", "sa.bin"], ["config.json", "model.safetensors"])


def test_a_checkpoint_set_aside_by_a_killed_swap_is_removed_by_the_next_conversion(tmp_path):
    """Between its two renames a conversion holds the earlier checkpoint under a hidden name; killed there, it would
    leave a whole checkpoint behind for good."""
    host = socket.gethostname().replace("-", "_")
    dead = tmp_path / f".care-old-999999999@{host}"
    live = tmp_path / f".care-old-{os.getppid()}@{host}"  # a running process's swap (pytest's parent)
    for folder in (dead, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"old")
    _write_checkpoint(tmp_path / "care")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["care", live.name])


def test_on_windows_stale_scratch_is_found_without_signalling_any_process(tmp_path, monkeypatch):
    """Windows has no signal 0: `os.kill(pid, 0)` sends CTRL_C_EVENT to the console's processes, and for a process
    that is gone raises `OSError` (WinError 87), which failed every conversion beside a killed one's folder."""
    import psutil

    from hf_accel import atomic

    def windows_kill(pid, sig):
        signalled.append((pid, sig))
        raise OSError(22, "The parameter is incorrect")  # WinError 87, for a pid that is no console process group

    signalled = []
    monkeypatch.setattr(atomic, "_WINDOWS", True, raising=False)
    monkeypatch.setattr(os, "kill", windows_kill)
    monkeypatch.setattr(psutil, "pid_exists", lambda pid: pid in psutil.pids())  # the system's process list
    host = socket.gethostname().replace("-", "_")
    dead = tmp_path / f".care-old-999999999@{host}"
    live = tmp_path / f".care-old-{os.getppid()}@{host}"
    for folder in (dead, live):
        folder.mkdir()
    _write_checkpoint(tmp_path / "care")
    assert signalled == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["care", live.name])


@pytest.mark.parametrize("swap", ["atomic_output_dir", "staged_files"])
def test_swapped_in_files_get_the_umask_s_permissions_not_private_ones(tmp_path, swap):
    # safetensors 0.8 writes weights 0600 whatever the umask, and mkdtemp makes folders 0700: a checkpoint or an
    # index made in a shared folder was readable by its owner only
    import stat

    from safetensors.torch import save_file

    umask = os.umask(0o022)
    try:
        with (atomic_output_dir if swap == "atomic_output_dir" else staged_files)(tmp_path / "out") as tmp:
            save_file({"w": __import__("torch").zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "a.json").write_text("{}")
            (tmp / "sub" / "a.json").chmod(0o600)
            (tmp / "modeling_x.py").write_text("X = 1\n")
            (tmp / "modeling_x.py").chmod(0o444)  # copied with its mode from a read-only install
            (tmp / "run.sh").write_text("#!/bin/sh\n")
            (tmp / "run.sh").chmod(0o700)  # a script stays executable
    finally:
        os.umask(umask)
    out = tmp_path / "out"
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    expected = {".": 0o755, "model.safetensors": 0o644, "run.sh": 0o755, "sub": 0o755, "sub/a.json": 0o644}
    expected["modeling_x.py"] = 0o644
    assert modes == expected


@pytest.mark.parametrize("no_lock", ["no fcntl (Windows)", "flock refused (a network mount)"])
def test_a_swap_without_a_lock_still_swaps(tmp_path, monkeypatch, no_lock):
    import sys

    def refused(fd, operation):
        raise OSError(37, "No locks available")

    if no_lock.startswith("no fcntl"):
        monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` raises ImportError
    else:
        monkeypatch.setattr(fcntl, "flock", refused)
    _write_index(tmp_path / "index")
    _write_checkpoint(tmp_path / "care")
    assert _visible(tmp_path / "index") == ["header.json", "sa.bin"]
    assert _visible(tmp_path / "care") == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["care", "index"]  # no scratch left beside them
    assert sorted(os.listdir(tmp_path / "index")) == ["header.json", "sa.bin"]


def test_scratch_of_another_user_s_running_process_is_kept(tmp_path, monkeypatch):
    # os.kill(pid, 0) on another user's process raises PermissionError: it is running, its scratch is in use
    def not_yours(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    host = socket.gethostname().replace("-", "_")
    theirs = tmp_path / f".care-tmp-4242@{host}-abc"
    theirs.mkdir()
    monkeypatch.setattr(os, "kill", not_yours)
    _write_checkpoint(tmp_path / "care")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["care", theirs.name])


def test_a_failed_swap_keeps_the_directories_it_created_once_files_are_in_them(tmp_path, monkeypatch):
    # two entries moved in, the third refused (a full disk): the moved files stay, with the folders that hold them
    replace = os.replace

    def full_after_two(source, destination):
        if len(moved) == 2:
            raise OSError(28, "No space left on device")
        moved.append(os.path.basename(destination))
        return replace(source, destination)

    moved = []
    monkeypatch.setattr(os, "replace", full_after_two)
    out = tmp_path / "new" / "index"
    with pytest.raises(OSError, match="No space left"), staged_files(out, last=("header.json",)) as tmp:
        for name in ("a.bin", "b.bin", "header.json"):
            (tmp / name).write_bytes(b"x")
    assert sorted(os.listdir(out)) == ["a.bin", "b.bin"]  # no staging folder left, no header beside them


def test_links_in_a_swapped_directory_are_left_as_they_are(tmp_path):
    # chmod follows a link: a file elsewhere (a blob of another cache) changed mode, and a dangling link failed
    import stat

    elsewhere = tmp_path / "private.bin"
    elsewhere.write_bytes(b"x")
    elsewhere.chmod(0o600)
    with staged_files(tmp_path / "out") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "link.bin").symlink_to(elsewhere)
        (tmp / "sub" / "dangling.bin").symlink_to(tmp_path / "gone.bin")
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o600
    assert os.readlink(tmp_path / "out" / "sub" / "dangling.bin") == str(tmp_path / "gone.bin")


def test_replace_atomically_removes_the_partial_files_of_killed_writers_only(tmp_path):
    # SIGKILL between write and rename left `.NAME.<pid>.incomplete` for good (a Hub-layout cache's blob can be a
    # model's weights); another running writer's partial file must stay
    import subprocess
    import sys
    from pathlib import Path

    from hf_accel.atomic import _host_name, replace_atomically

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    host, target, pid = _host_name(), tmp_path / "blob", dead.stdout.strip()
    killed = tmp_path / f".blob-{pid}@{host}-write.incomplete"
    running = tmp_path / f".blob-{os.getppid()}@{host}-write.incomplete"
    elsewhere = tmp_path / f".blob-{pid}@another_host-write.incomplete"
    other_file = tmp_path / f".blobby-{pid}@{host}-write.incomplete"
    other_target = tmp_path / f".blob-x-{pid}@{host}-write.incomplete"  # the partial file of `blob-x`, not of `blob`
    for partial in (killed, running, elsewhere, other_file, other_target):
        partial.write_bytes(b"half")
    replace_atomically(target, Path.write_bytes, b"whole")
    assert target.read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (target, running, elsewhere, other_file, other_target)
    )
