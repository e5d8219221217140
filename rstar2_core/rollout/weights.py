"""Read a state_dict from an HF checkpoint URI (local path, file:// or s3://) for `update_weights`.

Reads every `*.safetensors` file in the folder (sharded checkpoints included) through
`rstar2_core.storage`, so engines can reload the trainer's checkpoint wherever it was written.
A folder without the `_COMPLETE` marker is refused: it may be half-written.
"""

from __future__ import annotations

import torch
from safetensors.torch import load as load_safetensors

from rstar2_core import storage


def load_state_dict_from_uri(uri: str) -> dict[str, torch.Tensor]:
    if not storage.is_complete(uri):
        raise FileNotFoundError(f"{uri} is not a complete checkpoint (no {storage.COMPLETE_MARKER} marker); "
                                "pass the URL of a checkpoint written by rstar2_core.models.save_checkpoint")
    fs, path = storage.fs_for(uri)
    files = sorted(fs.glob(f"{path.rstrip('/')}/*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files under {uri}; is it an HF checkpoint folder?")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with fs.open(f, "rb") as fh:
            state.update(load_safetensors(fh.read()))
    return state
