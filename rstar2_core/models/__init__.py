"""Model factories, training backends and checkpoint I/O (HF format, atomic publish).

    from rstar2_core.models import prepare_base_model, load_model_and_tokenizer, save_checkpoint, latest_complete
    from rstar2_core.models.backend import make_backend, TorchBackend, TrainBackend

Names are imported on first use (PEP 562): `rstar2_core.models.backend` loads with torch alone (the GPU
check), while checkpoint I/O (fsspec) and `prepare_base_model` (the pydantic config) load when asked for.
See docs/models-and-sft.md.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TorchBackend": "backend", "TrainBackend": "backend", "make_backend": "backend",
    "latest_complete": "io", "load_model_and_tokenizer": "io", "read_extra": "io", "read_meta": "io",
    "save_checkpoint": "io",
    "prepare_base_model": "prepare",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = list(_EXPORTS)
