"""The sandbox of model-written code (:mod:`maxent_grpo.rollout.sandbox`): a table of
hostile calls, each checked three ways: the trainer lives and reads a ToolResult of the
expected kind, no process of the call is left, and what the code tried did not happen.
Then the ``process`` isolation of ordinary tools, and the pool's own life cycle.

The time limits here only bound hangs: this runs on a loaded two-core machine."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
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


@pytest.fixture
def world(tmp_path, request, monkeypatch):
    """What the hostile code aims at: a secret in the environment and in a canary process's,
    a listening socket, a sentinel file, a folder outside /tmp that any uid may write."""
    monkeypatch.setenv("MAXENT_SANDBOX_SECRET", SECRET)
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                              env={"MAXENT_SANDBOX_SECRET": SECRET})
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("keep")
    cache = getattr(request.config, "cache", None)  # a folder outside /tmp, if any
    shared = (Path(cache.mkdir(f"sandbox-{uuid.uuid4().hex}")) if cache is not None
              else tmp_path / "shared")
    shared.mkdir(exist_ok=True)
    shared.chmod(0o777)
    outside_root = Path("/root") / f"maxent-sandbox-{uuid.uuid4().hex}"
    yield {"TRAINER": os.getpid(), "CANARY": canary.pid, "PORT": listener.getsockname()[1],
           "SENTINEL": str(sentinel), "OUTSIDE": str(tmp_path / "written"),
           "ROOT_FILE": str(outside_root), "SHARED": str(shared), "listener": listener}
    canary.kill()
    canary.wait()
    listener.close()
    for path in [*shared.iterdir(), shared, outside_root]:
        try:
            path.unlink() if path.is_file() else path.rmdir()
        except OSError:
            pass


def no_connection(world, result):
    with pytest.raises(socket.timeout):
        world["listener"].accept()
    assert "connected" not in result.text


def daemon_never_writes(world, result):
    shared = Path(world["SHARED"])
    if not (shared / "early").exists():
        pytest.skip("no folder outside /tmp the sandbox's uid can write (the control write)")
    time.sleep(1.5)  # the daemon would have written by now
    assert not (shared / "late").exists()


#: id -> (code, limit, kind, what must hold after, protections of which one is needed)
CASES = {
    "normal": ("print(37 * 84)", "patient", None,
               lambda w, r: r.text.strip() == "3108", ()),
    "infinite_loop": ("while True:\n    pass", "quick", "timeout", None, ()),
    "sleep_past_the_limit": ("import time\ntime.sleep(60)", "quick", "timeout", None, ()),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        pass", "quick", "timeout", None, ()),
    "memory_bomb": ("a = []\nwhile True:\n    a.append(bytearray(10**7))", "patient",
                    "error", lambda w, r: "MemoryError" in r.text, ()),
    "100_MB_of_output": ("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 10**6)\n"
                         "print('END')", "patient", None,
                         lambda w, r: ("bytes of output cut" in r.text and len(r.text) < 20000
                                       and r.text.endswith("END\n")), ()),
    "write_outside_its_folder": (
        "for path in ['{OUTSIDE}', '{ROOT_FILE}']:\n    try:\n        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n    except OSError as err:\n        print(err)",
        "patient", None, lambda w, r: not any(os.path.exists(w[k]) for k in
                                             ("OUTSIDE", "ROOT_FILE")),
        ("own_uid", "private_tmp")),
    "delete_a_file_by_its_path": ("import os\nos.remove('{SENTINEL}')", "patient", "error",
                                  lambda w, r: Path(w["SENTINEL"]).read_text() == "keep",
                                  ("own_uid", "private_tmp")),
    "read_the_trainer_environment": (
        "import os\nprint(dict(os.environ))\nfor pid in ({TRAINER}, {CANARY}):\n    try:\n"
        "        print(open(f'/proc/{{pid}}/environ').read())\n"
        "    except OSError as err:\n        print(err)",
        "patient", None, lambda w, r: SECRET not in r.text and "HOME" in r.text, ("own_uid",)),
    "open_a_socket": ("import socket\nsocket.create_connection(('127.0.0.1', {PORT}), 2)\n"
                      "print('connected')", "patient", "error", no_connection, ("no_network",)),
    "kill_its_parent": ("import os\nos.kill(os.getppid(), 9)\nprint('still here')", "patient",
                        (None, "error"), None, ()),
    "kill_the_trainer": ("import os\nos.kill({TRAINER}, 9)", "patient", "error", None,
                         ("own_uid", "pid_namespace")),
    "kill_every_process_it_may": ("import os\nos.kill(-1, 9)", "patient", "error", None,
                                  ("own_uid", "pid_namespace")),
    "segfault": ("import ctypes\nctypes.string_at(0)", "patient", "error",
                 lambda w, r: "SIGSEGV" in r.text, ()),
    "daemon_outliving_the_call": (
        "import os, time\nopen('{SHARED}/early', 'w').write('x')\nif os.fork() == 0:\n"
        "    os.setsid()\n    if os.fork() == 0:\n        time.sleep(0.5)\n"
        "        open('{SHARED}/late', 'w').write('x')\n    os._exit(0)\nprint('parent done')",
        "patient", None, daemon_never_writes, ()),
    "sys_exit_3": ("import sys\nsys.exit(3)", "patient", "error",
                   lambda w, r: r.text.startswith("Error: python exited with status 3"), ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_call_harms_nothing_and_leaves_nothing(case, pool, boxes, world):
    code, limit, kind, holds, needs = CASES[case]
    if needs and not any(pool.protections.get(n) for n in needs):
        pytest.skip(f"needs one of {needs}: {pool.protections}")
    text = code.format(**{k: v for k, v in world.items() if k.isupper()})
    result = boxes[limit].run(ToolCall("python", {"code": text}))
    # (a) the trainer (and a process it started) lives, and reads a ToolResult
    assert alive(os.getpid()) and alive(world["CANARY"])
    kinds = kind if isinstance(kind, tuple) else (kind,)
    assert isinstance(result, ToolResult) and result.failure in kinds, result.text[-600:]
    # (b) nothing of the call is left: no process of its uid or session
    assert pool.last is not None and left_behind(pool.last) == []
    # (c) what it tried did not happen
    if holds is not None:
        assert holds(world, result) is not False, result.text[-600:]


def test_the_python_tool_is_built_in_and_raises_on_failure(pool):
    box = Toolbox(["python"], timeout=30.0)
    function = box.schemas[0]["function"]
    assert function["name"] == "python" and "code" in function["parameters"]["properties"]
    assert sandbox.python("print(6 * 7)") == "42\n"
    with pytest.raises(SandboxError, match="ZeroDivisionError"):
        sandbox.python("1 / 0")


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
    if guard["own_uid"]:
        result = pool.run("import os; print(os.getuid(), os.getgid(), os.getgroups())")
        uid = result.uid
        assert uid >= UID_BASE and result.output == f"{uid} {uid} []\n"


TOOLS = '''
import time


def hang(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def total(values: list) -> dict:
    """Add the values.

    Args:
        values: numbers.
    """
    return {"total": sum(values), "pid_is_not_the_trainer": __import__("os").getpid()}
'''


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    """Two ordinary tools in a module of their own (importable by a fresh process)."""
    name = f"sandbox_tools_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(TOOLS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sandbox, "Sandbox", Recording)  # the toolbox's pool records too
    module = __import__(name)
    boxes = []
    yield module, boxes
    for box in boxes:
        box.close()


def test_process_isolation_kills_a_hung_tool_and_returns_values(user_tools):
    module, boxes = user_tools
    box = Toolbox([module.hang, module.total, "python"], timeout=1.0, isolation="process")
    boxes.append(box)
    threads = threading.active_count()
    hung = box.run(ToolCall("hang", {"seconds": 60}))
    assert hung == ToolResult("Error: hang gave no result within 1 s", "timeout")
    assert threading.active_count() == threads  # no thread left running the tool
    assert left_behind(box._sandbox.last) == []
    box.timeout = 60.0  # the rest only needs to finish
    answer = box.run(ToolCall("total", {"values": [1, 2, 3]}))
    assert answer.failure is None and json.loads(answer.text)["total"] == 6
    assert json.loads(answer.text)["pid_is_not_the_trainer"] != os.getpid()
    assert box.run(ToolCall("hang", {"seconds": 0})) == ToolResult("awake")
    assert left_behind(box._sandbox.last) == []


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


def test_without_namespaces_the_folder_goes_and_the_daemon_dies(tmp_path):
    """The fallback: no namespace, only rlimits, the uid and the cleanup; the working
    folder, made read-only, is removed all the same."""
    with Recording(timeout=30.0, spares=0, namespaces=False) as bare:
        guard = bare.protections
        assert not (guard["no_network"] or guard["pid_namespace"] or guard["private_tmp"])
        result = bare.run(
            "import os, time\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\n"
            "os.chmod('a/b', 0o500)\nos.chmod('a', 0o500)\nprint(os.getcwd())\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(30)\n    os._exit(0)")
        assert result.failure is None, result.output
        folder = Path(result.output.strip())
        assert folder.name.startswith("maxent-sandbox-")
        assert left_behind(result) == []
        deadline = time.monotonic() + 10
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not folder.exists()


def test_closing_and_exiting_leave_no_process(tmp_path):
    with Sandbox(timeout=30.0, spares=2) as pool:
        assert pool.run("print(1)").output == "1\n"
        zygote = pool.pid
        spares = [pid for pid, (_, session) in processes().items() if session == pid
                  and _parent(pid) == zygote]
        assert len(spares) >= 1
    ours = {UID_BASE + pid for pid in spares}  # the uids of their calls' processes

    def remaining():
        return [pid for pid, (uid, _) in processes().items()
                if pid == zygote or pid in spares or uid in ours]

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
    if pool.protections["own_uid"] or pool.protections["pid_namespace"]:
        assert result.output.count("Error") == 3
