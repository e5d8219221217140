"""Model factories, training backends and checkpoint I/O (HF format, atomic publish).

    from rstar2_core.models import prepare_base_model, load_model_and_tokenizer, save_checkpoint, latest_complete
    from rstar2_core.models.backend import make_backend, TorchBackend, TrainBackend

Names are imported on first use (PEP 562): `rstar2_core.models.backend` loads with torch alone (the GPU
check), while checkpoint I/O (fsspec) and `prepare_base_model` (the pydantic config) load when asked for.
See docs/models-and-sft.md, "Models".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rstar2_core.lazy_exports import lazy_exports

_EXPORTS = {
    "TorchBackend": "backend", "TrainBackend": "backend", "make_backend": "backend",
    "latest_complete": "io", "load_model_and_tokenizer": "io", "read_extra": "io", "read_meta": "io",
    "save_checkpoint": "io",
    "prepare_base_model": "prepare",
}
__all__ = [
    "TorchBackend",
    "TrainBackend",
    "latest_complete",
    "load_model_and_tokenizer",
    "make_backend",
    "prepare_base_model",
    "read_extra",
    "read_meta",
    "save_checkpoint",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from rstar2_core.models.backend import TorchBackend, TrainBackend, make_backend
    from rstar2_core.models.io import (
        latest_complete,
        load_model_and_tokenizer,
        read_extra,
        read_meta,
        save_checkpoint,
    )
    from rstar2_core.models.prepare import prepare_base_model
