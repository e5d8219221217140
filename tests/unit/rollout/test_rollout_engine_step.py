"""The engine's decode step pieces: the counter-based sampler (reference RNG, distribution, logprob
convention, row independence), the prefill/decode masks, batched prefill, static-shape buckets, the
version-proof model call, the shared-prefix decode attention and the CUDA-graph bookkeeping (the capture
itself needs a GPU)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from rollout_fakes import tiny_model

from rstar2_core.rollout.hf_engine import HFEngine
from rstar2_core.rollout.kv_cache import MIN_BUCKET, SlotKVCache, bucket
from rstar2_core.rollout.model_call import cache_kwarg, check_model
from rstar2_core.rollout.sampling import counter_uniform, reference_uniform, sample_rows, seed_value
from rstar2_core.rollout.shared_prefix import PrefixBlock, SharedPrefix, shared_prefix_attention_forward
from rstar2_core.rollout.types import SamplingParams

# chi-square critical values at p = 0.001 (df -> value): a correct sampler exceeds them with probability 0.001
CHI2_999 = {2: 13.82, 3: 16.27, 11: 31.26}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_counter_uniform_is_splitmix64():
    seeds = [0, 1, 42, 2**63 - 1, -(2**63), seed_value(2**64 - 1), seed_value(2**70 + 5)]
    counters = [0, 1, 5, 2**31 + 7, 2**40, 3, 1000]
    got = counter_uniform(torch.tensor(seeds), torch.tensor(counters)).tolist()
    assert got == [reference_uniform(s, c) for s, c in zip(seeds, counters)]
    # SplitMix64's first output for seed 0 (a published test vector: 0xE220A8397B1DCDAF), top 53 bits
    assert reference_uniform(0, 0) == (0xE220A8397B1DCDAF >> 11) * 2.0 ** -53
    u = counter_uniform(torch.full((20_000,), 7), torch.arange(20_000))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.01


def test_sampling_distribution_matches_softmax_at_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2, -0.5, 0.8, -2.0, 0.1])
    n, temp = 20_000, 0.7
    rows = logits.expand(n, -1)
    u = counter_uniform(torch.arange(n), torch.zeros(n, dtype=torch.long))
    tokens, logprobs = sample_rows(rows, torch.full((n,), temp), torch.ones(n), u, any_top_p=False)
    probs = torch.softmax(logits / temp, -1)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    assert _chi2(counts, probs.double()) < CHI2_999[11]
    # ignoring the temperature would be caught
    assert _chi2(counts, torch.softmax(logits, -1).double()) > CHI2_999[11]
    # logprob convention: log_softmax(logits / T) at the sampled token
    assert torch.allclose(logprobs, torch.log_softmax(logits / temp, -1)[tokens])


def test_top_p_samples_the_renormalised_nucleus_and_reports_pre_truncation_logprobs():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -4.0])
    n, top_p = 20_000, 0.8
    probs = torch.softmax(logits, -1)
    keep = (torch.cumsum(probs, -1) - probs) < top_p          # sorted already: the nucleus is a prefix
    u = counter_uniform(torch.arange(n) + 10**6, torch.full((n,), 3))
    tokens, logprobs = sample_rows(logits.expand(n, -1), torch.ones(n), torch.full((n,), top_p), u, any_top_p=True)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    assert counts[~keep].sum() == 0
    k = int(keep.sum())
    assert _chi2(counts[:k], (probs[:k] / probs[:k].sum()).double()) < CHI2_999[k - 1]
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[tokens])


def test_a_row_samples_the_same_alone_and_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 2
    temps = torch.tensor([1.0, 0.0, 0.6, 1.3, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0])
    seeds = torch.tensor([11, 12, 13, 14, 15])
    u = counter_uniform(seeds, torch.tensor([0, 3, 9, 1, 2]))
    tokens, lps = sample_rows(logits, temps, top_p, u, any_top_p=True)
    for r in range(5):
        t, lp = sample_rows(logits[r:r + 1], temps[r:r + 1], top_p[r:r + 1], u[r:r + 1],
                            any_top_p=bool(top_p[r] < 1))
        assert int(t) == int(tokens[r]) and float(lp) == float(lps[r])
    assert int(tokens[1]) == int(logits[1].argmax())                     # temperature 0: greedy
    assert float(lps[1]) == pytest.approx(float(torch.log_softmax(logits[1], -1).max()))


def test_prefill_masks_causal_only_when_plain_causal_is_exact():
    store = SlotKVCache(1, 4, 1, 32, 8, torch.float32, "cpu")
    _, pos, mask = store.prefill_view([0, 1], [0, 0], [5, 5])
    assert mask is None and pos.tolist() == [list(range(5))] * 2
    # slot 2 reuses 3 cached tokens and feeds 2; slot 0 feeds 4 fresh ones: left-padded to q = 4
    view, pos, mask = store.prefill_view([2, 0], [3, 0], [2, 4])
    assert mask.shape == (2, 1, 4, 5) and pos.tolist() == [[0, 0, 3, 4], [0, 1, 2, 3]]
    allowed = (mask[:, 0] == 0).int().tolist()
    assert allowed[0] == [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]   # pads: position 0
    assert allowed[1] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert view.write_pos.tolist() == [[31, 31, 3, 4], [0, 1, 2, 3]]                # pads write to scratch
    assert view.get_mask_sizes(4, 0) == (5, 0) and view.get_query_offset(0) == 0


def test_shared_prefix_attention_equals_attention_over_each_rows_own_slot():
    """Rows reading their first shared[r] positions from one block give what attending over their own slots
    gives; with grouped-query heads (4 query heads on 2 kv heads) and a row that is not decoding."""
    torch.manual_seed(0)
    slots, heads, kv_heads, dim, max_len = 4, 4, 2, 8, 40
    store = SlotKVCache(1, slots, kv_heads, max_len, dim, torch.float32, "cpu")
    store.ensure_initialised(slots)
    store.keys[0].normal_()
    store.values[0].normal_()
    shared, write, active = [12, 9, 12, 0], [20, 15, 12, 0], [True, True, True, False]
    for r in (1, 2):                      # the shared positions hold the same KV as the block's source
        store.copy_slot(0, r, shared[r])
    block = PrefixBlock(torch.arange(12).numpy(), *store.copy_prefix(0, 12))
    q = torch.randn(slots, heads, 1, dim)
    write_t, active_t = torch.tensor(write), torch.tensor(active)
    _, _, mask = store.decode_view(slots, 21, write_t, active_t)
    k, v = (t[0][:, :, :21].repeat_interleave(2, 1) for t in (store.keys, store.values))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    start = 9                             # the smallest shared length of the decoding rows
    view, pos, own_mask, block_mask = store.decode_view_shared(slots, 21, start, write_t, active_t,
                                                               torch.tensor(shared), len(block))
    assert pos[:, 0].tolist() == [20, 15, 12, store.scratch_pos] and view.start == start
    assert (own_mask[:, 0, 0] == 0).sum(-1).tolist() == [21 - 12, 15 - 9 + 1, 1, 1]
    assert (block_mask[:, 0, 0] == 0).sum(-1).tolist() == [12, 9, 12, 0]
    layer = torch.nn.Module()
    layer.layer_idx = 0
    got, _ = shared_prefix_attention_forward(layer, q, store.keys[0][:, :, start:21], store.values[0][:, :, start:21],
                                             own_mask, shared_prefix=SharedPrefix(block, block_mask))
    assert got.shape == (slots, 1, heads, dim) and torch.isfinite(got).all()
    torch.testing.assert_close(got[:3], want[:3], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="decode steps"):
        shared_prefix_attention_forward(layer, torch.randn(slots, heads, 2, dim), store.keys[0][:, :, :2],
                                        store.values[0][:, :, :2], own_mask, shared_prefix=SharedPrefix(block, block_mask))


def test_bucket_sizes():
    assert [bucket(n, 256) for n in (1, 2, 3, 17, 256, 300)] == [1, 2, 4, 32, 256, 256]
    assert [bucket(n, 200, MIN_BUCKET) for n in (1, 64, 65, 130, 199)] == [64, 64, 128, 200, 200]


def _gather(engine, prompts, params_for):
    async def go():
        try:
            return await asyncio.gather(*[engine.generate(p, params_for(i)) for i, p in enumerate(prompts)])
        finally:
            await engine.close()
    return asyncio.run(go())


def test_batched_prefill_gives_the_tokens_of_one_at_a_time(model, tokenizer):
    prompts = [[5, 17, 40, 41, 9], [100, 3], [7, 8, 9, 10, 11, 12, 13, 14], [250], [60, 61, 62, 63, 64],
               [33, 34], [1, 2, 3, 4, 5]]
    params = lambda i: SamplingParams(max_new_tokens=10, temperature=0.0 if i % 2 else 0.8, seed=i)
    engine = HFEngine(model, tokenizer, max_batch_size=8, max_seq_len=64)
    together = _gather(engine, prompts, params)
    assert engine.stats["prefill_forwards"] < len(prompts)              # several prompts per forward
    for i, (p, out) in enumerate(zip(prompts, together)):
        alone = _gather(HFEngine(model, tokenizer, max_batch_size=1, max_seq_len=64), [p], lambda _, i=i: params(i))[0]
        assert out.token_ids == alone.token_ids
        assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # equal-length fresh prompts take the mask-free (is_causal) prefill: same tokens as model.generate
    same = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    outs = _gather(HFEngine(model, tokenizer, max_batch_size=4, max_seq_len=64), same,
                   lambda i: SamplingParams(max_new_tokens=8, temperature=0.0))
    ref = model.generate(torch.tensor(same), max_new_tokens=8, do_sample=False, pad_token_id=0)[:, 4:]
    assert [list(o.token_ids) for o in outs] == ref.tolist()


def test_a_small_prefill_budget_splits_the_forwards(model, tokenizer):
    prompts = [list(range(10 + i, 30 + i)) for i in range(0, 60, 20)]          # 3 x 20 tokens, no shared prefix
    engine = HFEngine(model, tokenizer, max_batch_size=4, max_seq_len=64, max_prefill_tokens=40)
    outs = _gather(engine, prompts, lambda i: SamplingParams(max_new_tokens=3, temperature=0.0))
    assert engine.stats["prefill_forwards"] == 2 and engine.stats["prefill_padded_tokens"] == 60
    assert all(len(o.token_ids) == 3 for o in outs)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        HFEngine(model, tokenizer, max_prefill_tokens=0)


def test_static_shapes_decode_in_power_of_two_buckets(model, tokenizer):
    engine = HFEngine(model, tokenizer, max_batch_size=8, max_seq_len=200, static_shapes=True)
    shapes = []
    real = engine._decode_forward
    engine._decode_forward = lambda rows, kv_len, *start: (shapes.append((rows, kv_len)), real(rows, kv_len, *start))[1]
    prompts = [[5, 17, 40], [100, 3], [7, 8, 9, 10, 11]]
    outs = _gather(engine, prompts, lambda i: SamplingParams(max_new_tokens=70 - 20 * i, temperature=0.0))
    assert {r for r, _ in shapes} <= {1, 2, 4} and {k for _, k in shapes} == {64, 128}
    dyn = _gather(HFEngine(model, tokenizer, max_batch_size=8, max_seq_len=200), prompts,
                  lambda i: SamplingParams(max_new_tokens=70 - 20 * i, temperature=0.0))
    assert [o.token_ids for o in outs] == [o.token_ids for o in dyn]


def test_running_requests_move_to_the_lowest_slots_and_cached_prefixes_survive(model, tokenizer):
    engine = HFEngine(model, tokenizer, max_batch_size=4, max_seq_len=96)
    rows_seen = []
    real = engine._decode_forward
    engine._decode_forward = lambda rows, kv_len, *start: (rows_seen.append(rows), real(rows, kv_len, *start))[1]
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    params = lambda i: SamplingParams(max_new_tokens=2 if i < 3 else 30, temperature=0.9, seed=i)

    async def go():
        try:
            first = await asyncio.gather(*[engine.generate(p, params(i)) for i, p in enumerate(prompts)])
            # the next turn of request 0, whose cached prefix was swapped out of slot 0
            nxt = prompts[0] + list(first[0].token_ids) + [3, 4]
            before = engine.stats["reused_tokens"]
            second = await engine.generate(nxt, SamplingParams(max_new_tokens=5, temperature=0.0))
            return first, nxt, second, engine.stats["reused_tokens"] - before
        finally:
            await engine.close()

    first, nxt, second, reused = asyncio.run(go())
    # the three short requests finish after one decode step; the long one then moves to slot 0 and decodes
    # alone; the next turn reuses the prefix where it moved (slot 3) and moves down as well
    assert engine.stats["compaction_moves"] == 2 and rows_seen[0] == 4 and set(rows_seen[1:]) == {1}
    assert reused == len(prompts[0]) + 1                         # prompt + the first sampled token's KV
    alone = _gather(HFEngine(model, tokenizer, max_batch_size=1, max_seq_len=96), [prompts[3]], lambda _: params(3))
    assert first[3].token_ids == alone[0].token_ids
    fresh = _gather(HFEngine(model, tokenizer, max_batch_size=1, max_seq_len=96), [nxt],
                    lambda _: SamplingParams(max_new_tokens=5, temperature=0.0))
    assert second.token_ids == fresh[0].token_ids


def test_model_call_uses_the_installed_cache_name_and_refuses_unsupported_attention(model):
    import inspect

    params = inspect.signature(type(model).forward).parameters
    assert cache_kwarg(model) == ("cache" if "cache" in params else "past_key_values")
    other = tiny_model(100)
    other.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        check_model(other)
    other.config._attn_implementation = "sdpa"
    other.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="sliding_attention"):
        check_model(other)


def test_eager_attention_gives_the_same_tokens(tokenizer):
    eager = tiny_model(len(tokenizer))
    eager.config._attn_implementation = "eager"
    sdpa = tiny_model(len(tokenizer))
    prompts = [[5, 17, 40, 41, 9], [100, 3], [7, 8, 9, 10]]
    greedy = lambda i: SamplingParams(max_new_tokens=8, temperature=0.0)
    a = _gather(HFEngine(eager, tokenizer, max_batch_size=2, max_seq_len=32), prompts, greedy)
    b = _gather(HFEngine(sdpa, tokenizer, max_batch_size=2, max_seq_len=32), prompts, greedy)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_cuda_graphs_are_refused_off_cuda(model, tokenizer):
    from rstar2_core.rollout.decode_graphs import DecodeGraphs

    with pytest.raises(ValueError, match="cuda_graphs=False"):
        HFEngine(model, tokenizer, cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(lambda rows, kv: None, torch.device("cpu"))


def test_decode_graphs_capture_once_per_bucket_then_replay(monkeypatch):
    """The bookkeeping around torch.cuda.graphs (which needs a GPU): warm-up run, one capture per
    (rows, kv_len), replays return the captured output. torch.cuda is replaced by a recorder."""
    from rstar2_core.rollout import decode_graphs

    events = []

    class Graph:
        def replay(self):
            events.append("replay")

    class Ctx:
        event = None

        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            if self.event:
                events.append(self.event)

        def __exit__(self, *a):
            return False

    class Capture(Ctx):
        event = "capture"

    class Stream:
        def __init__(self, *a):
            pass

        def wait_stream(self, s):
            pass

    fake = type("cuda", (), {"graph_pool_handle": staticmethod(lambda: "pool"), "CUDAGraph": Graph,
                             "Stream": Stream, "stream": Ctx, "graph": Capture,
                             "current_stream": staticmethod(lambda d=None: Stream()),
                             "synchronize": staticmethod(lambda d=None: None)})
    monkeypatch.setattr(decode_graphs.torch, "cuda", fake)
    calls = []

    def fn(rows, kv):
        calls.append((rows, kv))
        return torch.full((rows,), float(kv))

    g = decode_graphs.DecodeGraphs(fn, torch.device("cuda"))
    outs = [g.run(4, 64), g.run(4, 64), g.run(8, 64), g.run(4, 64)]
    assert calls == [(4, 64), (4, 64), (8, 64), (8, 64)]           # warm-up + capture, per bucket only
    assert events.count("capture") == 2 and events.count("replay") == 4 and len(g.graphs) == 2
    assert outs[0] is outs[1] is outs[3] and outs[2].shape == (8,)
    assert math.isclose(float(outs[2][0]), 64.0)


@pytest.fixture
def cudnn_attention_restored():
    """The test turns cuDNN's attention back on; its state (a process-wide torch flag) is put back after."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_engine_and_the_training_forward_take_cudnn_attention_out_of_sdpa(cudnn_attention_restored, monkeypatch):
    """cuDNN builds a plan per new attention shape (2-3 s of a GPU SFT step on new rows, bench/sdpa_shapes.py):
    building an engine or running a training forward turns it off, unless allowed."""
    from rstar2_core.models.token_logprobs import decoder_hidden
    from rstar2_core.rollout import model_call

    model = tiny_model(64)
    asyncio.run(HFEngine(model, None, max_batch_size=2, max_seq_len=32).close())
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    ids = torch.arange(3, 11)[None]
    assert decoder_hidden(model, ids, position_ids=torch.arange(8)[None]).shape == (1, 8, 64)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(model_call, "ALLOW_CUDNN_ATTENTION", True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    asyncio.run(HFEngine(model, None, max_batch_size=2, max_seq_len=32).close())
    assert torch.backends.cuda.cudnn_sdp_enabled()
