"""math-verify in a worker process, for the accuracy reward off the main thread.

math-verify limits a parse or a verify with ``signal.alarm``, which only works in the main
thread; in another thread (a reward with ``timeout``, which runs in one) an answer such as
``9**(9*9*9*9*9*9*9*9*9)`` has sympy compute the power in C, holding the GIL, and the whole
training process stops. :class:`Verifier` sends each comparison to a worker process (this
file run as a script: it imports nothing of the package, so no torch), whose main thread
has the limit, and kills the worker when a comparison outlives it anyway; the next
comparison starts a new one. The protocol is one JSON line each way, ``[id, gold,
prediction]`` in and ``[id, verdict]`` out, on a copy of the worker's stdout that nothing
else writes to (what the libraries print goes to stderr).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

__all__ = ["MATH_VERIFY_TIMEOUT_S", "VERIFIER", "Verifier", "math_equal", "reference_answer",
           "serve"]

MATH_VERIFY_TIMEOUT_S = 5
"""Per-call time limit of math-verify's parse and verify. math-verify times out with
``signal.alarm``, which only works in the main thread; elsewhere :class:`Verifier` runs
them in the main thread of a worker process."""


class _Quoted(logging.Filter):
    """math-verify's messages with the text they quote escaped and cut: a timed-out parse
    logged the whole answer, raw, so a completion's terminal escapes and 10 KB a sample
    reached the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.isprintable() or len(text) > 160:
            head, sep, quoted = text.partition(": ")
            text = f"{head}{sep}{quoted!r:.120}" if sep and len(head) < 40 else f"{text!r:.160}"
        record.msg, record.args = text, ()
        return True


for _name in ("math_verify.parser", "math_verify.grader", "math_verify.metric"):
    logging.getLogger(_name).addFilter(_Quoted())  # here and in the worker (math-verify's own)


def _latex(text: str) -> bool:
    """Whether ``text`` is written in LaTeX: a backslash, a brace or ``^`` (``**``: Python)."""
    return "**" not in text and any(c in text for c in "\\^{}")


#: what a formula is written with: digits, letters, operators, brackets, commas
_FORMULA_CHARS = re.compile(r"[\s0-9.,+\-*/=()\[\]a-zA-Z]*")
#: a number with its thousands grouped (``1,000``, ``-12,345.5``): one number, not a list
_GROUPED = re.compile(r"\s*-?\d{1,3}(?:,\d{3})+(?:\.\d+)?\s*")
#: LaTeX's commands, with the argument of ``\\text``, ``\\begin`` and their kin: not prose
_COMMANDS = re.compile(
    r"\\(?:text\w*|math\w*|mbox|operatorname|begin|end)\s*\{[^{}]*\}|\\[a-zA-Z]+")
#: a word in a text, not a LaTeX command's name
_PROSE_WORD = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}(?![a-zA-Z])")
#: a number with a one-letter unit (``4 L``, ``5 m``): a number, not a product
_UNIT = re.compile(r"\s*-?[0-9.,]+\s+[a-zA-Z]\s*")


#: words that are mathematics, not prose
_MATH_WORDS = {"sqrt", "pi", "inf", "infty", "infinity", "oo", "ln", "log", "exp", "sin", "cos",
               "tan"}
#: the longest text with words that is wrapped in ``$...$`` (where math-verify drops the
#: units it knows, ``\\sqrt{2} meters``, but parses prose at about 1.4 ms a character)
WRAP_CHARS = 120


def _words(text: str) -> list[tuple[int, int]]:
    """Where the words of prose in ``text`` are: two letters or more outside LaTeX's commands
    and their text arguments, other than :data:`_MATH_WORDS`."""
    commands = [m.span() for m in _COMMANDS.finditer(text)]  # in order, not overlapping
    starts = [start for start, _ in commands]

    def in_command(at: int) -> bool:
        index = bisect.bisect_right(starts, at) - 1
        return index >= 0 and at < commands[index][1]

    return [m.span() for m in _PROSE_WORD.finditer(text)
            if m.group() not in _MATH_WORDS and not in_command(m.start())]


def _formula(text: str) -> bool:
    """Whether a reference is a formula written without LaTeX: a tuple, a list, an interval,
    a complex number, an expression or equation in letters (``(1, 2)``, ``-2, 3``, ``6-5i``,
    ``y=2x+1``), which math-verify's plain reading would reduce to one of its numbers. A
    number (``18``, ``1,000``, ``3/4``) and prose are not."""
    return ("**" not in text and bool(_FORMULA_CHARS.fullmatch(text))
            and not _GROUPED.fullmatch(text) and not _UNIT.fullmatch(text)
            and not _words(text) and bool(re.search(r"[a-zA-Z,()\[\]]", text)))


#: LaTeX's math delimiters (an unescaped ``$``, ``\\(``, ``\\[``): a text holding one is parsed
#: as it is, not wrapped in ``$...$`` (``\\$18`` and ``\\begin{pmatrix}`` are wrapped)
DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[")
#: Markdown's bold, a pair of ``**`` around a text (``**1/2**``), not Python's power
#: (``9**2``, ``2 ** 3``); ``answers.BOLD`` again, as this script imports nothing of the package
_BOLD = re.compile(r"(?<![\w*])\*\*(?=\S)([^*\n]{1,200}?)(?<=\S)\*\*(?![\w*])")
#: a sentence's last period (``(1, 2).``), which math mode does not read
_PERIOD = re.compile(r"(?<=[^.\s])\.\s*$")
#: ``\\text{...}`` and its kin around words, for the text comparison
_TEXT = re.compile(r"\\(?:text\w*|mathrm|mbox)\s*\{([^{}]*)\}")
#: the square root sign before a number (``10√2``), read as LaTeX's ``\\sqrt``
_ROOT = re.compile(r"√(\d+(?:\.\d+)?)")
#: a number in scientific notation (``3e8``, ``1.5E-3``), not inside a word or a longer number
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[eE]([+-]?\d{1,3})(?![\w.])")
#: the most characters writing out an answer's numbers in scientific notation may add (a
#: model writing ``1e999`` a thousand times made megabytes of digits for math-verify to read
#: and log before its own time limit applied); the numbers past it stay as written
SCIENTIFIC_DIGITS = 4000


def _plain(text: str) -> str:
    """``text`` with its Unicode minus signs as ``-``, ``√2`` as ``\\sqrt{2}``, Markdown's bold
    markers removed and its numbers in scientific notation written out (``3e8`` ->
    ``300000000``, ``1e-05`` -> ``0.00001``) and a last period dropped: math-verify reads
    ``3e8`` as 3, ``−2`` as nothing, ``**1/2**`` as 1 and ``√2`` as 2, and in math mode
    ``(1, 2).`` as nothing. The numbers are written out from the last, while they add at
    most :data:`SCIENTIFIC_DIGITS` characters in all."""
    from decimal import Decimal

    text = _BOLD.sub(r"\1", _PERIOD.sub("", text.replace("\u2212", "-")))
    text = _ROOT.sub(r"\\sqrt{\1}", text)
    room, end, pieces = SCIENTIFIC_DIGITS, len(text), []
    for match in reversed(list(_SCIENTIFIC.finditer(text))):  # the last, the answer, first
        number = format(Decimal(match.group(0)), "f")
        if len(number) - len(match.group(0)) <= room:
            room -= len(number) - len(match.group(0))
            pieces += [text[match.end():end], number]
            end = match.start()
    return text[:end] + "".join(reversed(pieces))


def reference_answer(reference: str) -> str | None:
    """A reference as the accuracy reward grades it: the text after ``####`` when a worked
    solution's last line starts with it (GSM8K's; not in a solution with a ``\\boxed``
    answer, where it is a Markdown heading), else the reference, stripped; None when blank.
    math-verify reads a text's last number, except after the word "answer" (``Sam answered
    20 questions ... #### 35`` was 20) and not ``####72``.

    >>> reference_answer("48+24 = <<48+24=72>>72 clips.\\n####72"), reference_answer(" 5 ")
    ('72', '5')
    """
    last = reference.rstrip().rsplit("\n", 1)[-1].lstrip()  # GSM8K's last line, "#### 72"
    final = last.startswith("####") and "\\boxed" not in reference  # not a MATH heading
    return (last[4:] if final else reference).strip() or None


def math_equal(gold: str, prediction: str, golds: dict | None = None) -> bool:
    r"""Whether math-verify finds ``prediction`` equal to ``gold`` (each parse and each pair
    verify compares limited to :data:`MATH_VERIFY_TIMEOUT_S`, in the main thread only); the
    strings compared with runs of whitespace collapsed when it extracts nothing from either.
    ``golds`` caches the parsed references (one call's; None: no cache).

    When either side is LaTeX (a backslash, a brace or ``^``), or the reference a formula
    written without it (:func:`_formula`: ``(1, 2)``, ``-2, 3``, ``6-5i``, ``2x+1``), both
    are read as math (inside ``$...$``, a bare numeric exponent braced: ``2^-1`` is
    ``2^{-1}``), each as it is when math mode finds nothing in it: math-verify reads LaTeX
    only inside a math environment, and read bare, ``7+\sqrt{2}`` was its leading ``7``,
    ``2^{10}`` was ``2``, ``(1, 2)`` was ``2`` and ``6-5i`` was ``6``. A text with its own
    delimiters (``It is $\sqrt{2}$``) is read as it is; one with words both ways, wrapped
    when it has at most :data:`WRAP_CHARS` characters (``12\pi cubic inches``: math-verify
    drops the units it knows) and as it is, its LaTeX between the words in ``$...$``
    (``0.5 cups``, ``$2\sqrt{3}$ cm``: math-verify finds the math in it, where in ``$...$``
    each word is a product of symbols, and bare it reads LaTeX up to its first command),
    and it is right when either reading is. Other pairs are read as they are: a number
    reference is compared with the answer's last number, as GSM8K is graded (in math mode
    ``9**2`` would be ``9``). Both sides are read as :func:`_plain` writes them."""
    from math_verify import parse, verify  # slow import, only when the reward is used

    gold, prediction = _plain(gold), _plain(prediction)
    latex = _latex(gold) or _latex(prediction) or _formula(gold)

    def readings(text: str) -> list[list]:
        # in math mode wrapped in $...$ (when short, or LaTeX without words), and as it is
        # when that finds nothing or the text has words: its LaTeX between the words in
        # $...$ (bare, math-verify reads LaTeX up to its first command: 2\sqrt{3} cm was 2)
        found, prose = [], bool(_words(text))
        if latex and "**" not in text and not DELIMITED.search(text) and (
                len(text) <= WRAP_CHARS or (_latex(text) and not prose)):
            math = parse("$" + re.sub(r"\^(-?\d+(?:\.\d+)?)", r"^{\1}", text) + "$",
                         parsing_timeout=MATH_VERIFY_TIMEOUT_S)
            if math and not prose:
                return [math]
            found = [math] if math else []
        delimit = prose and _latex(text) and not DELIMITED.search(text)
        bare = parse(_delimited(text) if delimit else text, parsing_timeout=MATH_VERIFY_TIMEOUT_S)
        return found + [bare] if bare else found

    golds = {} if golds is None else golds
    if (gold, latex) not in golds:
        golds[gold, latex] = readings(gold)
    gold_readings, prediction_readings = golds[gold, latex], readings(prediction)
    if gold_readings and prediction_readings:
        return any(verify(g, p, timeout_seconds=MATH_VERIFY_TIMEOUT_S)
                   for g in gold_readings for p in prediction_readings)
    return _as_text(gold) == _as_text(prediction)


def _delimited(text: str) -> str:
    """A LaTeX text with words, each stretch of mathematics between its words
    (:func:`_words`) put in ``$...$``: ``2\\sqrt{3} cm`` -> ``$2\\sqrt{3}$ cm``."""
    pieces, at = [], 0
    for start, end in [*_words(text), (len(text), len(text))]:
        stretch = text[at:start]
        math = stretch.strip(" \t\n,;:.")
        pieces += [stretch.replace(math, f"${math}$", 1) if re.search(r"[0-9\\]", math)
                   else stretch, text[start:end]]
        at = end
    return "".join(pieces)


def _as_text(text: str) -> str:
    """A text answer as the fallback compares it: ``\\text{...}`` unwrapped (a reference
    ``\\text{Evelyn}`` is the name ``Evelyn``), runs of whitespace collapsed."""
    return " ".join(_TEXT.sub(r"\1", text).split())


log = logging.getLogger(__name__)


def _ended(code: int) -> str:
    """A worker's exit as words: a signal by name (SIGKILL: often the OOM killer)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-code).name
            return f"{name}: killed for memory?" if name == "SIGKILL" else name
    return f"exit code {code}"


class Verifier:
    """The worker, started on first use (a second or two: it imports math-verify), one per
    process; calls from several threads take turns.

    Args:
        call_seconds: how long one comparison may take before the worker is killed and the
            answer scores 0.0 (the worker's own limits end each parse, and each of the few
            pairs ``verify`` compares, after :data:`MATH_VERIFY_TIMEOUT_S`).
        start_seconds: how long the worker's start may take.
        command: the worker's command line (default: this file run by this Python).
    """

    def __init__(self, call_seconds: float = 10 * MATH_VERIFY_TIMEOUT_S,
                 start_seconds: float = 120.0, command: list[str] | None = None) -> None:
        self.call_seconds, self.start_seconds = call_seconds, start_seconds
        self.command = command or [sys.executable, os.path.abspath(__file__)]
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._killed: subprocess.Popen | None = None  # the worker _kill ended
        self._stops = 0  # how many times _kill ran
        self._holder: threading.Thread | None = None  # the thread comparing now
        self._buffer = b""
        self._calls = 0

    def equal(self, gold: str, prediction: str) -> bool:
        """Whether math-verify finds ``prediction`` equal to ``gold`` (:func:`math_equal`);
        False when the worker gave no verdict within ``call_seconds`` (it is killed) or
        ended twice on it (a worker found ended is started again, and one that ends during
        the comparison is, once, for it: a killed worker scored right answers 0.0), and for a
        call whose caller stopped waiting (a reward's ``timeout``: its
        thread, ``abandoned``, lives on and held the worker, so each later call timed out)."""
        with self._lock:
            self._holder = threading.current_thread()
            try:
                return False if getattr(self._holder, "abandoned", False) else self._equal(
                    gold, prediction)
            finally:
                self._holder = None

    def _equal(self, gold: str, prediction: str, again: bool = True) -> bool:  # (lock held)
        stops = self._stops
        if self._process is not None and (self._process is self._killed or (
                self._process.poll() is not None)):  # (killed: a stop() while a verdict came)
            if self._process is not self._killed:
                log.warning("the accuracy reward's math-verify worker had ended (%s): started "
                            "again", _ended(self._process.returncode))
            self._close()  # (an answer scored 0.0 by a dead worker was right: a hunt)
        if self._process is None:
            self._start()
        self._calls += 1
        request = json.dumps([self._calls, gold, prediction]) + "\n"
        deadline = time.monotonic() + self.call_seconds
        try:
            self._process.stdin.write(request.encode())
            self._process.stdin.flush()
            while (line := self._read(deadline)) is not None:
                answer = json.loads(line)
                if answer[0] == self._calls:  # an earlier call's late verdict: skipped
                    return bool(answer[1])
        except (OSError, ValueError, IndexError, TypeError):  # the worker ended or garbled
            pass
        died = time.monotonic() < deadline  # its output ended: not a time-out
        self._close()
        if died and again and self._stops == stops and not getattr(
                threading.current_thread(), "abandoned", False):
            # once more on a new worker (an input that itself ends it does so twice); not
            # when _kill ran since this call began (a stop(), an abandoned call's end)
            log.warning("the accuracy reward's math-verify worker ended while comparing "
                        "%.80r with %.80r: once more on a new one", prediction, gold)
            return self._equal(gold, prediction, again=False)
        return False

    def _read(self, deadline: float) -> str | None:
        """The worker's next line, or None when none came by ``deadline`` (or it ended)."""
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def _start(self) -> None:
        self._process = subprocess.Popen(  # its own session: a group's signal (a terminal's
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,  # Ctrl-C, timeout's
            start_new_session=True)  # SIGTERM) is the trainer's to take; stdin's end ends it
        self._buffer = b""
        line = self._read(time.monotonic() + self.start_seconds)
        if line != "ready":
            try:  # its output ended: its exit status follows
                code = self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            self._close()
            raise RuntimeError(
                "the accuracy reward's math-verify worker process (maxent_grpo/rewards/"
                "verify_worker.py) did not start: "
                + (f"it exited with status {code} (its error is above; is math-verify "
                   "installed?)" if code is not None
                   else f"it gave no sign of life within {self.start_seconds:g} s"))

    def release_abandoned(self) -> None:
        """Kill the worker when the comparison it runs is an abandoned call's (the reward
        timed out): the next call starts a new one rather than waiting for it."""
        if getattr(self._holder, "abandoned", False):
            self._kill()

    def stop(self) -> None:
        """End the worker without waiting for a comparison in flight (the end of a run:
        nothing is left running; the next comparison starts a new one)."""
        self._kill()
        if self._lock.acquire(blocking=False):  # else the comparison's thread closes it
            try:
                self._close()
            finally:
                self._lock.release()

    def _kill(self) -> None:
        """Kill the worker, not waiting for the lock: the comparison in flight ends (its
        thread sees the worker gone and closes it)."""
        process = self._killed = self._process
        self._stops += 1
        if process is not None:
            with contextlib.suppress(OSError):
                process.kill()

    def close(self) -> None:
        """End the worker (the next comparison starts a new one)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()
            for pipe in (process.stdin, process.stdout):
                with contextlib.suppress(OSError):  # a dead worker's unsent request
                    pipe.close()

    def _forget(self) -> None:
        """In a forked child: the worker and its pipes are the parent's."""
        self._lock = threading.Lock()
        self._process, self._buffer, self._holder = None, b"", None


#: the process's one worker
VERIFIER = Verifier()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=VERIFIER._forget)


def serve() -> None:
    """The worker: ``[id, gold, prediction]`` JSON lines in (stdin), ``[id, verdict]``
    lines out, on a copy of stdout; file descriptor 1 itself (``print``, a C library's
    output) is pointed at stderr, so nothing else can land among the answers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches this worker
    answers = os.fdopen(os.dup(1), "w")  # too; the trainer, which may finish its batch, ends it
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import math_verify  # noqa: F401 - the slow import, before "ready"

    print("ready", file=answers, flush=True)
    for line in sys.stdin:
        call, gold, prediction = json.loads(line)
        try:
            verdict = math_equal(gold, prediction)
        except Exception:  # noqa: BLE001 - math-verify failing on an answer: not equal
            verdict = False
        try:
            print(json.dumps([call, verdict]), file=answers, flush=True)
        except BrokenPipeError:  # the trainer ended (or killed this worker's call): quietly
            os._exit(0)


if __name__ == "__main__":
    here = os.path.dirname(os.path.realpath(__file__))  # run as a script: its folder is not
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]  # top-level
    serve()
