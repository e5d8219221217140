"""`ChatFormat`: the ChatML conversation of RECIPE.md as token ids, token-in/token-out.

    chat = ChatFormat(tokenizer)                       # any HF tokenizer with <|im_start|>/<|im_end|>
    ids = chat.prompt_ids("What is 2^10?")            # ... <|im_start|>assistant\\n<reason>
    ids += generated_ids                              # the model's turn, up to </tool_call>
    ids += chat.tool_response_ids([result_text])      # loss_mask 0

Invariant: nothing the model generated is ever re-tokenized: a sequence is the concatenation of
pieces tokenized on their own, and SFT rows (`render_trajectory`) are built from the same pieces; text
that spells a special token is encoded as plain text, so tool output cannot forge a turn.
See docs/chat-and-grading.md, "The conversation" and "Token-in/token-out".
"""

from __future__ import annotations

from collections.abc import Sequence

from rstar2_core.chat.prompt import system_prompt, user_message
from rstar2_core.chat.tokens import (
    ANSWER_CLOSE,
    IM_END,
    IM_START,
    REASON_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
)

_Piece = tuple[str, bool]  # (text, is_special_token)
_BATCH_CHECK = 8   # texts `encode_texts` checks against `encode_text` before trusting the batch


class _Texts:
    """The distinct text pieces of a batch of rendering plans, numbered in first-seen order: a plan names a
    piece by its number, and `ChatFormat._realise` tokenizes each piece once."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, t: str) -> int:
        if t not in self._index:
            self._index[t] = len(self.texts)
            self.texts.append(t)
        return self._index[t]


class ChatFormat:
    """Renders prompts, tool-response turns and SFT demonstrations for one tokenizer."""

    def __init__(self, tokenizer, with_tools: bool = True):
        self.tokenizer = tokenizer
        self.with_tools = with_tools
        self.im_start_id = self._special_id(IM_START)
        self.im_end_id = self._special_id(IM_END)
        self.system_prompt: str = system_prompt(with_tools)
        self._batch_agrees: bool | None = None      # encode_texts' batch path gives encode_text's ids
        self._prefix_ids = self._encode_pieces([(IM_START, True), ("system\n" + self.system_prompt, False),
                                                (IM_END, True), ("\n", False), (IM_START, True)])
        self._gen_start_ids = self._encode_pieces([(IM_END, True), ("\n", False), (IM_START, True),
                                                   ("assistant\n" + REASON_OPEN, False)])

    # ------------------------------------------------------------------ tokens
    def _special_id(self, token: str) -> int:
        tok = self.tokenizer
        tid = tok.convert_tokens_to_ids(token)
        if tid is None or tid == tok.unk_token_id or tok.encode(token, add_special_tokens=False) != [tid]:
            raise ValueError(
                f"tokenizer {type(tok).__name__} has no single special token for {token!r}; add the ChatML "
                "markers with tokenizer.add_special_tokens({'additional_special_tokens': "
                "['<|im_start|>', '<|im_end|>']}) and resize the model's embeddings")
        return int(tid)

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text: no BOS/EOS added, and text spelling a special token stays plain text."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """`[encode_text(t) for t in texts]`, in one call of a fast tokenizer's Rust backend
        (`backend_tokenizer.encode_batch`, special-token strings kept as plain text as `encode_text`
        keeps them): a call per text costs ~3x more in Python than the tokenizing itself (32,000 SFT
        conversations: docs/training-speed.md, "SFT speed"). Tokenizers without a backend, or whose
        backend disagrees with `encode_text` on the first texts this instance batches (a tokenizer that
        adds a prefix space in Python, say), take one call per text."""
        texts = list(texts)
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if getattr(self.tokenizer, "is_fast", False) else None
        if not texts or self._batch_agrees is False or backend is None or not hasattr(backend, "encode_special_tokens"):
            return [self.encode_text(t) for t in texts]
        before = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            out = [list(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
        finally:
            backend.encode_special_tokens = before
        if self._batch_agrees is None:          # checked once per ChatFormat, on the first texts it batches
            self._batch_agrees = all(out[i] == self.encode_text(texts[i]) for i in range(min(len(texts), _BATCH_CHECK)))
        return out if self._batch_agrees else [self.encode_text(t) for t in texts]

    def _encode_pieces(self, pieces: Sequence[_Piece]) -> list[int]:
        ids: list[int] = []
        for text, special in pieces:
            if special:
                ids.append(self.im_start_id if text == IM_START else self.im_end_id)
            else:
                ids.extend(self.encode_text(text))
        return ids

    @property
    def shared_prompt_len(self) -> int:
        """Leading tokens every `prompt_ids(...)` shares (the system turn up to the user turn's `<|im_start|>`):
        the RL update packs them once per micro-batch (rl/logprobs.py)."""
        return len(self._prefix_ids)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Generation stops after a tool call or after the final answer."""
        return (TOOL_CALL_CLOSE, ANSWER_CLOSE)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """`<|im_end|>` and the tokenizer's own EOS (when different)."""
        ids = [self.im_end_id]
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos not in ids:
            ids.append(int(eos))
        return tuple(ids)

    # ------------------------------------------------------------------ text
    def prompt_text(self, problem: str) -> str:
        """System turn, user turn, then `<|im_start|>assistant\\n<reason>` (generation continues from here)."""
        return (f"{IM_START}system\n{self.system_prompt}{IM_END}\n"
                f"{IM_START}user\n{user_message(problem)}{IM_END}\n{IM_START}assistant\n{REASON_OPEN}")

    def tool_response_text(self, texts: list[str], turn_closed: bool = False) -> str:
        """Text of `tool_response_ids(texts)`: closes the assistant turn, one user turn, opens the next."""
        if not texts:
            raise ValueError("tool_response_text needs at least one tool result text (one per tool call)")
        blocks = "\n".join(f"{TOOL_RESPONSE_OPEN}\n{t}\n{TOOL_RESPONSE_CLOSE}" for t in texts)
        return ("" if turn_closed else IM_END) + f"\n{IM_START}user\n{blocks}{IM_END}\n{IM_START}assistant\n"

    # ------------------------------------------------------------------ ids
    def prompt_ids(self, problem: str) -> list[int]:
        """Token ids of `prompt_text(problem)` (the problem text cannot inject control tokens)."""
        return self._prefix_ids + self.encode_text("user\n" + user_message(problem)) + self._gen_start_ids

    def tool_response_ids(self, texts: list[str], turn_closed: bool = False) -> list[int]:
        """Ids appended (loss_mask 0) after an assistant turn that ended with tool calls.

        `texts`: one rendered result per call of the turn (`render_tool_result`), merged into one user
        turn. `turn_closed=True` when the generated ids already end with `<|im_end|>` (not repeated).
        """
        return self._encode_pieces(self._tool_response_pieces(texts, turn_closed))

    def _tool_response_pieces(self, texts: list[str], turn_closed: bool = False) -> list[_Piece]:
        if not texts:
            raise ValueError("tool_response_ids needs at least one tool result text (one per tool call)")
        blocks = "\n".join(f"{TOOL_RESPONSE_OPEN}\n{t}\n{TOOL_RESPONSE_CLOSE}" for t in texts)
        pieces: list[_Piece] = [] if turn_closed else [(IM_END, True)]
        pieces += [("\n", False), (IM_START, True), ("user\n" + blocks, False), (IM_END, True), ("\n", False),
                   (IM_START, True), ("assistant\n", False)]
        return pieces

    def render_trajectory(self, problem: str, turns: list[tuple[str, list[str] | None]]
                          ) -> tuple[list[int], list[int]]:
        """(ids, loss_mask) of a whole demonstration, prompt included, both of length T.

        `turns`: (assistant text, tool result texts) per turn; the last turn has None instead of
        results and is closed with `<|im_end|>` (loss_mask 1: the model learns to end its turn). The
        first turn's text continues after the prompt's `<reason>`. loss_mask is 1 exactly on the
        assistant text tokens (and the final `<|im_end|>`), 0 on the prompt and tool-response turns.
        """
        return self.render_trajectories([(problem, turns)])[0]

    def render_trajectories(self, items: Sequence[tuple[str, list[tuple[str, list[str] | None]]]]
                            ) -> list[tuple[list[int], list[int]]]:
        """`render_trajectory` of each (problem, turns), with every text piece of all of them tokenized
        in one `encode_texts` call (the same ids: each piece is still tokenized on its own)."""
        plans: list[list[tuple[list[int] | int, int]]] = []   # (literal ids | index into texts, loss mask)
        text = _Texts()

        def add(plan: list, pieces: Sequence[_Piece], m: int) -> None:
            for t, special in pieces:
                plan.append(([self.im_start_id if t == IM_START else self.im_end_id], m) if special else (text(t), m))

        for problem, turns in items:
            if not turns:
                raise ValueError("render_trajectory needs at least one assistant turn")
            if turns[0][0].startswith(REASON_OPEN):
                raise ValueError(f"the prompt already opens {REASON_OPEN}; start the first turn's text after it")
            plan: list[tuple[list[int] | int, int]] = [
                (self._prefix_ids, 0), (text("user\n" + user_message(problem)), 0), (self._gen_start_ids, 0)]
            for k, (gen, results) in enumerate(turns):
                last = k == len(turns) - 1
                if last != (results is None):
                    raise ValueError(f"turn {k}: only the last turn has no tool results (None); every earlier "
                                     "turn needs the list of its tool result texts")
                plan.append((text(gen), 1))
                if results is None:
                    plan.append(([self.im_end_id], 1))
                else:
                    add(plan, self._tool_response_pieces(results), 0)
            plans.append(plan)
        return self._realise(plans, text.texts)

    def render_chats(self, chats: Sequence[Sequence[tuple[str, str]]]) -> list[tuple[list[int], list[int]]]:
        """(ids, loss_mask) of each ChatML conversation given as (role, text) turns, roles `system`, `user`
        and `assistant`, texts as the model sees them (tool calls and `<tool_response>` blocks already
        written out: rstar2_core/sft/formats.py). Every turn is `<|im_start|>{role}\\n{text}<|im_end|>`, with
        `\\n` between turns; loss_mask is 1 exactly on the assistant texts and their `<|im_end|>`. The SFT
        rows that are not the recipe's problems (function calling, instruction following, chat) take this
        form; the texts of all conversations are tokenized in one `encode_texts` call."""
        plans: list[list[tuple[list[int] | int, int]]] = []
        text = _Texts()

        for chat in chats:
            if not chat or chat[-1][0] != "assistant":
                raise ValueError("render_chats: a conversation must end with an assistant turn")
            plan: list[tuple[list[int] | int, int]] = []
            for k, (role, body) in enumerate(chat):
                if role not in ("system", "user", "assistant"):
                    raise ValueError(f"render_chats: unknown role {role!r} (system, user, assistant)")
                m = int(role == "assistant")
                plan.append(([self.im_start_id], 0))
                if m:       # the header apart from the text, as at generation (the prompt ends with it)
                    plan += [(text("assistant\n"), 0), (text(body), 1)]
                else:
                    plan.append((text(f"{role}\n{body}"), 0))
                plan.append(([self.im_end_id], m))
                if k < len(chat) - 1:
                    plan.append((text("\n"), 0))
            plans.append(plan)
        return self._realise(plans, text.texts)

    def _realise(self, plans: list[list[tuple[list[int] | int, int]]], texts: list[str]
                 ) -> list[tuple[list[int], list[int]]]:
        """(ids, loss_mask) of each plan: pieces that are literal ids or indices into `texts`, encoded together."""
        encoded = self.encode_texts(texts)
        out = []
        for plan in plans:
            ids: list[int] = []
            mask: list[int] = []
            for piece, m in plan:
                part = encoded[piece] if isinstance(piece, int) else piece
                ids += part
                mask += [m] * len(part)
            out.append((ids, mask))
        return out
