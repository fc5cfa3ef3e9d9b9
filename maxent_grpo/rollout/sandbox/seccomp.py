"""The sandbox's system-call filter: a seccomp program, installed in the call's process
just before the code runs (and inherited by everything it starts), that refuses the system
calls sandboxed code has no use for and that reach kernel code an unprivileged process
otherwise cannot.

Refused with ``EPERM``: new namespaces (``unshare``, whatever its flags, ``setns``,
``clone`` with any ``CLONE_NEW*`` flag), mounts of every kind (``mount``, ``umount2``,
``pivot_root``, ``chroot``, the new mount API: ``open_tree`` ... ``mount_setattr``),
reaching into other processes (``ptrace``, ``process_vm_readv``/``writev``,
``pidfd_getfd``, ``kcmp``, ``process_madvise``; ``/proc/<pid>/mem`` stays open to the
same uid, which matters only for a plain user without a user namespace), ``bpf``,
``perf_event_open``, ``userfaultfd``, ``io_uring``, the kernel keyring (``add_key``,
``request_key``, ``keyctl``), file handles (``name_to_handle_at``, ``open_by_handle_at``),
kernel modules, ``kexec``, swap, ``reboot``, ``acct`` and ``syslog``. ``clone3`` answers
``ENOSYS``, so that the C library falls back to ``clone``, whose flags the filter can read.
A system call of another architecture (32-bit ``int 0x80`` on x86-64) kills the process,
as do x32 calls. Everything else is allowed: threads, ``fork``, ``exec``, files, pipes.

Known for x86-64 and AArch64; elsewhere :func:`supported` is False and the protection is
reported absent (``Sandbox.protections["syscall_filter"]``).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

__all__ = ["REFUSED", "install", "program", "supported"]

PR_GET_SECCOMP, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_NO_NEW_PRIVS = 21, 22, 2, 38
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|.., BPF_RET|K
NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data (ARG0: its low 32 bits)
#: every CLONE_NEW* flag clone() takes (CLONE_NEWTIME shares its bit with the exit signal)
CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 \
    | 0x40000000

#: refused calls, in the order of the table above
REFUSED = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree",
           "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "ptrace",
           "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "userfaultfd",
           "io_uring_setup", "io_uring_enter", "io_uring_register", "add_key", "request_key",
           "keyctl", "name_to_handle_at", "open_by_handle_at", "init_module", "finit_module",
           "delete_module", "kexec_load", "kexec_file_load", "swapon", "swapoff", "reboot",
           "acct", "syslog", "pidfd_getfd", "kcmp", "process_madvise")

#: the calls added since Linux 5.1 (numbers 424 and up): one number on every architecture
_SHARED = dict(
    open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
    mount_setattr=442, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
    pidfd_getfd=438, process_madvise=440, clone3=435)
#: (audit architecture, numbers of the calls above + clone and clone3, x32 bit or None)
_TABLES = {
    "x86_64": (0xC000003E, _SHARED | dict(
        unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161,
        ptrace=101, process_vm_readv=310, process_vm_writev=311, bpf=321,
        perf_event_open=298, userfaultfd=323, add_key=248, request_key=249, keyctl=250,
        name_to_handle_at=303, open_by_handle_at=304, init_module=175, finit_module=313,
        delete_module=176, kexec_load=246, kexec_file_load=320, swapon=167, swapoff=168,
        reboot=169, acct=163, syslog=103, kcmp=312, clone=56), 0x40000000),
    "aarch64": (0xC00000B7, _SHARED | dict(
        unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51,
        ptrace=117, process_vm_readv=270, process_vm_writev=271, bpf=280,
        perf_event_open=241, userfaultfd=282, add_key=217, request_key=218, keyctl=219,
        name_to_handle_at=264, open_by_handle_at=265, init_module=105, finit_module=273,
        delete_module=106, kexec_load=104, kexec_file_load=294, swapon=224, swapoff=225,
        reboot=142, acct=89, syslog=116, kcmp=272, clone=220), None),
}


def _machine() -> str:
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                       platform.machine().lower())


def program(machine: str | None = None) -> list[tuple[int, int, int, int]]:
    """The filter as BPF instructions ``(code, jt, jf, k)`` for ``machine`` (this one's by
    default)."""
    arch, numbers, x32 = _TABLES[machine or _machine()]
    out = [(LD_ABS, 0, 0, ARCH), (JEQ, 1, 0, arch), (RET, 0, 0, RET_KILL_PROCESS),
           (LD_ABS, 0, 0, NR)]
    if x32 is not None:  # the x32 ABI's numbers carry this bit: not ours to allow
        out += [(JGE, 0, 1, x32), (RET, 0, 0, RET_KILL_PROCESS)]
    for name in REFUSED:
        out += [(JEQ, 0, 1, numbers[name]), (RET, 0, 0, RET_ERRNO | EPERM)]
    out += [(JEQ, 0, 1, numbers["clone3"]), (RET, 0, 0, RET_ERRNO | ENOSYS),
            # clone: refused when its flags (argument 0) ask for a new namespace
            (JEQ, 0, 4, numbers["clone"]), (LD_ABS, 0, 0, ARG0), (JSET, 0, 1, CLONE_NEW),
            (RET, 0, 0, RET_ERRNO | EPERM), (RET, 0, 0, RET_ALLOW),
            (RET, 0, 0, RET_ALLOW)]
    return out


def supported() -> bool:
    """Whether the filter installs here: the architecture is known and a forked child
    (with ``no_new_privs``, as a call has) installs it (a kernel without filters, or an
    outer profile that refuses ``PR_SET_SECCOMP``, says no)."""
    if _machine() not in _TABLES:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0) < 0:
        return False
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            os._exit(0 if install() else 1)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def install() -> bool:
    """Install the filter on this process (needs ``no_new_privs`` or CAP_SYS_ADMIN); False
    when the kernel refused it."""
    code = program()
    raw = b"".join(struct.pack("=HBBI", *ins) for ins in code)
    buffer = ctypes.create_string_buffer(raw, len(raw))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Program(len(code), ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0
