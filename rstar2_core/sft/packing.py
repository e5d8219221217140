"""Tokenize SFT conversations and pack them into fixed-length rows, sharing the common prompt prefix.

Each conversation becomes `(ids, loss_mask)` through `ChatFormat.render_trajectory`; over-long ones are
rejected and counted. A row is plain (position ids restart per conversation) or, when every
conversation starts with the same >= `MIN_SHARED_PREFIX` tokens, shared-prefix (the prefix once per row,
each conversation's positions continuing after it). `collate` describes each row by its `Segments` for
models/packed_attention.py (`dense_mask=True`: the explicit (B, 1, T, T) additive mask, the reference).

Invariant: packing is exact (every conversation sees exactly the tokens and positions it would see
alone; tests/unit/sft/test_sft_packing.py compares logits) and never splits a conversation. See
docs/models-and-sft.md, "Packing".
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rstar2_core.models.packed_attention import Segments

IGNORE = -100
PREFIX_GROUP, PAD_GROUP = -1, -2
MIN_SHARED_PREFIX = 16
Doc = tuple[list[int], list[int]]


@dataclass(frozen=True)
class PackedRow:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    position_ids: tuple[int, ...]
    groups: tuple[int, ...]      # conversation index within the row; PREFIX_GROUP / PAD_GROUP
    n_docs: int
    n_real: int                  # tokens that are not padding
    shared_prefix: bool = False


def encode_conversations(rows: Sequence[dict], chat, max_seq_len: int) -> tuple[list[Doc], int]:
    """[(ids, loss_mask)] for rows in render_trajectory form (tokenized in one batch:
    `ChatFormat.render_trajectories`) or `messages` form (`ChatFormat.render_chats`), in the rows' order;
    also the count of rows over max_seq_len. A row with `mask_answer`
    (and its `answer`) gets loss_mask 0 on the tokens of its last boxed answer."""
    docs, too_long = [], 0
    recipe = [r for r in rows if "messages" not in r]
    items = [(r["problem"], [(t, res) for t, res in r["turns"]]) for r in recipe]
    rendered = iter(chat.render_trajectories(items) if items else [])
    chats = iter(chat.render_chats([[tuple(m) for m in r["messages"]] for r in rows if "messages" in r])
                 if len(recipe) < len(rows) else [])
    turns_of = iter(items)
    for r in rows:
        if "messages" in r:
            ids, mask = next(chats)
        else:
            (_, turns), (ids, mask) = next(turns_of), next(rendered)
            if r.get("mask_answer"):
                mask = _mask_boxed_answer(chat, r, turns, ids, mask)
        if len(ids) > max_seq_len:
            too_long += 1
            continue
        docs.append((ids, mask))
    return docs, too_long


def _mask_boxed_answer(chat, row: dict, turns: list, ids: list[int], mask: list[int]) -> list[int]:
    """`mask` with 0 on the tokens that spell the answer inside the last turn's last `\\boxed{answer}`
    (the last turn's text is the ids just before the closing `<|im_end|>`)."""
    answer = str(row.get("answer") or "")
    box = "\\boxed{" + answer + "}"
    text = turns[-1][0]
    at = text.rfind(box)
    if not answer or at < 0:
        raise ValueError(f"SFT row {row.get('id')!r}: mask_answer is set but its last turn has no "
                         f"{box!r}; drop mask_answer or fix the row")
    enc = chat.tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids[len(ids) - 1 - len(enc["input_ids"]):-1]:
        raise ValueError(f"SFT row {row.get('id')!r}: cannot locate the last turn's tokens to mask its answer")
    lo, hi = at + len("\\boxed{"), at + len("\\boxed{") + len(answer)
    start = len(ids) - 1 - len(enc["input_ids"])
    out = list(mask)
    for k, (s, e) in enumerate(enc["offset_mapping"]):
        if s < hi and e > lo:
            out[start + k] = 0
    return out


def common_prefix(docs: Sequence[Doc]) -> list[int]:
    """Longest run of leading ids shared by all docs on which no doc has a label (loss_mask 0),
    leaving at least one token of each doc outside it. One pass over the docs, each compared as a slice
    (linear in the docs, not docs x prefix length in Python)."""
    if not docs:
        return []
    first = docs[0][0]
    k = min(len(d[0]) for d in docs) - 1
    for ids, mask in docs:
        if k <= 0:
            return []
        if 1 in mask[:k]:
            k = mask.index(1)
        if ids[:k] != first[:k]:
            k = next(i for i, (a, b) in enumerate(zip(ids[:k], first[:k])) if a != b)
    return list(first[:max(k, 0)])


def _row(parts: list[Doc], max_seq_len: int, pad_id: int, prefix: list[int]) -> PackedRow:
    p = len(prefix)
    ids, labels, pos, groups = list(prefix), [IGNORE] * p, list(range(p)), [PREFIX_GROUP] * p
    for g, (d_ids, d_mask) in enumerate(parts):
        ids += d_ids[p:]
        lab = [t if m else IGNORE for t, m in zip(d_ids[p:], d_mask[p:])]
        lab[0] = IGNORE  # never learn a conversation's first token from the previous conversation
        labels += lab
        pos += list(range(p, len(d_ids)))
        groups += [g] * (len(d_ids) - p)
    n_real = len(ids)
    pad = max_seq_len - n_real
    ids += [pad_id] * pad
    labels += [IGNORE] * pad
    pos += list(range(pad))
    groups += [PAD_GROUP] * pad
    return PackedRow(tuple(ids), tuple(labels), tuple(pos), tuple(groups), len(parts), n_real, bool(p))


def pack(docs: Sequence[Doc], max_seq_len: int, pad_id: int, pack: bool = True,
         prefix: list[int] | None = None) -> list[PackedRow]:
    """Greedy in-order packing (a new row starts when the next conversation does not fit);
    `pack=False` puts one conversation per row; `prefix` (shared by every doc) is written once per row."""
    prefix = list(prefix or [])
    p = len(prefix)
    if any(d[0][:p] != prefix for d in docs):
        raise ValueError("prefix is not shared by every conversation; compute it with common_prefix(docs)")
    rows: list[PackedRow] = []
    cur: list[Doc] = []
    used = p
    for d in docs:
        n = len(d[0]) - p
        if n + p > max_seq_len:
            raise ValueError(f"a conversation of {n + p} tokens exceeds max_seq_len={max_seq_len}; filter with "
                             "encode_conversations first or raise sft.max_seq_len")
        if cur and (not pack or used + n > max_seq_len):
            rows.append(_row(cur, max_seq_len, pad_id, prefix))
            cur, used = [], p
        cur.append(d)
        used += n
    if cur:
        rows.append(_row(cur, max_seq_len, pad_id, prefix))
    return rows


def epoch_rows(docs: Sequence[Doc], epochs: float, seed: int, max_seq_len: int, pad_id: int,
               pack_rows: bool = True, share_prefix: bool = True) -> list[PackedRow]:
    """Rows of `epochs` passes (fractional: the first share of the last pass's rows); each pass packs
    the conversations in a fresh order shuffled with `seed + pass`."""
    prefix = common_prefix(docs) if share_prefix and pack_rows else []
    if len(prefix) < MIN_SHARED_PREFIX:
        prefix = []
    out: list[PackedRow] = []
    full = int(epochs)
    frac = epochs - full
    for e in range(full + (1 if frac > 0 else 0)):
        order = list(range(len(docs)))
        random.Random(seed * 1_000_003 + e).shuffle(order)
        rows = pack([docs[i] for i in order], max_seq_len, pad_id, pack_rows, prefix)
        out += rows if e < full else rows[: max(1, round(frac * len(rows)))]
    return out


def prefix_length(row: PackedRow) -> int:
    """Tokens of the shared prefix at the start of `row` (0 without one)."""
    return _prefix_tokens(row.groups) if row.shared_prefix else 0


def merge_shared_prefix(rows: Sequence[PackedRow]) -> PackedRow | None:
    """One row holding the shared prefix once and every conversation of `rows` after it, without padding;
    None when the rows do not all start with the same shared prefix (then there is nothing to merge).

    Under segment attention the prefix's hidden states do not depend on the conversations after it, so
    a micro-batch of shared-prefix rows computes the same prefix B times: merged, it is computed once
    (the tiny profile: a 344-token system turn in every 1,024-token row, plus the padding, ~1/3 of the
    tokens a step computes). Same losses and gradients up to float summation order (the prefix's
    gradient sums over every conversation, as the B copies' gradients would): tests/unit/sft. The
    merged row's length varies from step to step, which a CUDA graph or a compiled step would not like;
    the SFT step uses neither."""
    if len(rows) < 2 or not all(r.shared_prefix for r in rows):
        return None
    p = prefix_length(rows[0])
    first = rows[0].input_ids[:p]
    if p == 0 or any(prefix_length(r) != p or r.input_ids[:p] != first for r in rows[1:]):
        return None
    ids, labels, pos, groups = list(first), list(rows[0].labels[:p]), list(rows[0].position_ids[:p]), [PREFIX_GROUP] * p
    offset = 0
    for r in rows:
        end = r.n_real
        ids += r.input_ids[p:end]
        labels += r.labels[p:end]
        pos += r.position_ids[p:end]
        groups += [g + offset for g in r.groups[p:end]]     # conversation ids stay distinct across rows
        offset += r.n_docs
    return PackedRow(tuple(ids), tuple(labels), tuple(pos), tuple(groups), offset, len(ids), True)


def attention_mask_4d(groups: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask (B, 1, T, T): 0 where query q may attend key k (k <= q and k is in q's group or the
    shared prefix), the dtype's minimum elsewhere. groups: (B, T)."""
    t = groups.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=groups.device).tril()
    same = groups[:, :, None] == groups[:, None, :]
    to_prefix = (groups[:, None, :] == PREFIX_GROUP)
    allowed = causal[None] & (same | to_prefix)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=groups.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def _prefix_tokens(groups: Sequence[int]) -> int:
    p = 0
    while p < len(groups) and groups[p] == PREFIX_GROUP:
        p += 1
    return p


def row_segments(row: PackedRow) -> Segments:
    """The row's layout for segment attention: its shared prefix, then one span per conversation."""
    g = row.groups
    p = _prefix_tokens(g)
    spans, s = [], p
    while s < len(g) and g[s] != PAD_GROUP:
        e = s
        while e < len(g) and g[e] == g[s]:
            e += 1
        spans.append((s, e))
        s = e
    return Segments(p, tuple(spans), len(g))


def collate(rows: Sequence[PackedRow], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
            dense_mask: bool = False) -> dict:
    """input_ids, labels, position_ids: (B, T) long; plus `segments` (a `Segments` per row), or with
    `dense_mask` an additive attention_mask (B, 1, T, T) of `dtype` for shared-prefix rows."""
    out: dict = {k: torch.tensor([getattr(r, k) for r in rows], dtype=torch.long, device=device)
                 for k in ("input_ids", "labels", "position_ids")}
    if not dense_mask:
        out["segments"] = tuple(row_segments(r) for r in rows)
    elif any(r.shared_prefix for r in rows):
        groups = torch.tensor([r.groups for r in rows], dtype=torch.long, device=device)
        out["attention_mask"] = attention_mask_4d(groups, dtype)
    return out
