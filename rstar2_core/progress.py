"""Progress bars that stay cheap when nobody watches a terminal: `progress_bar(**tqdm_kwargs)`.

On a terminal a bar redraws up to 10 times a second (tqdm's default). Written to a file or a pipe (a
stage task's stderr: Ray forwards each write through its log monitor and GCS to the flow process,
whose output the Prefect worker copies into its log) it redraws at most every `RSTAR2_PROGRESS_S`
seconds (default 10): each redraw wakes four processes, and on the demo's 2 cores every wake-up takes a
core from the stage's two torch threads, whose step then waits for the preempted one. tqdm still
redraws at least every `maxinterval` (10 s) once an update arrives and at close, so the log keeps the
rate and the ETA. See docs/training-speed.md.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV = "RSTAR2_PROGRESS_S"
TERMINAL_INTERVAL_S = 0.1


def redraw_interval(stream: Any = None) -> float:
    """Seconds between redraws of a bar on `stream` (default stderr): 0.1 on a terminal, else $RSTAR2_PROGRESS_S or 10."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        return TERMINAL_INTERVAL_S
    raw = os.environ.get(ENV, "10")
    try:
        value = float(raw)
    except ValueError as err:
        raise ValueError(f"{ENV}={raw!r} is not a number of seconds; unset it or give e.g. {ENV}=10") from err
    if value < 0:
        raise ValueError(f"{ENV}={raw!r} must be >= 0 seconds")
    return value


def progress_bar(iterable: Any = None, **kwargs: Any):
    """`tqdm(iterable, **kwargs)` with `mininterval` from `redraw_interval` unless given. `disable=None`
    (tqdm: off when the stream is not a terminal) is refused: a stage's stderr under Prefect or Ray is
    never a terminal, so it would hide the bar, and its ETA, in exactly the logs where it is read."""
    from tqdm import tqdm

    if "disable" in kwargs and kwargs["disable"] is None:
        raise ValueError("progress_bar(disable=None) would hide the bar wherever stderr is not a terminal "
                         "(every stage log); pass a bool")
    kwargs.setdefault("mininterval", redraw_interval(kwargs.get("file")))
    return tqdm(iterable, **kwargs)
