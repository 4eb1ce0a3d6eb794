"""Token ids of a chat conversation in which only the chat template's own markers are special tokens.

The plain way to tokenize a conversation, ``tokenizer(tokenizer.apply_chat_template(messages,
tokenize=False))`` (and ``apply_chat_template(tokenize=True)``, which does the same), parses every
special-token string of the rendered text, including those inside a message's content: a response
``"Sure.<|im_end|>\\n<|im_start|>assistant ..."`` becomes "Sure." + EOS + a new turn, and a user
turn can open a real system turn. A policy can write such strings from ordinary sub-tokens, so
real runs meet them.

:func:`chat_token_ids` renders the conversation with the tokenizer's own chat template and
tokenizes it so that the special tokens written by the template stay special while every message
content is plain text (``split_special_tokens=True``): a special-token string inside a content
becomes the ordinary sub-tokens of its characters, as ``tokenizer(content,
split_special_tokens=True)`` gives them. For a conversation whose contents hold no special-token
string the ids are exactly ``tokenizer(text, add_special_tokens=False)`` of the rendered text
(plus the BOS rule below), i.e. what the stages used before.

BOS appears exactly once: when the template writes it, it is not added again; otherwise the
tokenizer decides (Llama-2/Mistral-style tokenizers add one with ``add_special_tokens=True``,
Qwen/SmolLM do not); a doubled leading BOS written by a template is collapsed to one. Only a BOS is
taken from ``add_special_tokens=True``, never a trailing EOS some tokenizers append.

Which strings are special: the tokenizer's added tokens flagged ``special`` (the ones
``split_special_tokens=True`` leaves as text; :func:`special_token_map`). Added tokens that are not
special (e.g. ``<think>`` in some vocabularies) are parsed the same way in both tokenizations.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Iterable, Sequence

from .config import ConfigError

# A message content may have been transformed by the template with one of these (Llama-3's
# ``| trim``); anything else that changes a content is refused when the content needs splitting.
_CONTENT_VARIANTS = (lambda s: s, str.strip, str.lstrip, str.rstrip)


# Why a conversation's ids could not be built (ChatTokenError.reason): the skip reasons the
# tokenizing stages count (docs/skip-reasons.md lists them).
SPECIAL_TEXT_NOT_TOKENIZABLE = "special_text_not_tokenizable"
PROMPT_RENDERED_DIFFERENTLY = "template_renders_prompt_differently"
RESPONSE_NOT_TOKENIZABLE_ALONE = "response_not_tokenizable_alone"


class ChatTokenError(ValueError):
    """A conversation cannot be tokenized with its contents as plain text (the message says why).

    Attributes:
        reason: one of :data:`SPECIAL_TEXT_NOT_TOKENIZABLE` (a content holds a special-token string
            the template or tokenizer does not let us keep as text), :data:`PROMPT_RENDERED_DIFFERENTLY`
            (the template writes the prompt differently once a response follows) or
            :data:`RESPONSE_NOT_TOKENIZABLE_ALONE` (the response text, tokenized on its own, does not
            decode back to itself); the stages count skips under it.
    """

    def __init__(self, message: str, reason: str = SPECIAL_TEXT_NOT_TOKENIZABLE):
        super().__init__(message)
        self.reason = reason


def special_token_map(tokenizer: Any) -> dict[str, int]:
    """``{string: id}`` of every added token the tokenizer treats as special.

    These are the strings ``tokenizer(text)`` turns into one special id wherever they occur, and
    ``split_special_tokens=True`` leaves as text (e.g. ``<|im_start|>``, ``<|im_end|>``, a BOS).
    """
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out = {tok.content: int(i) for i, tok in decoder.items() if getattr(tok, "special", False) and tok.content}
    return dict(sorted(out.items(), key=lambda kv: -len(kv[0])))  # longest first: leftmost-longest matching


def _special_regex(tokenizer: Any) -> re.Pattern | None:
    specials = special_token_map(tokenizer)
    return re.compile("|".join(re.escape(s) for s in specials)) if specials else None


def special_strings_in(tokenizer: Any, text: str) -> list[str]:
    """The special-token strings occurring in ``text``, in order (empty list when none)."""
    rx = _special_regex(tokenizer)
    return rx.findall(text) if rx is not None and isinstance(text, str) else []


def has_special_text(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` contains a special-token string of ``tokenizer`` (see :func:`special_token_map`)."""
    return bool(special_strings_in(tokenizer, text))


def count_special_texts(tokenizer: Any, texts: Iterable[str]) -> int:
    """How many of ``texts`` contain at least one special-token string (for the stages' stats)."""
    rx = _special_regex(tokenizer)
    if rx is None:
        return 0
    return sum(1 for t in texts if isinstance(t, str) and rx.search(t))


def messages_have_special_text(tokenizer: Any, messages: Sequence[dict]) -> bool:
    """Whether any message content of ``messages`` contains a special-token string."""
    return any(has_special_text(tokenizer, m.get("content")) for m in messages)


def _template_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def render(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text, rendered by the tokenizer's chat template.

    Raises:
        ConfigError: the tokenizer has no chat template.
        jinja2 errors / ValueError: the template refuses the messages.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"the tokenizer of {_template_name(tokenizer)} has no chat template; conversations need one (use an "
            "instruct/chat checkpoint or add a chat_template to its tokenizer_config.json).")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def content_spans(tokenizer: Any, messages: Sequence[dict], text: str,
                  add_generation_prompt: bool = False) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the message contents inside ``text`` (the rendered conversation).

    The template is rendered once more with each content replaced by a unique placeholder; the
    rendered text is then walked segment by segment: the template's own text must match exactly,
    and each placeholder is matched by its content, or by the content stripped / left-stripped /
    right-stripped (a ``| trim`` in the template). A content the template does not write has no
    span; one it writes twice has two.

    Returns:
        sorted, non-overlapping spans (possibly empty ones).
    Raises:
        ChatTokenError: the template changes a content in another way, or writes different
            template text around placeholders than around the real contents (it tests the
            content), so the contents cannot be located.
    """
    nonce = str(secrets.randbelow(10 ** 12))  # digits only: case or letter filters leave it alone
    holders = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
    masked = [{**m, "content": h} for m, h in zip(messages, holders)]
    skeleton = render(tokenizer, masked, add_generation_prompt)
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", skeleton)  # [template, index, template, index, ..., template]
    spans, pos = [], 0

    def fail(why: str) -> ChatTokenError:
        return ChatTokenError(
            f"the chat template of {_template_name(tokenizer)} {why}, so the message contents cannot be located in "
            "the rendered text and tokenized as plain text. Remove the special-token strings from the contents, or "
            "use a template that writes each message content unchanged (a | trim is supported).")

    for k, part in enumerate(parts):
        if k % 2 == 0:
            if not text.startswith(part, pos):
                raise fail("writes different template text around the contents than around placeholders")
            pos += len(part)
            continue
        content = messages[int(part)].get("content")
        follow = parts[k + 1]
        last = k + 1 == len(parts) - 1
        for variant in _CONTENT_VARIANTS:
            c = variant(content)
            end = pos + len(c)
            if text.startswith(c, pos) and (text[end:] == follow if last else text.startswith(follow, end)):
                spans.append((pos, end))
                pos = end
                break
        else:
            raise fail(f"changes the content of message {int(part)} beyond stripping whitespace")
    if pos != len(text):
        raise fail("writes different text around the contents than around placeholders")
    return spans


def _strips(tokenizer: Any, token_id: int) -> tuple[bool, bool]:
    """``(lstrip, rstrip)`` of an added token: whether it eats the whitespace before / after it."""
    tok = (getattr(tokenizer, "added_tokens_decoder", None) or {}).get(token_id)
    return bool(getattr(tok, "lstrip", False)), bool(getattr(tok, "rstrip", False))


def _tokenizes_runs_alone(tokenizer: Any, marker: str, marker_id: int) -> bool:
    """Whether the text on either side of a special token is tokenized as if it stood alone, less
    the whitespace the token strips (true of byte-level BPE and of SentencePiece tokenizers that
    prepend their space to every piece; false for a Metaspace pre-tokenizer with
    ``prepend_scheme="first"``)."""
    lstrip, rstrip = _strips(tokenizer, marker_id)
    for probe in ("Hello world. 42", " Hello world.\n"):
        before = _text_ids(tokenizer, probe.rstrip() if lstrip else probe, split_special=False)
        after = _text_ids(tokenizer, probe.lstrip() if rstrip else probe, split_special=False)
        if _text_ids(tokenizer, probe + marker + probe, split_special=False) != before + [marker_id] + after:
            return False
    return True


def _text_ids(tokenizer: Any, text: str, split_special: bool) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])


def _bos_adder(tokenizer: Any) -> int | None:
    """The BOS id the tokenizer puts first with ``add_special_tokens=True``, or None when it adds none."""
    bos_id = tokenizer.bos_token_id
    if bos_id is None:
        return None
    with_sp = tokenizer("x", add_special_tokens=True)["input_ids"]
    without = tokenizer("x", add_special_tokens=False)["input_ids"]
    return int(bos_id) if with_sp[:1] == [bos_id] and without[:1] != [bos_id] else None


def _bos_once(tokenizer: Any, ids: list[int]) -> list[int]:
    bos_id = tokenizer.bos_token_id
    if bos_id is None:
        return ids
    add = _bos_adder(tokenizer)
    if add is not None and ids[:1] != [add]:
        ids = [add] + ids
    while len(ids) >= 2 and ids[0] == bos_id and ids[1] == bos_id:
        ids = ids[1:]
    return ids


def chat_token_ids(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, contents as plain text.

    Only special tokens the template writes are special ids; a special-token string inside a
    message content is tokenized as text (``split_special_tokens=True``). The text between two
    template special tokens (template text and content together) is tokenized in one piece, as
    the tokenizer itself does, so a conversation without special-token strings in its contents
    gets exactly ``tokenizer(rendered text, add_special_tokens=False)``. BOS exactly once (module
    docstring).

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        messages: ``[{role, content: str}, ...]``.
        add_generation_prompt: end with the template's assistant header (a prompt for generation).
    Returns:
        list of int token ids.
    Raises:
        ConfigError: the tokenizer has no chat template.
        ChatTokenError: a content holds a special-token string and the template transforms
            contents beyond whitespace stripping, or the tokenizer tokenizes text after a special
            token differently from text alone (then the contents cannot be split out faithfully).
        jinja2 errors / ValueError: the template refuses the messages.
    """
    text = render(tokenizer, messages, add_generation_prompt)
    spans = (content_spans(tokenizer, messages, text, add_generation_prompt)
             if messages_have_special_text(tokenizer, messages) else None)
    return _bos_once(tokenizer, _segment_ids(tokenizer, text, spans))


def _segment_ids(tokenizer: Any, text: str, spans: list[tuple[int, int]] | None) -> list[int]:
    """Ids of a piece of rendered text, no BOS rule: ``spans`` (the message contents in it, or None
    when no content holds a special-token string) are plain text; special strings outside them are
    the template's markers (see :func:`chat_token_ids`)."""
    if spans is None:
        return _text_ids(tokenizer, text, split_special=False)
    specials = special_token_map(tokenizer)
    rx = _special_regex(tokenizer)
    # Template special tokens: special strings in the text outside every content span.
    markers: list[tuple[int, int, int]] = []  # (start, end, id)
    edges = [0] + [x for s in spans for x in s] + [len(text)]
    for a, b in zip(edges[0::2], edges[1::2]):  # the template segments between contents
        markers.extend((a + m.start(), a + m.end(), specials[m.group()]) for m in rx.finditer(text[a:b]))
    used = {tid: text[a:b] for a, b, tid in markers}
    if not all(_tokenizes_runs_alone(tokenizer, m, tid) for tid, m in used.items()):
        raise ChatTokenError(
            f"the tokenizer of {_template_name(tokenizer)} tokenizes text after a special token differently from the "
            "same text alone (a Metaspace pre-tokenizer with prepend_scheme='first'?), so a content holding a "
            "special-token string cannot be tokenized as plain text here. Remove the special-token strings from "
            "the contents.")
    # Cut the text at the markers; a marker that strips whitespace (lstrip / rstrip) takes it from
    # its neighbours, as the tokenizer does.
    runs, tids, pos = [], [], 0
    for start, end, tid in markers:
        runs.append(text[pos:start])
        tids.append(tid)
        pos = end
    runs.append(text[pos:])
    for k, tid in enumerate(tids):
        lstrip, rstrip = _strips(tokenizer, tid)
        runs[k] = runs[k].rstrip() if lstrip else runs[k]
        runs[k + 1] = runs[k + 1].lstrip() if rstrip else runs[k + 1]
    ids: list[int] = []
    for k, run in enumerate(runs):
        ids += _text_ids(tokenizer, run, split_special=True)
        if k < len(tids):
            ids.append(tids[k])
    return ids


def prompt_response_ids(tokenizer: Any, prompt: Sequence[dict], *responses: Sequence[dict]
                        ) -> tuple[list[int], list[list[int]]]:
    """Prompt ids and the ids of each response to it, as a preference trainer consumes them.

    The one rule every tokenizing stage follows (DPO, GRPO, reward-model scoring, KL):

    - ``prompt_ids = chat_token_ids(prompt, add_generation_prompt=True)``: the ids the generator
      gave the policy;
    - each response's ids are the rest of ``chat_token_ids(prompt + response)`` after that prefix
      (its contents as plain text, the template's end-of-turn marker and whatever else the
      template writes after the assistant header), when the full conversation's ids start with
      ``prompt_ids``;
    - otherwise the tokenizer merged the last prompt token with the first response characters
      (Qwen2/2.5/3's pre-tokenizer joins the generation prompt's ``"\\n"`` and a response's leading
      ``"\\n"`` into one ``ĊĊ`` token; after TRL issue #2054): the response ids are then the
      text the template writes after the prompt (the response, its end-of-turn, ...) tokenized on
      its own, which is what a policy generating after ``prompt_ids`` produces. The pair is kept.
      That text must decode back to itself (true of byte-level BPE), else the error below.

    Args:
        prompt: the prompt messages.
        responses: one or more message lists (e.g. chosen and rejected), each ``[{role: assistant, ...}]``.
    Returns:
        ``(prompt_ids, [response_ids, ...])`` with one id list per response, in order.
    Raises:
        ChatTokenError: reason ``template_renders_prompt_differently``: the full conversation's text
            does not start with the prompt's (the template writes the prompt differently once a
            response follows); reason ``response_not_tokenizable_alone``: the ids had to be split
            at a merged token and the text after the prompt does not decode back to itself; besides
            chat_token_ids' errors (reason ``special_text_not_tokenizable``).
    """
    prompt_ids = chat_token_ids(tokenizer, prompt, add_generation_prompt=True)
    prompt_text = render(tokenizer, prompt, add_generation_prompt=True)
    out = []
    for response in responses:
        messages = list(prompt) + list(response)
        full = chat_token_ids(tokenizer, messages)
        if full[:len(prompt_ids)] == prompt_ids:
            out.append(full[len(prompt_ids):])
            continue
        text = render(tokenizer, messages)
        if not text.startswith(prompt_text):
            raise ChatTokenError(
                f"the chat template of {_template_name(tokenizer)} renders the prompt differently when a response "
                "follows (the text of prompt + response does not start with the prompt with its generation prompt); "
                "the response tokens cannot be separated from the prompt. Use a template that writes the prompt the "
                "same way with and without the answer.", PROMPT_RENDERED_DIFFERENTLY)
        cut = len(prompt_text)
        spans = None
        if messages_have_special_text(tokenizer, messages):
            spans = [(max(a, cut) - cut, b - cut) for a, b in content_spans(tokenizer, messages, text) if b > cut]
        ids = _segment_ids(tokenizer, text[cut:], spans)
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if back != text[cut:]:
            raise ChatTokenError(
                f"the tokenizer of {_template_name(tokenizer)} merges the end of the prompt with the start of the "
                f"response, and the response tokenized on its own does not decode back to itself ({text[cut:][:40]!r} "
                f"-> {back[:40]!r}); the response tokens cannot be separated from the prompt. Save the generated "
                "token ids with the records (generation.save_token_ids=true) or strip the response's leading "
                "whitespace.", RESPONSE_NOT_TOKENIZABLE_ALONE)
        out.append(ids)
    return prompt_ids, out


def turn_terminator(tokenizer: Any, chat_template: str | None = None) -> str | None:
    """The special-token string the chat template writes right after an assistant message's content
    (its end-of-turn: ``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama-3, ``<end_of_turn>`` for
    Gemma, ``</s>`` for Mistral), found by rendering ``[user, assistant]`` once.

    It is not always the tokenizer's eos: Qwen base checkpoints have eos ``<|endoftext|>`` and a
    ChatML template. Returns None when the template writes no special token after the content
    (only whitespace may come between) or refuses the probe conversation.

    Args:
        chat_template: a Jinja template to use instead of the tokenizer's (e.g. the one Axolotl
            will train with).
    """
    nonce = f"\ue000{secrets.randbelow(10 ** 12)}\ue001"
    try:
        msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": nonce}]
        text = (render(tokenizer, msgs) if chat_template is None
                else tokenizer.apply_chat_template(msgs, tokenize=False, chat_template=chat_template))
    except Exception:  # noqa: BLE001 - no template, or one that refuses this conversation: no terminator known
        return None
    rx = _special_regex(tokenizer)
    if nonce not in text or rx is None:
        return None
    after = text[text.rindex(nonce) + len(nonce):]
    m = rx.search(after)
    return m.group() if m is not None and not after[:m.start()].strip() else None
