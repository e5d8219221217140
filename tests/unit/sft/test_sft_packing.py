"""Packing keeps conversations whole and isolated; labels are the assistant tokens only."""

import pytest
import torch
import torch.nn.functional as F
from numerics import same_up_to_summation_order
from transformers import Qwen2Config, Qwen2ForCausalLM

from rstar2_core.chat import ChatFormat
from rstar2_core.models import token_logprobs
from rstar2_core.models.io import load_model_and_tokenizer
from rstar2_core.models.packed_attention import Segments, segment_attention
from rstar2_core.sft.data import read_sft_rows
from rstar2_core.sft.packing import (
    IGNORE,
    MIN_SHARED_PREFIX,
    collate,
    common_prefix,
    encode_conversations,
    epoch_rows,
    merge_shared_prefix,
    pack,
    prefix_length,
    row_segments,
)
from rstar2_core.sft.step import masked_token_loss


def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, 60, (n,), generator=g).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        out.append((ids, mask))
    return out


def test_pack_keeps_docs_whole_in_order_with_restarting_positions():
    docs = _docs([5, 7, 4, 9, 3])
    rows = pack(docs, 12, pad_id=0)
    assert [r.n_docs for r in rows] == [2, 1, 2]
    flat = [t for r in rows for t, p in zip(r.input_ids[:r.n_real], r.position_ids[:r.n_real])]
    assert flat == [t for ids, _ in docs for t in ids]
    r0 = rows[0]
    assert r0.position_ids[:12] == (0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6)
    for r in rows:
        assert len(r.input_ids) == len(r.labels) == len(r.position_ids) == 12
        assert all(l == IGNORE for l in r.labels[r.n_real:])
    assert len(pack(docs, 12, 0, pack=False)) == 5
    with pytest.raises(ValueError, match="max_seq_len"):
        pack(_docs([13]), 12, 0)


def test_epoch_rows_seeded_and_fractional():
    docs = _docs([4] * 10)
    a = epoch_rows(docs, 2, seed=1, max_seq_len=8, pad_id=0)
    assert a == epoch_rows(docs, 2, seed=1, max_seq_len=8, pad_id=0)
    assert a != epoch_rows(docs, 2, seed=2, max_seq_len=8, pad_id=0)
    assert len(a) == 10 and a[:5] != a[5:]
    assert len(epoch_rows(docs, 1.4, seed=1, max_seq_len=8, pad_id=0)) == 7


def _model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64)).eval()


def test_packed_attention_equals_each_conversation_alone():
    model = _model()
    docs = _docs([6, 9, 5])
    row = pack(docs, 24, pad_id=0)[0]
    assert row.n_docs == 3
    b = collate([row])
    with torch.no_grad():
        packed = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits[0]
        off = 0
        for ids, _ in docs:
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            assert torch.allclose(packed[off:off + len(ids)], alone, atol=1e-5)
            off += len(ids)
        # without the restarting positions the second conversation would see the first one
        crossed = model(input_ids=b["input_ids"], use_cache=False).logits[0]
        assert not torch.allclose(crossed[6:15], packed[6:15], atol=1e-3)
        assert b["segments"] == (Segments(0, ((0, 6), (6, 15), (15, 20)), 24),)
        with segment_attention(model):
            segmented = model(input_ids=b["input_ids"], position_ids=b["position_ids"], segments=b["segments"],
                              use_cache=False).logits[0]
        assert torch.allclose(segmented[:20], packed[:20], atol=1e-5)
    assert model.config._attn_implementation == "sdpa"      # switched back after the block


def _common_prefix_by_position(docs):
    """The definition, position by position: stop at the first position where a doc has a label or the
    ids differ, leaving one token of the shortest doc outside."""
    n, k = min(len(d[0]) for d in docs) - 1, 0
    while k < n and not any(d[1][k] for d in docs) and all(d[0][k] == docs[0][0][k] for d in docs):
        k += 1
    return docs[0][0][:k]


@pytest.mark.parametrize("seed", range(40))
def test_common_prefix_matches_its_definition(seed):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 6, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
    docs = []
    for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
        tail = torch.randint(3, 6, (int(torch.randint(0, 8, (1,), generator=g)),), generator=g).tolist()
        ids = shared[:int(torch.randint(0, len(shared) + 1, (1,), generator=g))] + tail
        ids = ids or [3]
        mask = (torch.rand(len(ids), generator=g) < 0.15).long().tolist()
        docs.append((ids, mask))
    assert common_prefix(docs) == _common_prefix_by_position(docs)


def test_shared_prefix_rows_equal_each_conversation_alone():
    model = _model()
    prefix = list(range(3, 3 + MIN_SHARED_PREFIX + 2))
    docs = [(prefix + ids, [0] * len(prefix) + mask) for ids, mask in _docs([6, 9, 5], seed=3)]
    assert common_prefix(docs) == prefix
    rows = epoch_rows(docs, 1, seed=0, max_seq_len=48, pad_id=0)
    assert len(rows) == 1 and rows[0].shared_prefix and rows[0].n_docs == 3
    assert rows[0].n_real == len(prefix) + 20               # the prefix is written once
    b = collate(rows, dense_mask=True)
    assert b["attention_mask"].shape == (1, 1, 48, 48) and "segments" not in b
    seg = collate(rows)
    assert "attention_mask" not in seg and seg["segments"][0].prefix == len(prefix)
    with torch.no_grad():
        packed = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                       attention_mask=b["attention_mask"], use_cache=False).logits[0]
        with segment_attention(model):
            segmented = model(input_ids=seg["input_ids"], position_ids=seg["position_ids"],
                              segments=seg["segments"], use_cache=False).logits[0]
        assert torch.allclose(segmented[:rows[0].n_real], packed[:rows[0].n_real], atol=1e-5)
        seq = b["input_ids"][0].tolist()
        off = len(prefix)
        seen = 0
        while seen < 3:
            d = next(d for d in docs if seq[off:off + len(d[0]) - len(prefix)] == d[0][len(prefix):])
            alone = model(input_ids=torch.tensor([d[0]]), use_cache=False).logits[0]
            n = len(d[0]) - len(prefix)
            assert torch.allclose(packed[off:off + n], alone[len(prefix):], atol=1e-5)
            assert torch.allclose(packed[:len(prefix)], alone[:len(prefix)], atol=1e-5)
            off += n
            seen += 1
    labels = sorted(t for t in rows[0].labels if t != IGNORE)
    assert labels == sorted(t for ids, m in docs for t, mm in zip(ids, m) if mm)
    with pytest.raises(ValueError, match="common_prefix"):
        pack(docs + [([1] * 30, [0] * 30)], 48, 0, prefix=prefix)


def test_labels_are_assistant_tokens_only(sft_assets):
    base, data_url, _ = sft_assets
    _, tok = load_model_and_tokenizer(base)
    chat = ChatFormat(tok)
    rows = read_sft_rows(data_url)
    row = next(r for r in rows if r["failed_first"])
    (ids, mask), = encode_conversations([row], chat, 4096)[0]
    assert mask[0] == 0
    learned = tok.decode([t for t, m in zip(ids, mask) if m])
    ignored = tok.decode([t for t, m in zip(ids, mask) if not m])
    for text, results in row["turns"]:
        assert text in learned
        for res in results or []:
            assert res in ignored and res not in learned
    assert row["problem"] in ignored and "<tool_response>" not in learned
    assert learned.endswith("<|im_end|>") and "\\boxed{" + row["answer"] + "}" in learned
    packed = pack([(ids, mask)], 4096, pad_id=0)[0]
    assert [t for t in packed.labels if t != IGNORE] == [t for t, m in zip(ids, mask) if m]


def test_mask_answer_hides_only_the_boxed_digits(sft_assets):
    base, _, _ = sft_assets
    _, tok = load_model_and_tokenizer(base)
    chat = ChatFormat(tok)
    text = "\nI can answer this without the tool.\n</reason>\n<answer>\nThe answer is \\boxed{9158190}.\n</answer>"
    row = {"id": "d", "problem": "What is 3^41 mod 7?", "answer": "9158190", "turns": [[text, None]]}
    (ids, full), = encode_conversations([row], chat, 4096)[0]
    (ids2, masked), = encode_conversations([dict(row, mask_answer=True)], chat, 4096)[0]
    assert ids2 == ids
    hidden = [t for t, a, b in zip(ids, full, masked) if a and not b]
    assert tok.decode(hidden) == "9158190"                      # exactly the digits, nothing around them
    assert "\\boxed{" in tok.decode([t for t, m in zip(ids, masked) if m])
    with pytest.raises(ValueError, match="mask_answer"):
        encode_conversations([dict(row, mask_answer=True, answer="12")], chat, 4096)


def test_masked_loss_is_the_cross_entropy_of_label_positions_only():
    model = _model()
    ids = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([[IGNORE, IGNORE, 3, IGNORE, 4, 5]])
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(6)[None]}
    loss, n = masked_token_loss(model, batch)
    logits = model(input_ids=ids, use_cache=False).logits
    plain = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE, reduction="sum")
    assert n == 3 and torch.allclose(loss, plain, atol=1e-5)
    # position t predicts label t+1: the loss moves when the logits at positions 1, 3, 4 do, not at 0, 2
    assert torch.allclose(loss, -(logits[0, [1, 3, 4]].log_softmax(-1)[torch.arange(3), torch.tensor([3, 4, 5])]).sum(),
                          atol=1e-5)


def test_segment_loss_equals_the_dense_mask_loss_on_real_rows(sft_assets, monkeypatch):
    """Same rows (shared prefix, 2-6 conversations each), fp32: the segment-attention, chunked loss and its
    gradients equal the dense-mask path within 1e-5 relative."""
    base, data_url, _ = sft_assets
    model, tok = load_model_and_tokenizer(base, dtype="float32")
    model.train()
    chat = ChatFormat(tok)
    docs, _ = encode_conversations(read_sft_rows(data_url), chat, 1024)
    rows = epoch_rows(docs, 1, seed=0, max_seq_len=1024, pad_id=tok.pad_token_id)[:2]
    assert all(r.shared_prefix for r in rows) and sum(r.n_docs for r in rows) > 2
    monkeypatch.setattr(token_logprobs, "CHUNK_ELEMENTS", 64 * model.config.vocab_size)   # chunks of 64 tokens

    def run(**kw):
        model.zero_grad(set_to_none=True)
        loss, n = masked_token_loss(model, collate(rows, **kw))
        loss.backward()
        return loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    seg_loss, seg_n, seg_grads = run()
    dense_loss, dense_n, dense_grads = run(dense_mask=True)
    assert seg_n == dense_n > 100
    assert torch.allclose(seg_loss, dense_loss, rtol=1e-5)
    assert seg_grads.keys() == dense_grads.keys()
    for k in dense_grads:
        assert same_up_to_summation_order(seg_grads[k], dense_grads[k]), k


def test_merged_prefix_row_gives_the_rows_loss_and_gradients(sft_assets):
    """A micro-batch of shared-prefix rows run as one row with the prefix once: the same label tokens,
    loss and gradients (fp32, within float summation order) as the rows run as they are; rows that do
    not share the prefix are not merged."""
    base, data_url, _ = sft_assets
    model, tok = load_model_and_tokenizer(base, dtype="float32")
    model.train()
    docs, _ = encode_conversations(read_sft_rows(data_url), ChatFormat(tok), 1024)
    rows = epoch_rows(docs, 1, seed=0, max_seq_len=1024, pad_id=tok.pad_token_id)[:3]
    single = pack(docs[:1], 1024, tok.pad_token_id, prefix=common_prefix(docs))     # one conversation
    merged = merge_shared_prefix(rows + single)          # a one-conversation row must stay its own segment
    p = prefix_length(rows[0])
    assert p > 300 and merged.n_real == p + sum(r.n_real - p for r in rows + single)
    assert merged.n_docs == sum(r.n_docs for r in rows + single) == len(row_segments(merged).spans)
    assert sorted(t for t in merged.labels if t != IGNORE) == sorted(t for r in rows + single for t in r.labels
                                                                      if t != IGNORE)

    def run(batch):
        model.zero_grad(set_to_none=True)
        loss, n = masked_token_loss(model, collate(batch))
        loss.backward()
        return loss.detach(), n, {k: q.grad.clone() for k, q in model.named_parameters() if q.grad is not None}

    rows_loss, rows_n, rows_grads = run(rows + single)
    m_loss, m_n, m_grads = run([merged])
    assert m_n == rows_n > 100 and torch.allclose(m_loss, rows_loss, rtol=1e-5)
    for k in rows_grads:
        assert same_up_to_summation_order(m_grads[k], rows_grads[k]), k
    plain = epoch_rows(docs[:4], 1, seed=0, max_seq_len=1024, pad_id=tok.pad_token_id, share_prefix=False)
    assert merge_shared_prefix(plain) is None and merge_shared_prefix(rows[:1]) is None
