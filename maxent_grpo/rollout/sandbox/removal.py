"""The removal of what a sandboxed call leaves where the host would keep it (the shared
world-writable folders, SysV objects, the call's working folder), for
:mod:`maxent_grpo.rollout.sandbox.call`, which loads this file by its path. Every step goes
through a folder's descriptor (``O_NOFOLLOW``, ``dir_fd=``), never a path or ``..``, so a
link or a folder moved mid-way by another call leads nowhere. Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat

_libc = ctypes.CDLL(None, use_errno=True)


def leftovers(uid: int, tops: tuple[str, ...] | list[str], ipc: bool) -> None:
    """Remove what ``uid`` owns in the world-writable folders at and below ``tops`` (the only
    folders it could write), and, with ``ipc``, its SysV objects. Every step goes through
    a folder's descriptor (``O_NOFOLLOW``, ``dir_fd=``), never a path, so a
    link swapped in mid-way by another call leads nowhere."""
    pending: list[int] = []
    for top in sorted({os.path.realpath(t) for t in tops}):
        try:
            pending.append(os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
        except OSError:
            continue
    while pending:
        fd = pending.pop()
        try:
            entries = list(os.scandir(fd)) if os.fstat(fd).st_mode & 0o002 else []
        except OSError:
            entries = []
        for entry in entries:
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == uid and stat.S_ISDIR(info.st_mode):
                    _remove_at(entry.name, fd)
                elif info.st_uid == uid:
                    os.unlink(entry.name, dir_fd=fd)
                elif stat.S_ISDIR(info.st_mode):
                    pending.append(os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY
                                           | os.O_NOFOLLOW, dir_fd=fd))
        os.close(fd)
    for kind, call in (("shm", "shmctl"), ("msg", "msgctl"), ("sem", "semctl")) if ipc else ():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                head, *rows = [line.split() for line in f]
            for row in rows:
                if int(row[head.index("uid")]) == uid:
                    getattr(_libc, call)(int(row[1]), 0, None)  # IPC_RMID
        except (OSError, ValueError, IndexError):
            continue


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
#: folders held open at once while removing a tree; deeper ones are moved up (by descriptor)
_HELD = 256


def _enter(name: str, dir_fd: int) -> int:
    """The folder ``name`` of ``dir_fd`` opened, never through a link; a uid that is not
    root first makes a folder of its own it cannot read searchable (root reads any)."""
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except PermissionError:
        if os.geteuid() == 0:
            raise
        os.chmod(name, 0o700, dir_fd=dir_fd)  # (a link: its own files only, as this uid)
        return os.open(name, _DIR, dir_fd=dir_fd)


def _remove_at(name: str, dir_fd: int) -> None:
    """Remove the folder ``name`` of the folder open as ``dir_fd`` and all it holds, never
    following a link and never raising: every step through a folder's descriptor, none by
    a path or by ``..``, and without recursion (a tree nested past the stack or the path
    limit goes too: below :data:`_HELD` levels its folders are moved up to the top by
    descriptor). What cannot be removed is left."""
    try:
        top = _enter(name, dir_fd)
    except OSError:
        return
    held, skip, names, lifted = [top], [set()], [], 0
    try:
        while held:
            fd, child = held[-1], None
            try:
                entries = list(os.scandir(fd))
            except OSError:
                entries = []
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if entry.name not in skip[-1]:
                            child = entry.name
                            break
                        continue
                    try:
                        os.unlink(entry.name, dir_fd=fd)
                    except PermissionError:  # a folder the call left read-only: its owner's
                        os.fchmod(fd, 0o700)
                        os.unlink(entry.name, dir_fd=fd)
                except OSError:
                    continue
            if child is not None and len(held) >= _HELD:
                lifted += 1
                try:
                    os.rename(child, f".removed-{os.getpid()}-{lifted}", src_dir_fd=fd,
                              dst_dir_fd=top)
                except OSError:
                    skip[-1].add(child)
            elif child is not None:
                try:
                    held.append(_enter(child, fd))
                    skip.append(set())
                    names.append(child)
                except OSError:
                    skip[-1].add(child)
            elif len(held) == 1:
                break
            else:
                os.close(held.pop())
                skip.pop()
                gone = names.pop()
                try:
                    os.rmdir(gone, dir_fd=held[-1])
                except OSError:
                    skip[-1].add(gone)
    finally:
        for fd in held:
            os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=dir_fd)


def remove_tree(path: str) -> None:
    """Remove ``path`` whatever modes the call left on it and however deep it is, never
    following a link and never raising (:func:`_remove_at` from its parent folder)."""
    try:
        path = os.path.abspath(path)
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return
        parent = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            _remove_at(os.path.basename(path), parent)
        finally:
            os.close(parent)
    except Exception:  # noqa: BLE001 - a cleanup never stops the supervisor
        pass
