"""What the tool does with a program: output, status, stdin, repr of the last expression, encodings."""

from __future__ import annotations

import asyncio

from rstar2_core.sandbox import ExecutionRequest, Status


def run(sb, code: str, stdin: str = "", rid: str = "t"):
    return sb.run_sync(ExecutionRequest(code=code, stdin=stdin, id=rid))


def test_stdout_and_ok_status(sb):
    r = run(sb, "print(sum(range(1000)))", rid="sum")
    assert (r.id, r.status, r.stdout, r.stderr, r.exit_code, r.truncated) == ("sum", Status.OK, "499500\n", "", 0, False)
    assert r.duration_s > 0


def test_last_expression_repr_like_a_notebook(sb):
    assert run(sb, "x = 2\nx * 21").stdout == "42\n"
    assert run(sb, "'s'").stdout == "'s'\n"
    assert run(sb, "print('a')").stdout == "a\n"          # the call's value is None: nothing more
    assert run(sb, "None").stdout == ""
    assert run(sb, "for i in range(2):\n    i").stdout == ""  # last statement is not an expression


def test_exception_gives_error_with_type_line_and_message(sb):
    r = run(sb, "x = 1\nraise ValueError('boom')\n")
    assert r.status is Status.ERROR and r.exit_code == 1
    assert 'line 2' in r.stderr and "ValueError: boom" in r.stderr
    assert "template.py" not in r.stderr  # the service's own frames are not shown


def test_syntax_error_and_exit_codes(sb):
    r = run(sb, "def f(:\n")
    assert r.status is Status.ERROR and "SyntaxError" in r.stderr
    assert run(sb, "import sys; sys.exit(3)").exit_code == 3
    assert run(sb, "import sys; sys.exit(0)").status is Status.OK
    r = run(sb, "import sys; sys.exit('bye')")
    assert (r.status, r.stderr) == (Status.ERROR, "bye\n")


def test_stdin_is_fed_to_the_program(sb):
    assert run(sb, "a, b = map(int, input().split())\nprint(a + b)", stdin="3 4\n").stdout == "7\n"
    big = "x" * 3_000_000  # larger than a pipe buffer: written incrementally
    r = run(sb, "import sys; print(len(sys.stdin.read()))", stdin=big)
    assert r.stdout == "3000000\n"
    assert run(sb, "import sys; print(repr(sys.stdin.read()))").stdout == "''\n"


def test_unicode_and_binary_output(sb):
    r = run(sb, "import sys\nprint('héllo ✓ 中文')\nsys.stdout.flush()\nsys.stdout.buffer.write(b'\\xff\\xfeok\\n')\n"
                "print('ошибка', file=sys.stderr)")
    assert r.status is Status.OK
    assert r.stdout == "héllo ✓ 中文\n\ufffd\ufffdok\n"
    assert r.stderr == "ошибка\n"


def test_heavy_modules_run_in_the_preloaded_template(sb):
    r = run(sb, "import sympy\nsympy.factorint(2**64 + 1)")
    assert r.status is Status.OK and r.stdout == "{274177: 1, 67280421310721: 1}\n"
    assert "sympy" in sb.features["heavy"]["preloaded"]


def test_async_run_batch_keeps_order(sb):
    reqs = [ExecutionRequest(code=f"print({i} * {i})", id=f"r{i}") for i in range(20)]

    async def go():
        return await sb.run_batch(reqs), await sb.run(ExecutionRequest(code="1 + 1", id="one"))

    batch, one = asyncio.run(go())
    assert [r.id for r in batch] == [f"r{i}" for i in range(20)]
    assert [r.stdout for r in batch] == [f"{i * i}\n" for i in range(20)]
    assert (one.id, one.stdout) == ("one", "2\n")


def test_bad_request_objects_are_answered_invalid(sb):
    r = sb.run_sync(ExecutionRequest(code=None, id="x"))  # type: ignore[arg-type]
    assert r.status is Status.INVALID_REQUEST and "code" in r.stderr and r.id == "x"
    r = sb.run_sync({"code": "print(1)"})  # type: ignore[arg-type]
    assert r.status is Status.INVALID_REQUEST and "ExecutionRequest" in r.stderr


def test_lone_surrogates_in_code_or_stdin_do_not_break_the_service(sb):
    r = run(sb, "import sys; print(repr(sys.stdin.read()))", stdin="a\ud800b")
    assert r.status is Status.OK and r.stdout.startswith("'a") and "b'" in r.stdout
    r = run(sb, "print('\ud800')")
    assert r.status in (Status.ERROR, Status.OK)
    assert run(sb, "print('still fine')").stdout == "still fine\n"
    assert sb.stats().get("sandbox/template_deaths", 0) == 0


_ATEXIT = "import atexit, sys\natexit.register(lambda: print('ATEXIT RAN', flush=True))\n"
_ESCAPES = {   # each one escaped the program's runner into the template's frames in the child (review t7)
    "SystemExit with a hostile __str__": (
        "class E:\n    def __str__(self):\n        raise ZeroDivisionError('boom')\nraise SystemExit(E())",
        Status.ERROR, "<exception str() failed>"),
    "MemoryError with a broken sys.stderr": (
        ("class W:\n    def write(self, x):\n        raise RuntimeError('w')\n    flush = write\n"
         "sys.stderr = W()\nraise MemoryError('big')"), Status.MEMORY, "MemoryError: big"),
    "a trace function raising in the runner": (
        ("def tr(frame, event, arg):\n    if frame.f_code.co_name == '_flush':\n        raise RuntimeError('trace')\n"
         "sys.settrace(tr)"), Status.ERROR, "RuntimeError: trace"),
}


def test_the_child_never_runs_past_the_program(sb):
    """Whatever the program raises or breaks, the child ends in os._exit: its atexit handlers do not
    run, no frame of the template is shown, the call is answered, and the next call works."""
    for name, (code, status, stderr) in _ESCAPES.items():
        r = run(sb, _ATEXIT + code, rid=name)
        assert (r.status, r.exit_code) == (status, 1), (name, r)
        assert "ATEXIT" not in r.stdout and "template.py" not in r.stderr and "sbx_child" not in r.stderr, (name, r)
        assert stderr in r.stderr, (name, r.stderr)
        assert run(sb, "print(6 * 7)").stdout == "42\n", name


def test_the_child_never_runs_past_a_program_that_closed_fds_1_and_2(sb):
    """As above (review t7: the runner's report of the exception failed on the closed fds), with a copy
    of fd 1 kept by the program: an atexit handler that ran would write on it, and nothing else may."""
    code = ("import atexit, os\nkeep = os.dup(1)\natexit.register(lambda: os.write(keep, b'ATEXIT RAN\\n'))\n"
            "os.write(keep, b'kept\\n')\nos.close(1)\nos.close(2)\nraise ValueError('x')")
    r = run(sb, code)
    assert (r.status, r.exit_code, r.stdout, r.stderr) == (Status.ERROR, 1, "kept\n", ""), r
    assert run(sb, "print(6 * 7)").stdout == "42\n"
