"""The sandbox of model-written code (:mod:`maxent_grpo.rollout.sandbox`): a table of
hostile calls, each checked three ways: the trainer lives and reads a ToolResult of the
expected kind, no process of the call is left, and what the code tried did not happen.
Then the ``process`` isolation of ordinary tools, and the pool's own life cycle.

The time limits here only bound hangs: this runs on a loaded two-core machine."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from maxent_grpo.rollout import sandbox
from maxent_grpo.rollout.sandbox import UID_BASE, Sandbox, SandboxError
from maxent_grpo.rollout.toolcall import Toolbox, ToolCall, ToolResult

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the sandbox needs Linux")
SECRET = f"secret-{uuid.uuid4().hex}"


class Recording(Sandbox):
    """A sandbox that keeps the last call's result (its uid and session)."""

    last: sandbox.SandboxResult | None = None

    def run(self, code, timeout=None):
        self.last = super().run(code, timeout)
        return self.last

    def call(self, fn, arguments, timeout=None):
        self.last = super().call(fn, arguments, timeout)
        return self.last


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (real uid, session) of every process now."""
    found = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                session = int(f.read().rsplit(b")", 1)[1].split()[3])
            with open(f"/proc/{name}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, ValueError, IndexError, StopIteration):
            continue
        found[int(name)] = (uid, session)
    return found


def left_behind(result: sandbox.SandboxResult, within: float = 10.0) -> list[int]:
    """The processes of the call's uid or session still there after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        left = [pid for pid, (uid, session) in processes().items()
                if (result.uid is not None and uid == result.uid) or session == result.session]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def pool():
    """The shared sandbox of the ``python`` tool, recording; stopped (and checked) at the end."""
    with pytest.MonkeyPatch.context() as mp:
        recording = Recording(timeout=30.0, spares=1)
        mp.setattr(sandbox, "_shared", recording)
        yield recording
        zygote = recording.pid
        recording.close()
    assert zygote is None or not alive(zygote)


@pytest.fixture(scope="module")
def boxes():
    """``python`` with a 1 s limit (for the calls meant to run out) and a patient one."""
    return {"quick": Toolbox(["python"], timeout=1.0), "patient": Toolbox(["python"], 60.0)}


def world_writable(*folders: str) -> list[str]:
    """Those of ``folders`` that any uid may write (mode 1777), as real paths."""
    return [os.path.realpath(f) for f in folders
            if os.path.isdir(f) and os.stat(f).st_mode & 0o1002 == 0o1002]


def lock_folder() -> str | None:
    """A world-writable folder outside /tmp, if the host has one."""
    found = world_writable("/run/lock", "/var/lock", "/var/crash", "/dev/mqueue")
    return found[0] if found else None


def of_uid(uid: int | None) -> list[int]:
    return [pid for pid, (owner, _) in processes().items() if uid is not None and owner == uid]


def shm_segments_of(uid: int | None) -> list[str]:
    """The host's SysV shared-memory segments of ``uid``."""
    with open("/proc/sysvipc/shm") as f:
        head, *rows = [line.split() for line in f]
    return [row[1] for row in rows if uid is not None and int(row[head.index("uid")]) == uid]


@pytest.fixture
def world(tmp_path, monkeypatch):
    """What the hostile code aims at: a secret in the environment and in a canary process's,
    a listening socket, a sentinel file, a path in a world-writable folder outside /tmp."""
    monkeypatch.setenv("MAXENT_SANDBOX_SECRET", SECRET)
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                              env={"MAXENT_SANDBOX_SECRET": SECRET})
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("keep")
    outside_root = Path("/root") / f"maxent-sandbox-{uuid.uuid4().hex}"
    folder = lock_folder()
    lock = Path(folder) / f"maxent-sandbox-{uuid.uuid4().hex}" if folder else None
    yield {"TRAINER": os.getpid(), "CANARY": canary.pid, "PORT": listener.getsockname()[1],
           "SENTINEL": str(sentinel), "OUTSIDE": str(tmp_path / "written"),
           "ROOT_FILE": str(outside_root), "LOCK": str(lock), "listener": listener}
    canary.kill()
    canary.wait()
    listener.close()
    for path in (outside_root, lock):
        if path is not None and path.exists():
            path.unlink()


def no_connection(world, result, last):
    with pytest.raises(socket.timeout):
        world["listener"].accept()
    assert "connected" not in result.text


def shm_dies_with_the_call(world, result, last):
    small, big = map(int, result.text.split())
    assert small >= 0 and big == -1  # made one; one over the cap refused
    assert shm_segments_of(last.uid) == []


def printed(*names):
    """The call ran and printed (one of) ``names``: what the kernel answered it."""
    return lambda w, r, last: any(n in r.text for n in names)


#: id -> (code, limit, kind, what must hold after, protections of which one is needed)
CASES = {
    "normal": ("print(37 * 84)", "patient", None,
               lambda w, r, _: r.text.strip() == "3108", ()),
    "infinite_loop": ("while True:\n    pass", "quick", "timeout", None, ()),
    "sleep_past_the_limit": ("import time\ntime.sleep(60)", "quick", "timeout", None, ()),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        pass", "quick", "timeout", None, ()),
    "memory_bomb": ("a = []\nwhile True:\n    a.append(bytearray(10**7))", "patient",
                    "error", printed("MemoryError"), ()),
    "100_MB_of_output": ("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 10**6)\n"
                         "print('END')", "patient", None,
                         lambda w, r, _: ("bytes of output cut" in r.text and len(r.text) < 20000
                                          and r.text.endswith("END\n")), ()),
    "write_outside_its_folder": (
        "for path in ['{OUTSIDE}', '{ROOT_FILE}']:\n    try:\n        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n    except OSError as err:\n        print(err)",
        "patient", None, lambda w, r, _: not any(os.path.exists(w[k]) for k in
                                                ("OUTSIDE", "ROOT_FILE")),
        ("own_uid", "private_tmp")),
    "write_where_any_uid_may": (
        "try:\n    open('{LOCK}', 'w').write('x')\n    print('wrote')\n"
        "except OSError as err:\n    print(type(err).__name__)", "patient", None,
        lambda w, r, _: not os.path.exists(w["LOCK"]), ("own_uid",)),
    "delete_a_file_by_its_path": ("import os\nos.remove('{SENTINEL}')", "patient", "error",
                                  lambda w, r, _: Path(w["SENTINEL"]).read_text() == "keep",
                                  ("own_uid", "private_tmp")),
    "read_the_trainer_environment": (
        "import os\nprint(dict(os.environ))\nfor pid in ({TRAINER}, {CANARY}):\n    try:\n"
        "        print(open(f'/proc/{{pid}}/environ').read())\n"
        "    except OSError as err:\n        print(err)",
        "patient", None, lambda w, r, _: SECRET not in r.text and "HOME" in r.text, ("own_uid",)),
    "read_the_trainer_command_line": (
        "import os\ntry:\n    print(open('/proc/{TRAINER}/cmdline').read())\n"
        "except OSError as err:\n    print(type(err).__name__)\n"
        "print('pids', sum(name.isdigit() for name in os.listdir('/proc')))", "patient", None,
        lambda w, r, _: "FileNotFoundError" in r.text and int(r.text.split()[-1]) <= 3,
        ("own_proc",)),
    "open_a_socket": ("import socket\nsocket.create_connection(('127.0.0.1', {PORT}), 2)\n"
                      "print('connected')", "patient", "error", no_connection, ("no_network",)),
    "kill_its_parent": ("import os\ntry:\n    os.kill(os.getppid(), 9)\n    print('sent')\n"
                        "except OSError as err:\n    print(type(err).__name__)\n"
                        "print('still here')", "patient", None,
                        lambda w, r, _: "still here" in r.text and (
                            "sent" in r.text or "PermissionError" in r.text), ()),
    "kill_the_trainer": ("import os\nos.kill({TRAINER}, 9)", "patient", "error",
                         printed("PermissionError", "ProcessLookupError"),
                         ("own_uid", "pid_namespace")),
    "kill_every_process_it_may": ("import os\nos.kill(-1, 9)", "patient", "error",
                                  printed("PermissionError", "ProcessLookupError"),
                                  ("own_uid", "pid_namespace")),
    "segfault": ("import ctypes\nctypes.string_at(0)", "patient", "error",
                 printed("SIGSEGV"), ()),
    "daemon_outliving_the_call": (  # (b) checks that it is gone
        "import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
        "    if os.fork() == 0:\n        os.write(w, b'up')\n        time.sleep(60)\n"
        "    os._exit(0)\nos.close(w)\nprint('daemon', os.read(r, 2).decode())",
        "patient", None, printed("daemon up"), ()),
    "sysv_shared_memory": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]\n"
        "print(libc.shmget(0, 4096, 0o1600), libc.shmget(0, 1 << 30, 0o1600))",
        "patient", None, shm_dies_with_the_call, ("own_ipc",)),
    "too_many_open_files": (
        "import os\nfds = []\ntry:\n    while len(fds) < 1000:\n"
        "        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError as err:\n    print(err.errno, len(fds))", "patient", None,
        lambda w, r, _: r.text.split()[0] == "24" and int(r.text.split()[1]) < 100, ()),
    "the_oom_killer_takes_it_first": ("print(open('/proc/self/oom_score_adj').read())",
                                      "patient", None, lambda w, r, _: r.text.strip() == "1000",
                                      ()),
    "its_parent_death_signal": (  # set after the uid changed, which clears it
        "import ctypes\nvalue = ctypes.c_int()\nctypes.CDLL(None).prctl(2, ctypes.byref(value), "
        "0, 0, 0)\nprint(value.value)", "patient", None,
        lambda w, r, _: r.text.strip() == str(int(signal.SIGKILL)), ()),
    "close_stdout_and_raise": (
        "import sys\nprint('before')\nsys.stdout.close()\nsys.stderr.close()\n"
        "raise ValueError('gone')", "patient", "error",
        lambda w, r, last: "ValueError: gone" in r.text and last.code == 1, ()),
    "new_namespaces_and_mounts": (  # the kernel code behind them is out of its reach
        "import ctypes, errno, os, platform, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def show(name, r):\n"
        "    print(name, r, errno.errorcode.get(ctypes.get_errno()) if r == -1 else 'ok')\n"
        "show('unshare_nothing', libc.unshare(0))\n"
        "show('unshare_user', libc.unshare(0x10000000))\n"
        "clone = {{'x86_64': 56, 'aarch64': 220}}[platform.machine()]\n"
        "r = libc.syscall(clone, 0x10000000 | 17, 0, 0, 0, 0)\n"
        "if r == 0:\n    os._exit(0)\n"
        "if r > 0:\n    os.waitpid(r, 0)\n"
        "show('clone_user', r)\n"
        "show('clone3', libc.syscall(435, 0, 0))\n"
        "show('mount', libc.mount(b'none', b'.', b'tmpfs', 0, None))\n"
        "print('child', subprocess.run(['/bin/true']).returncode)",
        "patient", None, lambda w, r, _: all(f"{name} -1 {code}" in r.text for name, code in (
            ("unshare_nothing", "EPERM"), ("unshare_user", "EPERM"), ("clone_user", "EPERM"),
            ("clone3", "ENOSYS"), ("mount", "EPERM"))) and "child 0" in r.text,
        ("syscall_filter",)),
    "trace_bpf_io_uring_keyring": (
        "import ctypes, errno, platform\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "nr = {{'x86_64': (101, 321, 425, 250), 'aarch64': (117, 280, 425, 219)}}"
        "[platform.machine()]\n"
        "for n in nr:\n"
        "    print(n, libc.syscall(n, 0, 0, 0, 0), errno.errorcode[ctypes.get_errno()])",
        "patient", None, lambda w, r, _: r.text.count("-1 EPERM") == 4, ("syscall_filter",)),
    "sys_exit_3": ("import sys\nsys.exit(3)", "patient", "error",
                   lambda w, r, _: r.text.startswith("Error: python exited with status 3"), ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_call_harms_nothing_and_leaves_nothing(case, pool, boxes, world):
    code, limit, kind, holds, needs = CASES[case]
    if needs and not any(pool.protections.get(n) for n in needs):
        pytest.skip(f"needs one of {needs}: {pool.protections}")
    if "{LOCK}" in code and world["LOCK"] == "None":
        pytest.skip("no world-writable folder outside /tmp on this machine")
    text = code.format(**{k: v for k, v in world.items() if k.isupper()})
    pool.last = None  # this case's own result, never the previous one's
    result = boxes[limit].run(ToolCall("python", {"code": text}))
    # (a) the trainer (and a process it started) lives, and reads a ToolResult; the sandbox
    # did run the code (a sandbox that fails to run anything would pass every other check)
    assert alive(os.getpid()) and alive(world["CANARY"])
    kinds = kind if isinstance(kind, tuple) else (kind,)
    assert isinstance(result, ToolResult) and result.failure in kinds, result.text[-600:]
    assert pool.last is not None and pool.last.status != "failed", pool.last
    # (b) nothing of the call is left: no process of its uid or session
    assert left_behind(pool.last) == []
    # (c) what it tried did not happen
    if holds is not None:
        assert holds(world, result, pool.last) is not False, result.text[-600:]


def test_the_python_tool_is_built_in_and_raises_on_failure(pool):
    box = Toolbox(["python"], timeout=30.0)
    function = box.schemas[0]["function"]
    assert function["name"] == "python" and "code" in function["parameters"]["properties"]
    assert sandbox.python("print(6 * 7)") == "42\n"
    with pytest.raises(SandboxError, match="ZeroDivisionError"):
        sandbox.python("1 / 0")


def test_what_was_printed_before_a_kill_reaches_the_model(pool, boxes):
    """Output goes out line by line: a call killed at its time limit still shows the lines
    it printed (a block buffer lost them with the process)."""
    result = boxes["quick"].run(ToolCall("python", {
        "code": "print('partial result 42')\nwhile True:\n    pass"}))
    assert result.failure == "timeout"
    assert result.text == "Error: python gave no result within 1 s\npartial result 42\n"


def test_calls_per_second_and_no_hang(pool):
    """Loosely measured (printed); the bound only catches a hang."""
    pool.run("print(1)")
    start, n = time.perf_counter(), 20
    results = [pool.run("print(1)") for _ in range(n)]
    seconds = time.perf_counter() - start
    print(f"sandbox: {n / seconds:.1f} calls/s ({1000 * seconds / n:.1f} ms per call)")
    assert all(r.failure is None and r.output == "1\n" for r in results)
    assert seconds < 120


def test_what_holds_is_reported(pool):
    guard = pool.protections
    assert guard["fresh_process"] and guard["rlimits"]
    assert guard["own_uid"] == (os.geteuid() == 0)
    assert not guard["read_only"] or guard["private_tmp"]
    assert not guard["own_proc"] or guard["pid_namespace"]
    # the filter is claimed exactly where a trial install succeeds (never on a guess)
    from maxent_grpo.rollout.sandbox import seccomp

    assert guard["syscall_filter"] == seccomp.supported()
    assert not guard["syscall_filter"] or platform.machine() in ("x86_64", "aarch64")
    if guard["own_uid"]:
        result = pool.run("import os; print(os.getuid(), os.getgid(), os.getgroups())")
        uid = result.uid
        assert uid >= UID_BASE and result.output == f"{uid} {uid} []\n"


def test_how_a_call_ended_reads_right():
    """``cpu`` only when the CPU limit killed the call, not when it exited after its
    children used that much; a call whose status never came back never reads 'None'."""
    from maxent_grpo.rollout.sandbox.worker import ending

    assert ending(0, 10.0, 3) == {"status": "exit", "code": 0}
    assert ending(signal.SIGXCPU, 3.0, 3) == {"status": "cpu"}
    assert ending(signal.SIGKILL, 4.0, 3) == {"status": "cpu"}
    assert ending(signal.SIGKILL, 0.1, 3) == {"status": "signal", "signal": signal.SIGKILL}
    lost = sandbox.SandboxResult("lost", timeout=2.0)
    assert lost.failure == "error" and "None" not in lost.message("python")


TOOLS = """
import time

OWN_SOURCE = open(__file__)  # a table a tool reads, opened at import


def first_line() -> str:
    \"\"\"The first words of this module.\"\"\"
    OWN_SOURCE.seek(0)
    return " ".join(OWN_SOURCE.read().split()[:2])


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def unprintable() -> str:
    \"\"\"Fail with an exception whose message cannot be built.\"\"\"
    raise Unprintable()


def hang(seconds: float) -> str:
    \"\"\"Sleep, then answer.

    Args:
        seconds: how long to sleep.
    \"\"\"
    time.sleep(seconds)
    return "awake"


def total(values: list) -> dict:
    \"\"\"Add the values.

    Args:
        values: numbers.
    \"\"\"
    return {"total": sum(values), "pid_is_not_the_trainer": __import__("os").getpid(),
            "city": "Zürich"}


def odd(kind: str) -> object:
    \"\"\"A value json and str cannot show, or no answer at all.

    Args:
        kind: deep, big or exit.
    \"\"\"
    if kind == "exit":
        __import__("os")._exit(0)
    deep = []
    for _ in range(100_000):
        deep = [deep]
    return deep if kind == "deep" else 10 ** 5000
"""

NEEDS_THE_SECRET = """
import os

if "MAXENT_SANDBOX_SECRET" not in os.environ:  # so it imports in the trainer only
    raise RuntimeError("this module needs the secret")


def probe(x: int) -> int:
    \"\"\"Answer x.

    Args:
        x: a number.
    \"\"\"
    return x
"""


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    """Ordinary tools in modules of their own (importable by a fresh process)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sandbox, "Sandbox", Recording)  # the toolbox's pool records too
    monkeypatch.setenv("MAXENT_SANDBOX_SECRET", SECRET)
    modules = []
    for source in (TOOLS, NEEDS_THE_SECRET):
        name = f"sandbox_tools_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        modules.append(__import__(name))
    boxes = []
    yield modules, boxes
    for box in boxes:
        box.close()
    modules[0].OWN_SOURCE.close()


def test_exit_and_quit_end_the_code_as_python_does(boxes):
    """The pool's Python starts without the site module, which defines ``exit`` and
    ``quit``: a script ending in ``exit()`` failed with a NameError."""
    box = boxes["patient"]
    for code, status in (("print(37 * 84)\nexit()", 0), ("print(1)\nquit(0)", 0),
                         ("print(2)\nexit(3)\nprint(4)", 3)):
        result = box.run(ToolCall("python", {"code": code}))
        assert "NameError" not in result.text and "4" not in result.text, result
        assert (result.failure is None) == (status == 0), result


def test_code_runs_as_python_runs_it(boxes):
    """The code was compiled with the sandbox's own ``from __future__ import annotations``,
    lost what it wrote to ``sys.__stdout__``, had a character across the 12 KiB mark of its
    output cut in two, and an exit status past a C long read as success."""
    box = boxes["patient"]
    result = box.run(ToolCall("python", {"code": "def f(x: int): pass\nprint(f.__annotations__)"}))
    assert result.text.strip() == "{'x': <class 'int'>}", result
    result = box.run(ToolCall("python", {"code": "import sys\nprint('ok', file=sys.__stdout__)"}))
    assert result.text.strip() == "ok", result
    result = box.run(ToolCall("python", {"code": "print('a' + '€' * 4200)"}))
    assert result.text.strip() == "a" + "€" * 4200, result.text[4080:4110]
    assert box.run(ToolCall("python", {"code": "raise SystemExit(2**100)"})).failure == "error"


def test_a_tools_non_ascii_answer_reaches_the_model_as_written(user_tools):
    """A non-string answer was JSON with \\u escapes (``Z\\u00fcrich``), read by the model as
    such, at several tokens a character."""
    (module, _), boxes = user_tools
    for isolation in ("thread", "process"):
        box = Toolbox([module.total], timeout=30.0, isolation=isolation)
        boxes.append(box)
        result = box.run(ToolCall("total", {"values": [1, 2]}))
        assert result.failure is None and "\\u" not in result.text
        assert json.loads(result.text)["city"] == "Zürich", (isolation, result.text)


def test_a_trainer_run_from_the_temporary_folder_still_gives_each_call_its_own(user_tools,
                                                                               monkeypatch):
    """Run from /tmp (so on sys.path), the host's /tmp was bound back, read-only, over the
    call's own: every call failed (``Read-only file system: '/tmp/sandbox'``)."""
    (module, _), boxes = user_tools
    monkeypatch.syspath_prepend(tempfile.gettempdir())
    box = Toolbox([module.total], timeout=30.0, isolation="process")
    boxes.append(box)
    result = box.run(ToolCall("total", {"values": [1, 2]}))
    assert result.failure is None, result

def test_a_tool_reads_what_its_module_opened_at_import_and_the_code_does_not(user_tools):
    """A process call closed every file the tool's module had opened at import (a table, a
    connection): the tool failed where a thread's call worked."""
    (module, _), boxes = user_tools
    for isolation in ("thread", "process"):
        box = Toolbox([module.first_line, module.unprintable, "python"], timeout=30.0,
                      isolation=isolation)
        boxes.append(box)
        assert box.run(ToolCall("first_line", {})) == ToolResult("import time"), isolation
        # a message that cannot be built is the type alone, as in a thread (was "exited")
        assert box.run(ToolCall("unprintable", {})) == ToolResult("Error: Unprintable", "error")
    code = "import os\nprint(max(int(fd) for fd in os.listdir('/proc/self/fd')))"
    assert int(box.run(ToolCall("python", {"code": code})).text) < 5  # stdio and the listing


def test_values_no_one_can_show_read_alike_in_both_isolations(user_tools):
    """A list nested 100,000 deep or an int of 5,000 digits was the tool's answer in a
    thread and its error in a process; a tool that left with ``os._exit(0)`` read as
    "exited with status 0", an error that reads like success."""
    (module, _), boxes = user_tools
    for isolation in ("thread", "process"):
        box = Toolbox([module.odd], timeout=30.0, isolation=isolation)
        boxes.append(box)
        assert box.run(ToolCall("odd", {"kind": "deep"})) == ToolResult(
            "<a list nested too deeply to show>"), isolation
        assert box.run(ToolCall("odd", {"kind": "big"})) == ToolResult(
            "<a int that cannot be shown (ValueError)>"), isolation
    assert box.run(ToolCall("odd", {"kind": "exit"})) == ToolResult(
        "Error: odd exited with status 0 before giving its answer", "error")


def test_process_isolation_kills_a_hung_tool_and_returns_values(user_tools):
    (module, _), boxes = user_tools
    box = Toolbox([module.hang, module.total, "python"], timeout=1.0, isolation="process")
    boxes.append(box)
    threads = set(threading.enumerate())
    hung = box.run(ToolCall("hang", {"seconds": 60}))
    assert hung == ToolResult("Error: hang gave no result within 1 s", "timeout")
    # no thread left running the tool (a thread of an earlier test may end meanwhile)
    assert set(threading.enumerate()) <= threads
    assert left_behind(box._sandbox.last) == []
    box.timeout = 60.0  # the rest only needs to finish
    answer = box.run(ToolCall("total", {"values": [1, 2, 3]}))
    assert answer.failure is None and json.loads(answer.text)["total"] == 6
    assert json.loads(answer.text)["pid_is_not_the_trainer"] != os.getpid()
    assert box.run(ToolCall("hang", {"seconds": 0})) == ToolResult("awake")
    assert left_behind(box._sandbox.last) == []


def test_a_tool_the_sandbox_cannot_import_is_named(user_tools, caplog):
    (_, module), boxes = user_tools
    box = Toolbox([module.probe], timeout=30.0, isolation="process")
    boxes.append(box)
    with caplog.at_level("WARNING"):
        result = box.run(ToolCall("probe", {"x": 1}))
    assert result.failure == "error" and "model.tool_isolation" in result.text, result.text
    assert "probe" in result.text and "needs the secret" in result.text
    assert any("model.tool_isolation" in r.message and "probe" in r.message
               for r in caplog.records)


def test_a_failing_sandbox_is_a_message_not_an_exception(monkeypatch):
    def broken():
        raise RuntimeError("no sandbox today")

    monkeypatch.setattr(sandbox, "shared_sandbox", broken)
    result = Toolbox(["python"], timeout=5.0).run(ToolCall("python", {"code": "print(1)"}))
    assert result.failure == "error" and "no sandbox today" in result.text


def test_isolation_is_checked():
    with pytest.raises(ValueError, match="model.tool_isolation"):
        Toolbox(["calculate"], isolation="container")

    def local(x: int) -> int:
        """Not importable.

        Args:
            x: a number.
        """
        return x

    with pytest.raises(ValueError, match="model.tool_isolation"):
        Toolbox([local], isolation="process")
    assert Toolbox([local]).isolation == "thread"  # the default keeps threads


@pytest.fixture
def tmp_root():
    """A folder for working folders: any uid may pass, only root may write."""
    root = Path(tempfile.mkdtemp(prefix="maxent-test-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_without_namespaces_the_call_leaves_nothing(tmp_root):
    """The fallback: no namespace, only rlimits, the uid and the cleanup; the working
    folder, made read-only, is removed all the same, the daemon dies, and what the call put
    in the shared world-writable folders and SysV memory is gone when the answer comes."""
    name = f"maxent-sandbox-test-{uuid.uuid4().hex}"
    shared = [f"{folder}/{name}" for folder in world_writable("/tmp", "/var/tmp")]
    if lock_folder():
        shared.append(f"{lock_folder()}/{name}")
    with Recording(timeout=30.0, spares=0, namespaces=False, tmp_root=str(tmp_root)) as bare:
        guard = bare.protections
        assert not (guard["no_network"] or guard["pid_namespace"] or guard["private_tmp"]
                    or guard["own_ipc"] or guard["read_only"] or guard["own_proc"])
        result = bare.run(
            "import ctypes, os, time\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\n"
            "os.chmod('a/b', 0o500)\nos.chmod('a', 0o500)\nprint(os.getcwd())\n"
            f"for path in {shared!r}:\n    open(path, 'w').write('x')\n"
            f"os.makedirs('/tmp/{name}-d/e')\n"
            "print(ctypes.CDLL(None).shmget(0, 4096, 0o1600))\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(30)\n    os._exit(0)")
        assert result.failure is None, result.output
        folder, segment = result.output.split()
        assert Path(folder).parent.parent == tmp_root and int(segment) >= 0
        assert left_behind(result) == []
        if os.geteuid() == 0:  # the call had its own uid, so what it owns can be told
            assert [p for p in shared + [f"/tmp/{name}-d"] if os.path.exists(p)] == []
            assert shm_segments_of(result.uid) == []
        for path in shared + [f"/tmp/{name}-d/e", f"/tmp/{name}-d"]:  # a plain user's stay
            if os.path.exists(path):
                os.rmdir(path) if os.path.isdir(path) else os.unlink(path)
        assert not os.path.exists(folder)
    assert list(tmp_root.iterdir()) == []  # the zygote's folder goes with it


def test_the_fallback_cleanup_never_follows_a_link(tmp_path):
    """Without a private /tmp the call cannot swap its working folder for a link to a
    folder of the trainer's, and a link inside it is removed, never followed."""
    victim = tmp_path / "victim"
    victim.mkdir()
    victim.chmod(0o755)
    (victim / "file").write_text("keep")
    (victim / "file").chmod(0o644)
    code = (f"import os\nhere = os.getcwd()\nos.symlink({str(victim)!r}, 'inner')\n"
            f"os.chdir('/')\ntry:\n    os.rename(here, here + '-moved')\n"
            f"    os.symlink({str(victim)!r}, here)\n    print('replaced')\n"
            f"except OSError as err:\n    print(type(err).__name__)\nprint(here)")
    with Recording(timeout=30.0, spares=0, namespaces=False) as bare:
        result = bare.run(code)
    assert result.failure is None, result.output
    here = result.output.split()[-1]
    assert (victim.stat().st_mode & 0o7777, (victim / "file").stat().st_mode & 0o7777) == (
        0o755, 0o644)
    assert (victim / "file").read_text() == "keep"
    assert not os.path.lexists(here) and not os.path.lexists(here + "-moved")


def test_a_folder_is_removed_through_its_parent_and_links_are_not_followed(tmp_path):
    """What a call's uid left in a shared folder goes folder by folder, through descriptors
    (Python 3.10 has no ``rmtree(dir_fd=)``): nested files, a read-only folder, a link to a
    folder of the trainer's (removed, its target kept)."""
    from maxent_grpo.rollout.sandbox import call

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "file").write_text("keep")
    top = tmp_path / "shared" / "left"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f").write_text("x")
    (top / "a" / "link").symlink_to(victim)
    (top / "g").write_text("y")
    if os.geteuid() == 0:  # root removes from a read-only folder; a plain user could not
        (top / "a").chmod(0o500)
    fd = os.open(tmp_path / "shared", os.O_RDONLY | os.O_DIRECTORY)
    try:
        call._remove_at("left", fd)
    finally:
        os.close(fd)
    assert list((tmp_path / "shared").iterdir()) == []
    assert (victim / "file").read_text() == "keep"


def test_a_tree_deeper_than_the_stack_is_removed_without_following_links(tmp_path):
    """Model code's ``for i in range(1500): os.mkdir('a'); os.chdir('a')`` was left on the
    host without namespaces (the removal recursed: RecursionError, swallowed), and at the
    pool's close it ended the fit with "a bug"."""
    from maxent_grpo.rollout.sandbox import call

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "file").write_text("keep")
    for top in ("deep", "deeper"):
        os.mkdir(tmp_path / top)
        fd = os.open(tmp_path / top, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(1500 if top == "deep" else 2 * sys.getrecursionlimit()):
            os.mkdir("a", dir_fd=(parent := fd))
            fd = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)
            os.close(parent)
        os.symlink(victim, "link", dir_fd=fd)
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
        os.close(fd)
    call.remove_tree(str(tmp_path / "deep"))
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        call._remove_at("deeper", fd)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]
    assert (victim / "file").read_text() == "keep"


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to another uid to be a plain user")
def test_a_plain_user_removes_a_read_only_tree_of_its_own(tmp_path):
    """A plain user's removal left a folder its code made read-only (``a`` at 0o500: its
    ``b`` could not go); a folder made unreadable is entered too, through no link."""
    from maxent_grpo.rollout.sandbox import call

    tmp_path = Path(tempfile.mkdtemp())  # (pytest's folders are root's alone)
    tmp_path.chmod(0o777)
    pid = os.fork()
    if pid == 0:  # the child: uid 65534 (nobody), as a plain user's trainer
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            work = tmp_path / "w"
            (work / "a" / "b" / "c").mkdir(parents=True)
            (work / "a" / "b" / "f").write_text("x")
            (work / "a" / "b" / "c").chmod(0o000)
            (work / "a" / "b").chmod(0o500)
            (work / "a").chmod(0o500)
            call.remove_tree(str(work))
            code = 0 if not work.exists() else 2
        finally:
            os._exit(code)
    status = os.waitpid(pid, 0)[1]
    call.remove_tree(str(tmp_path))
    assert status == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the call needs a uid of its own")
def test_closing_during_a_call_kills_it_and_all_it_started(tmp_root):
    """Even without a pid namespace (where the daemon would outlive its supervisor)."""
    box = Recording(timeout=60.0, spares=1, namespaces=False, tmp_root=str(tmp_root))
    uid = box._pool.peek()["uid"]  # the spare the call will take
    results = []
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(60)\n    os._exit(0)\ntime.sleep(60)")
    thread = threading.Thread(target=lambda: results.append(box.run(code)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(of_uid(uid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(of_uid(uid)) >= 2  # the call and its daemon run
    zygote = box.pid
    box.close()
    thread.join(30)
    assert not thread.is_alive() and results[0].failure is not None
    deadline = time.monotonic() + 10
    while (of_uid(uid) or alive(zygote)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert of_uid(uid) == [] and not alive(zygote)
    assert list(tmp_root.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="uid_base is for root")
def test_unmapped_uids_fail_once_and_clearly():
    with Sandbox(timeout=30.0, spares=0, uid_base=2**32 - 100) as box:
        first = box.run("print(1)")
        assert first.status == "failed" and "uid_base" in first.reason, first
        second = box.run("print(1)")
        assert second.status == "failed" and second.reason == first.reason
        assert box.pid is None  # no zygote started again for it


def test_a_killed_zygote_is_replaced():
    with Recording(timeout=30.0, spares=1) as box:
        assert box.run("print(1)").output == "1\n"
        zygote, base = box.pid, box._pool.base
        old = [pid for pid, (_, session) in processes().items() if session == pid
               and _parent(pid) == zygote]
        os.kill(zygote, signal.SIGKILL)
        box._pool.proc.wait(timeout=30)
        results = []
        thread = threading.Thread(target=lambda: results.append(box.run("print(2)")),
                                  daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the call after a killed zygote hung"
        assert results[0].failure is None and results[0].output == "2\n", results[0]
        assert box.pid not in (None, zygote)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in old) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in old)  # its spares left
        assert not os.path.exists(base)  # and its folder went


def test_a_forked_child_starts_its_own_pool(pool):
    """A child forked while another thread held the pool's lock neither waits for it nor
    touches the parent's processes."""
    assert pool.run("print(1)").output == "1\n"
    zygote = pool.pid
    with pool._pool.lock:
        child = os.fork()
        if child == 0:
            status = 1
            try:
                status = 0 if pool.run("print(2)").output == "2\n" else 3
                pool.close()
            finally:
                os._exit(status)
    deadline = time.monotonic() + 60
    while not (done := os.waitpid(child, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the forked child hung on its parent's pool")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0  # its own call ran and answered
    assert pool.run("print(3)").output == "3\n"  # the parent's pool is untouched
    assert pool.pid == zygote  # the child neither stopped nor replaced the parent's


def test_closing_and_exiting_leave_no_process(tmp_path):
    with Sandbox(timeout=30.0, spares=2) as pool:
        assert pool.run("print(1)").output == "1\n"
        zygote = pool.pid

        def spares():
            return [pid for pid, (_, session) in processes().items() if session == pid
                    and _parent(pid) == zygote]

        deadline = time.monotonic() + 30  # the refill runs after the call returned
        while len(spares()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = spares()
        assert len(started) >= 1
    ours = {UID_BASE + pid for pid in started}  # the uids of their calls' processes

    def remaining():
        return [pid for pid, (uid, _) in processes().items()
                if pid == zygote or pid in started or uid in ours]

    deadline = time.monotonic() + 10
    while remaining() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert remaining() == []
    # a script that never closes its sandbox: the finaliser stops it at exit
    script = tmp_path / "forgets.py"
    script.write_text("from maxent_grpo.rollout.sandbox import Sandbox\n"
                      "pool = Sandbox(spares=2)\nprint(pool.run('print(1)').output.strip(), "
                      "pool.pid, flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(sandbox.__file__).parents[2])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    printed, zygote = done.stdout.split()
    assert printed == "1" and not alive(int(zygote))


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except OSError:
        return -1


def test_the_trainer_survives_a_signal_storm(pool):
    """The call's signals never reach the trainer, whatever it sends."""
    handler = signal.getsignal(signal.SIGTERM)
    result = pool.run(f"import os, signal\nfor s in (2, 9, 15):\n    try:\n"
                      f"        os.kill({os.getpid()}, s)\n    except OSError as e:\n"
                      f"        print(type(e).__name__)")
    assert alive(os.getpid()) and signal.getsignal(signal.SIGTERM) == handler
    assert result.status == "exit", result
    if pool.protections["own_uid"] or pool.protections["pid_namespace"]:
        assert result.output.count("Error") == 3


def test_the_syscall_filter_knows_every_refused_call_on_both_architectures():
    """Each architecture's table numbers every refused call, and the program's jumps stay in
    range (a BPF jump is at most 255 instructions ahead, and every path ends in a return)."""
    from maxent_grpo.rollout.sandbox import seccomp

    headers = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
               "aarch64": "/usr/include/asm-generic/unistd.h"}
    for machine in ("x86_64", "aarch64"):
        numbers = seccomp._TABLES[machine][1]
        if os.path.exists(headers[machine]):  # the numbers are the kernel's
            text = Path(headers[machine]).read_text()
            for name, number in numbers.items():
                found = re.search(rf"#define __NR(?:3264)?_{name}\s+(\d+)", text)
                assert found is not None and int(found.group(1)) == number, name
        code = seccomp.program(machine)
        numbers = [k for c, _, _, k in code if c == seccomp.JEQ][1:]  # the first is the arch
        assert len(set(numbers)) == len(numbers) == len(seccomp.REFUSED) + 2
        assert code[-1] == (seccomp.RET, 0, 0, seccomp.RET_ALLOW)
        for i, (c, jt, jf, _) in enumerate(code):
            if c in (seccomp.JEQ, seccomp.JGE, seccomp.JSET):
                assert i + 1 + max(jt, jf) < len(code)


def test_namespaces_a_machine_refuses_are_said_once(caplog):
    """In a container without CAP_SYS_ADMIN the sandbox ran without its namespaces (the
    code reached the network, saw the host's processes) and nothing said so; a sandbox
    asked to run without them is quiet."""
    refused = {"no_network": False, "pid_namespace": False, "private_tmp": False,
               "read_only": False, "own_ipc": False, "syscall_filter": True}
    with caplog.at_level("WARNING", logger="maxent_grpo.rollout.sandbox"):
        for namespaces in (True, False):
            box = Sandbox(namespaces=namespaces)
            box._say_missing(refused)
            box._say_missing(refused)
            box._say_missing(dict.fromkeys(refused, True))
            box.close()
        box = Sandbox()  # the namespaces made, their mounts refused (AppArmor): only those
        box._say_missing(refused | {"no_network": True, "pid_namespace": True, "own_ipc": True})
        box.close()
    first, second = (record.getMessage() for record in caplog.records)
    assert first.startswith(
        "the sandbox runs without no_network, pid_namespace, private_tmp, read_only, own_ipc: "
        "this machine refused new namespaces")
    assert "may share the host's /tmp (what it leaves there is removed), write the host's " \
        "world-writable folders; run" in second and "network" not in second
