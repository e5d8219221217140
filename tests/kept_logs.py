"""A folder of logs a module's tests share (a local cluster's node logs), kept when one of them failed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def kept_if_a_test_fails(request, root: str | Path, what: str) -> Iterator[Path]:
    """Yield `root`; on the way out (a module fixture's teardown) remove it, unless a test failed meanwhile:
    then print where `what` is kept."""
    failed = request.session.testsfailed
    try:
        yield Path(root)
    finally:
        if request.session.testsfailed > failed:
            print(f"a test failed: {what} kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
