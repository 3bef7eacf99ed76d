"""Rank processes forked from a Python that has imported torch, deepspeed and transformers once
(a "zygote"), for ``multirank.start_ranks``.

Why: importing those libraries is most of the CPU time of a short rank, and the suite starts many
ranks (every launch of ``multirank.run_ranks`` / ``train_ranks``). A forked rank starts with them
imported, then runs its script as ``python script args`` would: ``__main__``, ``sys.argv``, a fresh
interpreter's ``sys.path`` (the script's folder, PYTHONPATH, site), its own environment and working
directory, stdout and stderr into one file, exit code 0, that of ``SystemExit``, or 1 after an
uncaught exception's traceback, atexit handlers at the end. The project (tp_trainer) is not
preloaded: every rank imports it afresh, as a launched rank does. Rank r of a launch comes from
zygote r (one per rank index, each with its own hash seed, started on first use), so the ranks of
a launch differ in string hashing (set order) as launched ranks do.

A test hook's folder put in front of PYTHONPATH (tests/fault_hooks: a ``sitecustomize.py`` that an
interpreter imports at start-up, and TP_TEST_FAULT that only it reads) is served too: the forked rank
puts the folder where PYTHONPATH puts it on ``sys.path`` and imports its ``sitecustomize`` before the
script, as a fresh interpreter does. A rank is started the ordinary way (``usable`` false) where its
environment changes anything else an interpreter does before its script runs: any other PYTHON*,
thread-count or library setting read at import (``READ_AT_START``); and every rank where
TP_TEST_FRESH_RANKS=1 (to check that a result does not depend on the forked start).

Run as a script, this file is a zygote: it reads one JSON request a line from the fd in argv[1]
and writes JSON replies to the fd in argv[2]: {"id", "pid"} for each fork, {"pid", "code"} for
each rank that ended.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading

# the libraries a rank imports (transformers' modeling modules and the two families' models, peft,
# datasets: ~3 s of a rank's start that a fresh rank pays again after torch, deepspeed and transformers)
PRELOAD = ("torch", "torch._dynamo", "deepspeed", "transformers", "transformers.modeling_utils",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama", "peft", "datasets")
# the zygotes' own settings: one thread (as multirank gives every rank), unbuffered output
ZYGOTE_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# environment variables that an interpreter or the preloaded libraries read before a script runs:
# a rank whose environment differs from the zygotes' in one of them is started fresh
READ_AT_START = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "LD_", "MALLOC", "TORCH", "PYTORCH",
                 "DS_", "DEEPSPEED", "CUDA", "NVIDIA", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS",
                 "TP_TEST_FAULT")
ZYGOTES = 4   # rank indices served (the tests' largest world); a launch of more ranks starts fresh ones
_LOCK = threading.Lock()
_ZYGOTES: dict[int, "Zygote"] = {}


def usable(env: dict, world_size: int) -> bool:
    """Whether the ranks of a launch of ``world_size`` with environment ``env`` may be forked: no
    TP_TEST_FRESH_RANKS=1, and ``env`` differs from the environment of every zygote they would come
    from (or of one started now) in no variable of ``READ_AT_START``."""
    if os.environ.get("TP_TEST_FRESH_RANKS") == "1" or world_size > ZYGOTES:
        return False
    with _LOCK:
        started = [_ZYGOTES[rank].env for rank in range(world_size) if rank in _ZYGOTES]
    return all(_same_start(env, zygote_env) for zygote_env in started or [{**os.environ, **ZYGOTE_ENV}])


def hook_dirs(env: dict, zygote_env: dict) -> list[str] | None:
    """The test hooks' folders (each holding a ``sitecustomize.py``) that ``env``'s PYTHONPATH puts in
    front of the zygote's PYTHONPATH; None where its PYTHONPATH differs otherwise."""
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    own = [p for p in zygote_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    extra = entries[:len(entries) - len(own)]
    if entries[len(extra):] != own or not all(os.path.isfile(os.path.join(p, "sitecustomize.py")) for p in extra):
        return None
    return extra


def _same_start(env: dict, zygote_env: dict) -> bool:
    changed = {key for key in set(env) | set(zygote_env) if env.get(key) != zygote_env.get(key)}
    hooks = hook_dirs(env, zygote_env)
    if hooks is None:
        return False
    served = {"PYTHONPATH", "TP_TEST_FAULT"} if hooks else {("TP_TEST_FAULT", "")}   # a fault only its hook reads
    return not any(key.startswith(READ_AT_START) for key in changed
                   if key not in served and (key, env.get(key)) not in served)


def prepare(world_size: int) -> None:
    """Start the zygotes of ranks 0 .. world_size - 1 that are not running (they import at once,
    side by side)."""
    with _LOCK:
        for rank in range(world_size):
            if rank not in _ZYGOTES or _ZYGOTES[rank].proc.poll() is not None:
                _ZYGOTES[rank] = Zygote()


def start(rank: int, script: str, args: list[str], env: dict, cwd: str | None, out_path: str) -> "Rank":
    """Fork rank ``rank`` of ``python script args`` (environment ``env``, working directory ``cwd`` or
    this process's) from zygote ``rank`` (``prepare`` first), its stdout and stderr written to ``out_path``."""
    prepare(rank + 1)
    return _ZYGOTES[rank].fork({"script": os.path.abspath(script), "args": list(args), "env": dict(env),
                                "cwd": os.path.abspath(cwd or os.getcwd()), "out": out_path})


class Rank:
    """A forked rank: ``wait(timeout)`` gives its exit code (None while it runs), ``kill()``."""

    def __init__(self):
        self.pid, self.code = None, None
        self.forked, self.ended = threading.Event(), threading.Event()

    def wait(self, timeout: float | None = None) -> int | None:
        if self.ended.wait(timeout) and self.code is None:
            raise RuntimeError(f"the rank zygote ended before its rank (pid {self.pid})")
        return self.code

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Zygote:
    """This process's end of one zygote: requests down one pipe, replies read by a thread."""

    def __init__(self):
        request_r, self._requests = os.pipe()
        self._replies, reply_w = os.pipe()
        self._log = tempfile.TemporaryFile()   # the zygote's own output (import warnings, a failure)
        self.env = {**os.environ, **ZYGOTE_ENV}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(request_r), str(reply_w)],
                                     env=self.env, pass_fds=(request_r, reply_w),
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        os.close(request_r)
        os.close(reply_w)
        self._lock, self._next_id = threading.Lock(), 0
        self._requested: dict[int, Rank] = {}   # request id -> its rank, until the fork reply
        self._running: dict[int, Rank] = {}     # pid -> its rank, until the end reply (pids get reused)
        threading.Thread(target=self._read_replies, daemon=True).start()

    def fork(self, request: dict) -> Rank:
        rank = Rank()
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._requested[request_id] = rank
            data = (json.dumps({"id": request_id, **request}) + "\n").encode()
            while data:
                data = data[os.write(self._requests, data):]
        if not rank.forked.wait(300) or rank.pid is None:
            self._log.seek(0)
            raise RuntimeError(f"the rank zygote (pid {self.proc.pid}) did not fork; its exit code "
                               f"{self.proc.poll()}, its output:\n{self._log.read()[-3000:].decode(errors='replace')}")
        return rank

    def _read_replies(self) -> None:
        with os.fdopen(self._replies, encoding="utf-8") as replies:
            for line in replies:
                reply = json.loads(line)
                with self._lock:
                    if "id" in reply:
                        rank = self._running[reply["pid"]] = self._requested.pop(reply["id"])
                        rank.pid = reply["pid"]
                        rank.forked.set()
                    else:
                        rank = self._running.pop(reply["pid"])
                        rank.code = reply["code"]
                        rank.ended.set()
        with self._lock:   # the zygote is gone: whoever waits for a fork or a rank stops waiting
            for rank in [*self._requested.values(), *self._running.values()]:
                rank.forked.set()
                rank.ended.set()


# ----------------------------------------------------------------------------- the zygote itself
def serve(request_fd: int, reply_fd: int) -> None:
    """Import ``PRELOAD``, then fork a rank for each request and report each rank's end; leave when
    the requests' pipe closes (the test process is gone)."""
    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(request_fd, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                _report_ended(reply_fd)
                continue
            data = os.read(request_fd, 1 << 20)
            if not data:
                os._exit(0)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    try:
                        for fd in (request_fd, reply_fd, wake_r, wake_w):
                            os.close(fd)
                        _run(request)
                    finally:
                        os._exit(1)   # _run leaves itself; this only if it failed before the script
                _reply(reply_fd, {"id": request["id"], "pid": pid})
        _report_ended(reply_fd)


def _reply(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _report_ended(reply_fd: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply(reply_fd, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _run(request: dict) -> None:
    """The forked rank: become ``python script args`` (module docstring) and leave with its exit code."""
    import atexit
    import runpy
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()   # its own session, as a launched rank is not in the zygote's
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    hooks = hook_dirs(request["env"], os.environ)   # judged against the zygote's own PYTHONPATH, still set
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["script"]
    sys.path[0] = os.path.dirname(script)   # the rest is the zygote's: PYTHONPATH (the same, usable) and site
    sys.path[1:1] = hooks   # where PYTHONPATH puts them: after the script's folder
    sys.argv = [script, *request["args"]]
    if hooks:   # site imports the first sitecustomize on the path, before the script
        importlib.import_module("sitecustomize")
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()   # what an interpreter does at exit: its threads joined, then atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
