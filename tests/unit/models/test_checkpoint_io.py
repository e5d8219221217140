"""Checkpoint I/O: HF round trip, extra files and meta, interrupted writes ignored by readers."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rstar2_core import storage
from rstar2_core.models.io import (
    latest_complete,
    load_model_and_tokenizer,
    publish_copy,
    read_extra,
    read_meta,
    save_checkpoint,
)


def _tiny_model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg)


def test_save_then_load_round_trip(tmp_path):
    m = _tiny_model()
    url = (tmp_path / "run" / "step-000001").as_uri()
    save_checkpoint(m, None, url, extra={"trainer.pt": b"abc"}, meta={"step": 1})
    assert storage.is_complete(url)
    assert read_extra(url, "trainer.pt") == b"abc" and read_meta(url) == {"step": 1}
    m2 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "step-000001"))
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k


def test_latest_complete_orders_by_step_and_skips_incomplete(tmp_path):
    run = tmp_path / "run"
    m = _tiny_model()
    for step in (2, 10):
        save_checkpoint(m, None, (run / f"step-{step:06d}").as_uri(), meta={"step": step})
    assert latest_complete(run.as_uri()).endswith("step-000010")
    # A write interrupted midway: files copied but no _COMPLETE marker (a crash before the rename/marker).
    broken = run / "step-000020"
    shutil.copytree(run / "step-000010", broken)
    (broken / storage.COMPLETE_MARKER).unlink()
    (broken / "model.safetensors").write_bytes(b"half")
    # A staging temp folder left behind by a killed writer.
    shutil.copytree(run / "step-000010", run / ".step-000030.abcd.tmp")
    assert latest_complete(run.as_uri()).endswith("step-000010")
    with pytest.raises(FileNotFoundError, match="latest_complete"):
        load_model_and_tokenizer(broken.as_uri())
    assert latest_complete((tmp_path / "nothing").as_uri()) is None


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    m = _tiny_model()
    url = (tmp_path / "run" / "step-000001").as_uri()
    save_checkpoint(m, None, url, meta={"step": 1})

    def boom(*a, **k):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(storage, "upload_dir", boom)   # after the weights, before the tokenizer and marker
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(m, None, (tmp_path / "run" / "step-000002").as_uri(), meta={"step": 2})
    with pytest.raises(KeyboardInterrupt):                  # overwriting the complete one fails too
        save_checkpoint(m, None, url, meta={"step": 9})
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["step-000001"]   # no staging folder left
    assert latest_complete((tmp_path / "run").as_uri()) == url
    assert json.loads((tmp_path / "run" / "step-000001" / storage.COMPLETE_MARKER).read_text()) == {"step": 1}


def test_extra_names_must_be_plain(tmp_path):
    with pytest.raises(ValueError, match="plain file name"):
        save_checkpoint(_tiny_model(), None, (tmp_path / "c").as_uri(), extra={"../x": b""})


def test_concurrent_loads_of_one_checkpoint_all_get_real_weights(tmp_path):
    """transformers' loader is not thread-safe: 8 threads loading one tied-embedding checkpoint at once
    left lm_head on the meta device ("Cannot copy out of meta tensor") in every thread without
    `FROM_PRETRAINED_LOCK` (seen in CI: an evaluation beside the hard-subset sampling, both Prefect threads)."""
    import threading

    from rstar2_core.models.tokenizer import bootstrap_tokenizer

    tok = bootstrap_tokenizer()
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=4, intermediate_size=176, max_position_embeddings=256,
                                     tie_word_embeddings=True))
    url = (tmp_path / "ck").as_uri()
    save_checkpoint(m, tok, url)
    loaded, errors = [], []

    def load():
        try:
            loaded.append(load_model_and_tokenizer(url)[0])
        except Exception as e:      # noqa: BLE001 - collected and asserted below
            errors.append(repr(e))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]
    assert len(loaded) == 8
    for mm in loaded:
        assert not any(p.is_meta for p in mm.parameters())
        assert torch.equal(mm.lm_head.weight, m.model.embed_tokens.weight)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_published_copy_has_the_files_of_its_source_and_its_own_state_and_meta(where, tmp_path, request,
                                                                              monkeypatch):
    """What a stage's final checkpoint is: its last step's checkpoint copied (hard links locally, a
    server-side copy on S3: the weights are never uploaded again) with its own extra file and meta."""
    if where == "s3":
        import boto3

        endpoint = request.getfixturevalue("s3_endpoint")
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="ckpt")
        root = "s3://ckpt/run"
    else:
        root = (tmp_path / "run").as_uri()
    src, dst = storage.join(root, "steps", "step-000002"), storage.join(root, "final")
    save_checkpoint(_tiny_model(), None, src, extra={"rl_state.pt": b"step"}, meta={"step": 2})
    fs, _ = storage.fs_for(src)
    put = fs.put_file
    uploaded: list[str] = []
    monkeypatch.setattr(fs, "put_file", lambda lpath, rpath, **kw: uploaded.append(rpath) or put(lpath, rpath, **kw))
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        publish_copy(storage.join(root, "steps", "step-000001"), dst)
    assert publish_copy(src, dst, extra={"rl_state.pt": b"final"}, meta={"steps": 2}) == dst
    assert read_meta(dst) == {"steps": 2} and read_extra(dst, "rl_state.pt") == b"final"
    assert read_extra(src, "rl_state.pt") == b"step" and read_meta(src) == {"step": 2}
    for name in ("model.safetensors", "config.json"):
        assert storage.read_bytes(storage.join(dst, name)) == storage.read_bytes(storage.join(src, name))
    assert all(u.endswith("rl_state.pt") for u in uploaded), uploaded   # only the copy's own state went up
    if where == "local":
        run = tmp_path / "run"
        assert (run / "steps/step-000002/model.safetensors").stat().st_ino == (run / "final/model.safetensors").stat().st_ino
