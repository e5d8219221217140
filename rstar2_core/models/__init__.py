"""Model factories, training backends and checkpoint I/O (HF format, atomic publish).

    from rstar2_core.models import prepare_base_model, load_model_and_tokenizer, save_checkpoint, latest_complete
    from rstar2_core.models.backend import make_backend, TorchBackend, TrainBackend

See docs/models-and-sft.md.
"""

from rstar2_core.models.backend import TorchBackend, TrainBackend, make_backend
from rstar2_core.models.io import (
           latest_complete,
           load_model_and_tokenizer,
           read_extra,
           read_meta,
           save_checkpoint,
)
from rstar2_core.models.prepare import prepare_base_model

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
