"""RL log-probs: the packed, segment-attention, chunked computation equals the plain padded one (values and
gradients, fp32, 1e-5) for Qwen2 (tied and untied embeddings), Qwen3 and Llama, with temperature and
padding; and its backward never holds more than one chunk of vocabulary logits."""

from __future__ import annotations

import pytest
import torch
from numerics import same_adam_update
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rstar2_core.rl.logprobs import batch_logprobs, collate
from rstar2_core.rollout.types import Trajectory

V, PAD = 97, 0
SHAPE = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 256}


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False))
    if kind == "qwen2-tied":
        return Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True))
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=8, tie_word_embeddings=True))
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True))     # SmolLM2's family


def _traj(prompt, response) -> Trajectory:
    n = len(response)
    return Trajectory(tuple(prompt), tuple(response), tuple([1] * (n - 1) + [0] * (n > 0)), tuple([-1.0] * n),
                      "", (), 1, 0, "eos", False)


def _trajectories():
    g = torch.Generator().manual_seed(3)
    lens = [(5, 9), (12, 3), (2, 14), (7, 1), (3, 0)]          # prompts and responses of different lengths
    return [_traj(torch.randint(1, V, (p,), generator=g).tolist(), torch.randint(1, V, (r,), generator=g).tolist())
            for p, r in lens]


def _shared_prompt_trajectories():
    """Two GRPO-like groups: every prompt starts with the same 'system turn', each group shares its problem;
    one prompt is a single token longer than the shared part, one response is empty."""
    g = torch.Generator().manual_seed(4)
    rand = lambda n: torch.randint(1, V, (n,), generator=g).tolist()
    system, q1, q2 = rand(11), rand(4), rand(6)
    prompts = [system + q1, system + q1, system + q1, system + q2, system + q2, system[:11] + q2[:1]]
    return [_traj(p, rand(r)) for p, r in zip(prompts, [6, 2, 9, 4, 0, 5])]


def _plain(model, trajs, temperature):
    """The reference: right-padded batch, full (B, L, V) logits, log-softmax, gather."""
    L = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    R = max(len(t.response_ids) for t in trajs)
    ids = torch.full((len(trajs), L), PAD)
    att = torch.zeros((len(trajs), L), dtype=torch.long)
    out = torch.zeros(len(trajs), R)
    for b, t in enumerate(trajs):
        seq = list(t.prompt_ids) + list(t.response_ids)
        ids[b, :len(seq)], att[b, :len(seq)] = torch.tensor(seq), 1
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits.float() / temperature
    lp = logits.log_softmax(-1)
    rows = []
    for b, t in enumerate(trajs):
        P, n = len(t.prompt_ids), len(t.response_ids)
        picked = lp[b, P - 1:P - 1 + n].gather(-1, torch.tensor(t.response_ids)[:, None]).squeeze(-1)
        rows.append(torch.cat([picked, out[b, n:]]))
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["qwen2", "qwen2-tied", "qwen3", "llama"])
@pytest.mark.parametrize("temperature,chunk", [(1.0, None), (0.7, 3)])
@pytest.mark.parametrize("prompts", ["distinct", "shared"])
def test_packed_chunked_logprobs_equal_the_plain_computation(kind, temperature, chunk, prompts):
    model = _model(kind)
    trajs = _trajectories() if prompts == "distinct" else _shared_prompt_trajectories()
    weights = torch.randn(len(trajs), max(len(t.response_ids) for t in trajs),
                          generator=torch.Generator().manual_seed(5))

    def grads(lp):
        model.zero_grad(set_to_none=True)
        (lp * weights).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    batch = collate(trajs, PAD, prefix_len=0 if prompts == "distinct" else 11)
    shared = batch.segments[0].prefix
    assert shared == (0 if prompts == "distinct" else 11)        # the shared prefix is in the row once
    assert batch.input_ids.shape[1] == sum(len(t.prompt_ids) + len(t.response_ids) - shared for t in trajs) + shared
    got = batch_logprobs(model, batch, temperature, chunk_tokens=chunk)
    ref = _plain(model, trajs, temperature)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.allclose(got, ref, atol=1e-5)
    assert torch.all(got[~batch.valid] == 0)                    # 0 beyond each response
    g_got, g_ref = grads(batch_logprobs(model, batch, temperature, chunk_tokens=chunk)), grads(_plain(model, trajs, temperature))
    assert g_got.keys() == g_ref.keys()
    for k in g_ref:
        assert torch.allclose(g_got[k], g_ref[k], atol=1e-5, rtol=1e-4), k
    if kind != "qwen2":                                         # tied: the head's gradient reached the embedding
        assert "lm_head.weight" not in g_got and "model.embed_tokens.weight" in g_got


def test_a_trajectory_gets_the_same_logprobs_whatever_shares_its_micro_batch():
    """With a fixed prefix_len a trajectory's computation does not depend on its micro-batch (a Ray run's
    ranks split the step differently from the local run); prompts that do not share the prefix (the
    padding pass) are packed without one."""
    model = _model("qwen2")
    trajs = _shared_prompt_trajectories()
    alone = [batch_logprobs(model, collate([t], PAD, prefix_len=11), 1.0)[0, :len(t.response_ids)] for t in trajs]
    for group in (trajs, trajs[::-1], trajs[1:4]):
        got = batch_logprobs(model, collate(group, PAD, prefix_len=11), 1.0)
        for b, t in enumerate(group):
            torch.testing.assert_close(got[b, :len(t.response_ids)], alone[trajs.index(t)], rtol=0, atol=2e-6)
    mixed = collate(trajs + _trajectories()[:1], PAD, prefix_len=11)
    assert mixed.segments[0].prefix == 0


def test_backward_keeps_at_most_one_chunk_of_logits():
    """Vocabulary-wide tensors autograd keeps for the backward, summed: the chunked path keeps none (each
    chunk's logits are recomputed in the backward), the plain path keeps the whole (B, L, V) logits."""
    model = _model("qwen2")
    trajs = _trajectories()
    batch = collate(trajs, PAD)
    n_tokens = int(batch.valid.sum())

    def kept_vocab_elements(fn) -> int:
        sizes = [0]

        def pack(t):
            if t.dim() and t.shape[-1] == V and t.data_ptr() != model.lm_head.weight.data_ptr():
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(sizes)

    chunked = kept_vocab_elements(lambda: batch_logprobs(model, batch, 1.0, chunk_tokens=4))
    plain = kept_vocab_elements(lambda: _plain(model, trajs, 1.0))
    assert n_tokens > 20 and chunked == 0 and plain >= n_tokens * V


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_chunked_logprobs_train_the_same_under_deepspeed_zero(dist_env, stage, tmp_path):
    """The backend's model is then a DeepSpeed engine (its `.config` is DeepSpeed's): the decoder, the
    attention switch and the LM head (gathered by ZeRO-3 inside each checkpointed chunk) still give the
    Torch backend's gradient norm and weights after a step."""
    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.models.deepspeed_backend import DeepSpeedBackend

    kw = {"lr": 1e-2, "total_steps": 10, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0,
          "grad_clip": 10.0}
    trajs = _trajectories()
    batch = collate(trajs, PAD)
    weights = torch.randn(batch.valid.shape, generator=torch.Generator().manual_seed(7))

    def step(backend):
        lp = batch_logprobs(backend.model, batch, 0.7, chunk_tokens=5)
        backend.backward((lp * weights).sum())
        return lp.detach(), float(backend.step())

    ref = TorchBackend(_model("qwen2-tied"), **kw)
    ref_lp, ref_norm = step(ref)
    ds = DeepSpeedBackend(_model("qwen2-tied"), zero_stage=stage, **kw)
    try:
        lp, norm = step(ds)
        assert torch.allclose(lp, ref_lp, atol=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)
        if stage == 3:
            ds.save_hf(tmp_path / "z3")
            got = Qwen2ForCausalLM.from_pretrained(tmp_path / "z3").state_dict()
        else:
            got = ds.model.module.state_dict()
        w0 = _model("qwen2-tied").state_dict()
        for k, v in ref.model.state_dict().items():
            assert same_adam_update(got[k] - w0[k], v - w0[k], kw["lr"]), k
    finally:
        ds.close()


def _update_weights(backend, trajs, micro_batch_size):
    from rstar2_core.rl.trainer import rl_update

    advs = [1.0, -0.5, 0.25, -1.0, 0.5][:len(trajs)]
    m = rl_update(backend, trajs, advs, pad_id=PAD, temperature=0.7, micro_batch_size=micro_batch_size)
    inner = getattr(backend.model, "module", backend.model)
    return m, {k: v.detach().clone() for k, v in inner.state_dict().items()}


def test_gradient_checkpointing_gives_the_same_update_on_packed_micro_batches():
    """The backward re-runs checkpointed layers: they must see the same segment attention as the forward."""
    from rstar2_core.models.backend import TorchBackend

    kw = {"lr": 1e-2, "total_steps": 10, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0,
          "grad_clip": 10.0}
    trajs = _trajectories()
    ref_m, ref_w = _update_weights(TorchBackend(_model("qwen2"), **kw), trajs, 3)
    model = _model("qwen2")
    backend = TorchBackend(model, gradient_checkpointing=True, **kw)     # the config's path
    assert getattr(model, "is_activation_checkpointing", False) or model.is_gradient_checkpointing   # 5.17: only the latter
    m, w = _update_weights(backend, trajs, 3)
    assert m["actor/grad_norm"] == pytest.approx(ref_m["actor/grad_norm"], rel=1e-5) and ref_m["actor/grad_norm"] > 0
    for k, v in ref_w.items():
        torch.testing.assert_close(w[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_rl_update_over_several_micro_batches_matches_torch_under_deepspeed_zero(dist_env, stage):
    """Micro-batch gradients accumulate under ZeRO-2/3 as on the Torch backend (the forward goes through the
    DeepSpeed engine, whose bookkeeping decides whether a micro-batch's gradients add or replace)."""
    from rstar2_core.models.backend import TorchBackend
    from rstar2_core.models.deepspeed_backend import DeepSpeedBackend

    kw = {"lr": 1e-2, "total_steps": 10, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0,
          "grad_clip": 10.0}
    trajs = _trajectories()
    ref_m, ref_w = _update_weights(TorchBackend(_model("qwen2-tied"), **kw), trajs, 2)
    ds = DeepSpeedBackend(_model("qwen2-tied"), zero_stage=stage, **kw)
    try:
        m, _ = _update_weights(ds, trajs, 2)
        assert m["actor/micro_batches"] == 3.0
        assert m["actor/grad_norm"] == pytest.approx(ref_m["actor/grad_norm"], rel=1e-4)
        if stage == 3:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                ds.save_hf(tmp)
                got = Qwen2ForCausalLM.from_pretrained(tmp).state_dict()
        else:
            got = ds.model.module.state_dict()
        for k, v in ref_w.items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5)
    finally:
        ds.close()
