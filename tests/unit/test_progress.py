"""Progress bars redraw often on a terminal and rarely in logs."""

import io

import pytest

from rstar2_core.progress import ENV, progress_bar, redraw_interval


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_redraws_often_on_a_terminal_and_rarely_in_a_log(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert redraw_interval(_Tty()) == 0.1
    assert redraw_interval(io.StringIO()) == 10.0
    monkeypatch.setenv(ENV, "2.5")
    assert redraw_interval(io.StringIO()) == 2.5 and redraw_interval(_Tty()) == 0.1
    log = io.StringIO()
    bar = progress_bar(total=1000, file=log, desc="x")
    assert bar.mininterval == 2.5
    for _ in range(1000):
        bar.update(1)                     # a thousand quick updates: one redraw at the start, one at close
    bar.close()
    assert log.getvalue().count("\r") <= 3 and "1000/1000" in log.getvalue()
    assert progress_bar(total=1, file=log, mininterval=0.5).mininterval == 0.5    # an explicit value wins


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_a_bad_interval_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError, match=ENV):
        redraw_interval(io.StringIO())


def test_a_bar_that_would_hide_itself_off_a_terminal_is_refused():
    # tqdm's disable=None turns the bar off whenever the stream is not a terminal: every stage log
    with pytest.raises(ValueError, match="disable=None"):
        progress_bar(total=3, file=io.StringIO(), disable=None)
    log = io.StringIO()
    with progress_bar(total=3, file=log, desc="rl-stage-1", unit="step") as bar:
        bar.update(3)
    assert "rl-stage-1" in log.getvalue() and "3/3" in log.getvalue()


def test_no_stage_asks_for_a_bar_that_hides_itself():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    hits = [str(p.relative_to(root)) for d in ("rstar2_core", "tasks", "flows", "rstar2_cli")
            for p in (root / d).rglob("*.py") if "disable=None" in p.read_text()]
    assert hits == ["rstar2_core/progress.py"], hits
