"""The child side of one tool call, run in the fresh process the zygote cloned (sbx_zygote.py; it
inherits the template's seccomp filter): isolate (its own /tmp and /proc, its slot's network
namespace, rlimits, uid, no capabilities, no_new_privs, environment, stdio), then run the program as
__main__ and print the repr of a last expression, as a notebook would. The child always ends in os._exit, never in the template's frames
or the interpreter's exit path (no atexit handler of the program runs). Standard library only; loaded
by template.py."""

from __future__ import annotations

import os
import resource
import signal
import sys

import sbx_isolation as iso

EXIT_MEMORY = 109   # the child runtime's code for "MemoryError" (reported as exit code 1)
EXIT_SETUP = 110    # the child could not set itself up: the service's fault (status internal)
CODE_FD = 3         # where the child finds the code pipe (after stdin, stdout, stderr)
FILENAME = "<tool>"
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "PYTHONIOENCODING": "utf-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
             "MKL_NUM_THREADS": "1"}


_CHILD_STDIO: tuple = ()


def init_stdio() -> None:
    """Build the children's stdio once, in the template (see make_child_stdio)."""
    global _CHILD_STDIO
    _CHILD_STDIO = make_child_stdio()


def make_child_stdio() -> tuple:
    """Text streams on fds 0-2 for the children, built once in the template (they hold no data until a
    child writes, and building them in every child cost ~0.7 ms of its ~3 ms)."""
    import io

    # Built while fds 0-2 are pipes, as in the children: the streams cache "not seekable".
    saved = [os.dup(fd) for fd in range(3)]
    r, w = os.pipe()
    for fd, src in ((0, r), (1, w), (2, w)):
        os.dup2(src, fd)
    try:
        streams = (io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8",
                                    errors="replace"),
                   io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8",
                                    errors="backslashreplace"),
                   io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
                                    errors="backslashreplace", line_buffering=True))
        for st in streams:
            assert not st.seekable()
    finally:
        for fd in range(3):
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
        os.close(r)
        os.close(w)
    return streams


def run_child(req: dict, fds: tuple[int, int, int, int], as_base: int, conf: dict, netfd: int) -> None:
    """Runs in the fresh child (cloned by the zygote, sbx_zygote.py): isolate, read the program from
    the code pipe, run it. Never returns. `req`: the call's spec (slot, uid, cwd, limits; no code);
    `fds`: stdin, stdout, stderr and the code pipe's read end; `conf`: the per-call set-up (`tmp_opts`: mount a private
    /tmp in the call's own mount namespace, `proc`: and a /proc); `netfd`: this slot's network
    namespace or -1."""
    try:
        cwd, uid = req["cwd"], req["uid"]
        iso.libc.prctl(iso.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.setsid()
        if netfd >= 0:   # before the dup2s: fd CODE_FD may be one of the zygote's
            iso.setns(netfd, iso.CLONE_NEWNET)
        for target, fd in enumerate(fds):   # every source fd is > 2 and CODE_FD comes last
            os.dup2(fd, target)
        os.closerange(CODE_FD + 1, 1 << 20)   # the zygote's fds (its host /proc included) stay with it
        if conf["tmp_opts"] is not None:
            owner = b",uid=%d,gid=%d" % (uid, uid) if uid is not None else b""
            iso.mount_call_dirs(conf["tmp_opts"] + owner, conf["proc"], conf["tmp_links"])
        else:
            os.mkdir(cwd, 0o700)
            if uid is not None:
                os.chown(cwd, uid, uid)
        os.chdir(cwd)
        mem = as_base + int(req["memory_mb"]) * (1 << 20)
        cpu = max(1, int(req["cpu_s"] + 0.999))
        for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, int(req["fsize_mb"]) << 20), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NOFILE, 256)):
            resource.setrlimit(lim, (val, val))
        if uid is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (req["nproc"], req["nproc"]))
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            iso.libc.prctl(iso.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a uid change cleared it
        iso.drop_caps()
        iso.libc.prctl(iso.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)   # the seccomp filter came with the fork
        os.environ.clear()
        os.environ.update(CHILD_ENV, HOME=cwd, TMPDIR=cwd, PWD=cwd)
        sys.stdin, sys.stdout, sys.stderr = _CHILD_STDIO
        sys.argv = [""]
    except BaseException as e:  # noqa: BLE001 - any set-up failure is the service's fault
        os.write(2, f"sandbox set-up failed: {type(e).__name__}: {e}\n".encode())
        os._exit(EXIT_SETUP)
    # The child never leaves this function but through os._exit: an exception that escaped into the
    # template's frames (below this one) would run the interpreter's exit path in the child, the
    # program's atexit handlers included, and print the template's traceback.
    rc = 1
    try:
        rc = _run_program(_read_code())
    except BaseException as e:  # noqa: BLE001 - e.g. raised by the program's trace function or its threads
        rc = EXIT_MEMORY if isinstance(e, MemoryError) else 1
        _print_exception(e)
        _flush(rc)
    finally:
        while True:   # a retry per exception raised here (a profile function raising is then unset)
            try:
                sys.settrace(None)
                sys.setprofile(None)
                os._exit(rc)
            except BaseException:  # noqa: BLE001, S110 - nothing of the program may run past this point
                pass


def _read_code() -> str:
    """The program, from the code pipe: an 8-byte length, then the UTF-8 text (surrogatepass: lone
    surrogates reach the parser as they were sent). Read as the call's uid, under its limits."""
    chunks = []
    while True:
        data = os.read(CODE_FD, 1 << 20)
        if not data:
            break
        chunks.append(data)
    os.close(CODE_FD)
    raw = b"".join(chunks)
    if len(raw) < 8 or int.from_bytes(raw[:8], "big") != len(raw) - 8:   # the template died while writing it
        os.write(2, b"sandbox set-up failed: the program's code arrived incomplete\n")
        os._exit(EXIT_SETUP)
    return raw[8:].decode("utf-8", "surrogatepass")


def _run_program(code: str) -> int:
    """Execute `code` as __main__; if its last statement is an expression, print its repr (notebook)."""
    import ast
    import builtins
    import linecache
    import traceback
    import types

    reserve = bytearray(64 << 10)  # freed on MemoryError so the traceback can still be printed
    rc = 0
    try:
        try:
            tree = ast.parse(code, FILENAME, "exec")
        except (SyntaxError, ValueError) as e:
            sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
            return _flush(1)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        exec(compile(tree, FILENAME, "exec"), main.__dict__)  # noqa: S102 - running it is the point
        if last is not None:
            value = eval(compile(last, FILENAME, "eval"), main.__dict__)
            if value is not None:
                print(repr(value))
    except SystemExit as e:
        rc = _exit_code(e)
    except MemoryError as e:
        del reserve
        _print_exception(e)
        rc = EXIT_MEMORY
    except BaseException as e:  # noqa: BLE001 - the program's own exception, reported like python does
        _print_exception(e)
        rc = 1
    if "threading" in sys.modules:  # wait for non-daemon threads, as the interpreter would
        try:
            sys.modules["threading"]._shutdown()
        except BaseException:  # noqa: BLE001, S110 - the program's threads are its own business
            pass
    return _flush(rc)


def _exit_code(e: SystemExit) -> int:
    """The exit status of `raise SystemExit(code)`, as python gives it; a code that is not an int is
    printed (its str(), which is the program's code and may raise) and gives 1."""
    try:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return int.__and__(code, 0xFF)   # not code & 0xFF: an int subclass may override __and__
        text = str.__str__(str(code))        # an exact str, whatever __str__ returned
    except BaseException:  # noqa: BLE001 - a hostile code object: report that it could not be printed
        text = "<exception str() failed>"
    _write_err(text + "\n")
    return 1


def _print_exception(e: BaseException) -> None:
    """The program's traceback from its own first frame, on sys.stderr (the real fd 2 if the program
    broke sys.stderr); never raises."""
    try:
        import traceback

        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
            tb = tb.tb_next
        text = "".join(traceback.format_exception(type(e), e, tb))
    except BaseException:  # noqa: BLE001 - e.g. a hostile __notes__ or exception type
        text = "<the program's exception could not be formatted>\n"
    _write_err(text)


def _write_err(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - the program replaced or closed sys.stderr
        try:
            os.write(2, text.encode("utf-8", "backslashreplace"))
        except BaseException:  # noqa: BLE001, S110 - fd 2 closed too: nothing left to tell
            pass


def _flush(rc: int) -> int:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001, S110 - a closed or broken pipe: nothing left to tell
            pass
    return rc


