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
