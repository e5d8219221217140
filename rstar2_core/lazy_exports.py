"""Package names imported on first use (PEP 562), so importing a package runs none of its submodules.

    __getattr__, __dir__ = lazy_exports(__name__, {"HFEngine": "hf_engine", ...})

`from pkg import Name` then imports `pkg.<module>` when `Name` is first asked for, and caches it in the
package namespace; `from pkg import submodule` still works (the import system falls back to it).
Why it matters: docs/production.md, "GPU check" (its modules load without prefect/ray/mlflow).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(__getattr__, __dir__) for `package`; where: exported name -> submodule (relative to the package)."""

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
