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
                    _remove_at(entry.name, fd, uid)
                elif info.st_uid == uid:
                    os.unlink(entry.name, dir_fd=fd)
                elif stat.S_ISDIR(info.st_mode) and info.st_mode & 0o002:  # one it could
                    pending.append(os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY  # write
                                           | os.O_NOFOLLOW, dir_fd=fd))  # (bounded: no fd each)
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


def _enter(name: str, dir_fd: int, owner: int | None) -> int:
    """The folder ``name`` of ``dir_fd`` opened, never through a link; OSError for one
    that is not ``owner``'s (a folder another uid moved in). A uid that is not root makes
    each folder it enters writable and searchable (0o700), as its owner may: one it cannot
    read is changed through an ``O_PATH`` descriptor (never a link's target)."""
    root = os.geteuid() == 0
    try:
        fd = os.open(name, _DIR, dir_fd=dir_fd)
    except PermissionError:
        if root:
            raise
        path = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{path}", 0o700)  # the folder itself, as opened
        finally:
            os.close(path)
        fd = os.open(name, _DIR, dir_fd=dir_fd)
    try:
        if owner is not None and os.fstat(fd).st_uid != owner:
            raise PermissionError(f"{name!r} is not uid {owner}'s")
        if not root:
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _listing(fd: int) -> list[os.DirEntry]:
    with contextlib.suppress(OSError):
        return list(os.scandir(fd))
    return []


def _remove_at(name: str, dir_fd: int, owner: int | None = None) -> None:
    """Remove the folder ``name`` of the folder open as ``dir_fd`` and all it holds (with
    ``owner``, only folders of that uid), never following a link and never raising: every
    step through a folder's descriptor, none by a path or by ``..``; without recursion (a
    tree nested past the stack or the path limit goes too: below :data:`_HELD` levels its
    folders are moved up to the top, by descriptor, under names no call can guess), each
    folder listed once (the top again for what was moved up). What cannot be removed is
    left."""
    try:
        top = _enter(name, dir_fd, owner)
    except OSError:
        return
    held, todo, names, kept = [top], [_listing(top)], [], set()  # kept: the top's, left
    try:
        while held:
            fd = held[-1]
            if not todo[-1] and len(held) == 1:  # the top: what was moved up since, if any
                todo[-1] = [e for e in _listing(top) if e.name not in kept]
                if not todo[-1]:
                    break
            elif not todo[-1]:
                os.close(held.pop())
                todo.pop()
                gone = names.pop()
                try:
                    os.rmdir(gone, dir_fd=held[-1])
                except OSError:
                    if len(held) == 1:
                        kept.add(gone)
                continue
            entry = todo[-1].pop()
            try:
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.name, dir_fd=fd)
                elif len(held) >= _HELD:  # its folder writable (its own ..), then to the top
                    os.close(_enter(entry.name, fd, owner))
                    os.rename(entry.name, f".removed-{os.urandom(12).hex()}", src_dir_fd=fd,
                              dst_dir_fd=top)
                else:
                    held.append(_enter(entry.name, fd, owner))
                    todo.append(_listing(held[-1]))
                    names.append(entry.name)
            except OSError:
                if len(held) == 1:
                    kept.add(entry.name)
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
