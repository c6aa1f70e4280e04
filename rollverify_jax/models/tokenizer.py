"""Tokenizer over HF ``tokenizers``, loaded from an HF-layout directory, plus a Qwen-style chat template.

A directory holds ``tokenizer.json`` and optionally ``tokenizer_config.json`` (``eos_token``, ``pad_token``),
``special_tokens_map.json`` (older checkpoints keep the same keys there) and ``generation_config.json``
(``eos_token_id``, ``pad_token_id``). The stop ids rollout needs come from all of them, because real Qwen3
checkpoints split them: ``tokenizer_config.json`` names ``<|im_end|>`` while ``generation_config.json`` lists
``[<|im_end|>, <|endoftext|>]``.

Chat prompts render the checkpoint's own ``chat_template`` (``tokenizer_config.json``, or the
``chat_template.jinja`` file newer checkpoints keep beside it) in a sandboxed Jinja environment configured as
transformers configures its own, so an instruct model sees exactly the prompt format it was trained on; a
directory without a template falls back to the built-in single-turn ChatML.

``build_char_tokenizer`` writes the character-level tokenizer the embedded tiny default model uses.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Qwen3's template writes this empty think block after the generation prompt when enable_thinking=False,
# so the model answers without reasoning.
EMPTY_THINK = "<think>\n\n</think>\n\n"

# Jinja version of `chatml_prompt` for one system turn and user turns, written into the char tokenizer's
# tokenizer_config.json so HF `apply_chat_template` renders the same text as this module does.
CHATML_JINJA = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

Ids = Iterable[int]  # a list, or a 1-D numpy / JAX array


def chatml_prompt(
    user_message: str,
    system: str | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
) -> str:
    """Qwen-style ChatML text for one user turn (Qwen3 adds no default system prompt, unlike Qwen2.5).

    ``enable_thinking=False`` follows Qwen3's template and appends ``<think>\\n\\n</think>\\n\\n`` after the
    generation prompt; ``None`` or ``True`` leave the prompt open so the model may think.
    """
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": user_message})
    return chatml_messages(messages, add_generation_prompt, enable_thinking)


def chatml_messages(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, enable_thinking: bool | None = None
) -> str:
    """ChatML text for a whole conversation (system, user and assistant turns, in order), as ``CHATML_JINJA``
    renders it."""
    parts = [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages]
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
        if enable_thinking is False:
            parts.append(EMPTY_THINK)
    return "".join(parts)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as a list of dicts with a string ``role`` and ``content`` each (the form chat templates
    read); anything else is a ValueError that shows the first bad message."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(f"chat messages must be a non-empty list of {{'role': ..., 'content': ...}}, got "
                         f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"chat message {i} must be {{'role': str, 'content': str}}, got {m!r:.120}")
    return [dict(m) for m in messages]


def _read_json(path: Path) -> dict[str, Any]:
    """Optional config file: {} when absent, a clear error (naming the file) when unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it.") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data


def _token_content(value: Any) -> str | None:
    """HF configs write tokens either as a string or as an AddedToken dict ``{"content": ...}``."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"Expected a token string or {{'content': ...}} dict, got {value!r}.")


def _id_list(value: Any) -> list[int]:
    """``eos_token_id`` in generation_config.json is an int, a list of ints, or null."""
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, int | list):
        raise ValueError(f"Expected a token id or a list of ids, got {value!r}.")
    ids = [value] if isinstance(value, int) else value
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"Expected a token id or a list of ids, got {value!r}.")
    return list(ids)


def _dedup(ids: Iterable[int]) -> tuple[int, ...]:
    """Keeps the first occurrence of each id, so the order is stable across hosts and runs."""
    return tuple(dict.fromkeys(ids))


def _as_int_list(ids: Ids) -> list[int]:
    """Accepts numpy / JAX arrays and lists alike; ``tokenizers`` only takes Python ints."""
    return [int(i) for i in ids]


@dataclasses.dataclass(frozen=True, eq=False)  # identity eq/hash: usable as a dict key
class Tokenizer:
    """A loaded tokenizer with the ids rollout needs (eos, pad) resolved once at load time.

    ``vocab_size`` is one past the largest id (added tokens included): the number of rows the model's
    embedding must have at least.
    """

    hf: HFTokenizer
    path: Path
    vocab_size: int
    special_tokens: dict[str, int]
    eos_ids: tuple[int, ...]
    pad_id: int | None
    chat_template: str | None = None  # the checkpoint's Jinja template; None: the built-in ChatML
    template_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # bos_token etc. for the template

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], model_vocab_size: int | None = None) -> Tokenizer:
        """Loads ``path/tokenizer.json`` and its configs; checks the vocabulary fits ``model_vocab_size``."""
        path = Path(path)
        hf = _load_hf_tokenizer(path)
        vocab_size = _vocab_size(hf)
        if model_vocab_size is not None and vocab_size > model_vocab_size:
            raise ValueError(
                f"Tokenizer at {path} has vocab_size {vocab_size} (largest id {vocab_size - 1}) but the "
                f"model's vocab_size is {model_vocab_size}: its ids would index past the embedding. Use the "
                "tokenizer saved with this checkpoint, or a model config whose vocab_size is at least the "
                "tokenizer's."
            )
        config = {**_read_json(path / SPECIAL_TOKENS_MAP_FILE), **_read_json(path / TOKENIZER_CONFIG_FILE)}
        gen_config = _read_json(path / GENERATION_CONFIG_FILE)
        eos_ids = _eos_ids(hf, path, config, gen_config)
        return cls(
            hf=hf,
            path=path,
            vocab_size=vocab_size,
            special_tokens=_special_tokens(hf),
            eos_ids=eos_ids,
            pad_id=_pad_id(hf, path, config, gen_config, eos_ids),
            chat_template=_chat_template(path, config),
            template_tokens={k: v for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                             if (v := _token_content(config.get(k))) is not None},
        )

    def fingerprint(self) -> str:
        """A SHA-256 of everything that turns text into ids here (the tokenizer's own serialisation, the chat
        template and its tokens, the stop and pad ids): what a resume compares, not the directory's name."""
        parts = [self.hf.to_str(), self.chat_template or "", json.dumps(self.template_tokens, sort_keys=True),
                 json.dumps([list(self.eos_ids), self.pad_id])]
        return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()

    def token_id(self, token: str) -> int:
        """Id of one token string; a KeyError naming the tokenizer if it is not in the vocabulary."""
        token_id = self.hf.token_to_id(token)
        if token_id is None:
            raise KeyError(f"Token {token!r} is not in the vocabulary of the tokenizer at {self.path}.")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = False, plain_text: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (e.g. ``<|im_end|>``) become one id.

        ``plain_text``: the text is data, not markup: a special token written in it is encoded as its characters
        (its ordinary pieces), never as the special id, so ``decode(..., skip_special_tokens=False)`` gives the
        text back. For text nobody vetted, e.g. a tool's output in the rollout: ``<|endoftext|>`` printed by a
        program must not become an EOS id inside the policy's context. Added tokens that are not special (tool
        tags) are still one id each, as HF's ``split_special_tokens`` leaves them."""
        hf = self._plain_hf if plain_text else self.hf
        try:
            return hf.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:  # tokenizers raises a bare Exception, e.g. for a char missing from a vocab
            raise ValueError(self._cannot_encode(text, e)) from e

    def _cannot_encode(self, text: str, error: Exception) -> str:
        """Why ``text`` does not encode: the characters a vocabulary without an unknown token lacks (tokenizers says
        only "Missing [UNK] token"), and where such characters come from."""
        missing = sorted({c for c in text if not self._encodes(c)})
        if not missing:
            return f"Tokenizer at {self.path} cannot encode {text[:80]!r}: {error}"
        return (f"Tokenizer at {self.path} cannot encode {text[:80]!r}: its vocabulary has no token for "
                f"{''.join(missing)!r} and no unknown token. If the text comes from a template (the chat template, "
                "TrainConfig.chat_template; a dataset's prompt template, its apply_template argument; a system "
                "prompt), turn that off for this tokenizer, or use a tokenizer that covers these characters.")

    def _encodes(self, char: str) -> bool:
        try:
            self.hf.encode(char, add_special_tokens=False)
        except Exception:  # tokenizers' bare Exception, as in encode
            return False
        return True

    @functools.cached_property
    def _plain_hf(self) -> HFTokenizer:
        """A copy of ``hf`` that splits special tokens as text (``encode_special_tokens``): a flag of the
        tokenizer object, so it lives on a copy of its own rather than being flipped on the shared one, which
        other threads may be encoding with."""
        hf = HFTokenizer.from_str(self.hf.to_str())
        hf.encode_special_tokens = True
        return hf

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """``encode`` over many texts at once (``tokenizers`` batches them in Rust)."""
        try:
            encodings = self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        except Exception as e:
            for text in texts:  # the first text that does not encode, named with its characters
                self.encode(text, add_special_tokens)
            raise ValueError(f"Tokenizer at {self.path} cannot encode the batch: {e}") from e
        return [enc.ids for enc in encodings]

    def decode(self, ids: Ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a list or a 1-D array); ids outside the vocabulary are dropped."""
        return self.hf.decode(_as_int_list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Iterable[Ids], skip_special_tokens: bool = True) -> list[str]:
        """``decode`` over many sequences (e.g. the rows of an ``int32[B, T]`` array)."""
        rows = [_as_int_list(ids) for ids in batch]
        return self.hf.decode_batch(rows, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        user_message: str,
        system: str | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> str:
        """Prompt text for one user turn (and an optional system turn); see ``render_messages``."""
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": user_message})
        return self.render_messages(messages, add_generation_prompt, enable_thinking)

    def render_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> str:
        """Prompt text for a conversation: the checkpoint's chat template when it has one, else ChatML (see
        `chatml_messages`), which needs the ``<|im_start|>``/``<|im_end|>`` special tokens so the markers encode as
        single ids rather than as plain text. ``enable_thinking`` reaches the template as the variable of that
        name (Qwen3's switch), as transformers' ``apply_chat_template(..., enable_thinking=...)`` passes it; None
        leaves it undefined (the template's default)."""
        messages = check_messages(messages)
        if self.chat_template is not None:
            extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
            return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                        **self.template_tokens, **extra)
        missing = [t for t in (IM_START, IM_END) if t not in self.special_tokens]
        if missing:
            raise ValueError(
                f"Tokenizer at {self.path} has no special token(s) {missing}, so it cannot use the ChatML "
                "chat template. Encode raw prompts instead (TrainConfig.chat_template = False), or use a "
                f"tokenizer that defines {IM_START} and {IM_END} as special tokens."
            )
        return chatml_messages(messages, add_generation_prompt, enable_thinking)

    def render_prompt(
        self,
        text: str,
        *,
        chat: bool,
        messages: Sequence[Mapping[str, Any]] | None = None,
        system: str | None = None,
        enable_thinking: bool | None = None,
    ) -> str:
        """The text a policy is prompted with (a record's, through ``data.prompts.PromptRenderer``).

        Without ``chat``: ``text`` as is (a dataset record's ``prompt``, its template applied). With ``chat``:
        ``messages`` (a record's own chat prompt) when given, else ``text`` as one user turn, in the chat template;
        ``system`` is added as the first turn unless the messages hold a system turn of their own (the record's
        own system message takes precedence)."""
        if not chat:
            if system is not None:
                raise ValueError("A system prompt needs chat=True: raw prompts have nowhere to put it.")
            return text
        turns = check_messages(messages) if messages is not None else [{"role": "user", "content": text}]
        if system is not None and not any(m["role"] == "system" for m in turns):
            turns.insert(0, {"role": "system", "content": system})
        return self.render_messages(turns, enable_thinking=enable_thinking)


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The directory's chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of named templates of which 'default' is used)."""
    if (path / CHAT_TEMPLATE_FILE).is_file():
        return (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{path / TOKENIZER_CONFIG_FILE} lists chat templates {sorted(map(str, named))} but "
                             "none named 'default'; name the one to use 'default'.")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path / TOKENIZER_CONFIG_FILE}: chat_template must be a string, got {template!r}.")
    return template


def render_chat_template(template: str, messages: list[dict[str, str]], **variables: Any) -> str:
    """Renders a checkpoint's chat template as transformers does (sandboxed Jinja, trimmed blocks, its
    ``raise_exception``, ``tojson`` and ``strftime_now`` helpers); a template error names the template's
    message."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"The checkpoint's chat template failed: {e}") from e


def _load_hf_tokenizer(path: Path) -> HFTokenizer:
    """Reads ``tokenizer.json``, failing with the path and what belongs there."""
    expected = (
        f"expected a directory holding {TOKENIZER_FILE} (and optionally {TOKENIZER_CONFIG_FILE}, "
        f"{GENERATION_CONFIG_FILE}), such as an HF checkpoint directory or one written by "
        "build_char_tokenizer"
    )
    if not path.exists():
        raise FileNotFoundError(f"Tokenizer directory {path} does not exist; {expected}.")
    if not path.is_dir():
        raise NotADirectoryError(f"Tokenizer path {path} is not a directory; {expected}.")
    file = path / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"No {TOKENIZER_FILE} in {path}; {expected}. Slow-tokenizer files (vocab.json + merges.txt) "
            f"are not read: convert them once with transformers' AutoTokenizer(...).save_pretrained()."
        )
    try:
        return HFTokenizer.from_file(str(file))
    except Exception as e:
        raise ValueError(f"Cannot parse {file} as a HF tokenizers file: {e}") from e


def _vocab_size(hf: HFTokenizer) -> int:
    """One past the largest id, so gaps in added-token ids still count against the embedding size."""
    vocab = hf.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def _special_tokens(hf: HFTokenizer) -> dict[str, int]:
    """Added tokens flagged special (the ones ``skip_special_tokens`` drops), content → id, by id."""
    decoder = hf.get_added_tokens_decoder()
    return {decoder[i].content: i for i in sorted(decoder) if decoder[i].special}


def _lookup(hf: HFTokenizer, token: str, path: Path, source: str) -> int:
    """Id of a token named in a config file; an error naming the file when the vocabulary lacks it."""
    token_id = hf.token_to_id(token)
    if token_id is None:
        raise ValueError(
            f"{source} in {path} names token {token!r}, which is not in {path / TOKENIZER_FILE}."
        )
    return token_id


def _eos_ids(
    hf: HFTokenizer, path: Path, config: dict[str, Any], gen_config: dict[str, Any]
) -> tuple[int, ...]:
    """Stop ids: tokenizer_config's eos_token first, then generation_config's eos_token_id(s)."""
    ids = []
    eos_token = _token_content(config.get("eos_token"))
    if eos_token is not None:
        ids.append(_lookup(hf, eos_token, path, f"eos_token of {TOKENIZER_CONFIG_FILE}"))
    ids.extend(_id_list(gen_config.get("eos_token_id")))
    return _dedup(ids)


def _pad_id(
    hf: HFTokenizer, path: Path, config: dict[str, Any], gen_config: dict[str, Any], eos_ids: tuple[int, ...]
) -> int | None:
    """tokenizer_config's pad_token, else generation_config's pad_token_id, else the first eos id."""
    pad_token = _token_content(config.get("pad_token"))
    if pad_token is not None:
        return _lookup(hf, pad_token, path, f"pad_token of {TOKENIZER_CONFIG_FILE}")
    pad_ids = _id_list(gen_config.get("pad_token_id"))
    if pad_ids:
        return pad_ids[0]
    return eos_ids[0] if eos_ids else None


def load_tokenizer(path: str, model_vocab_size: int | None = None) -> Tokenizer:
    """Gin entry point: ``load_tokenizer.path`` is the tokenizer (or checkpoint) directory.

    Args:
      path: directory holding ``tokenizer.json`` (required).
      model_vocab_size: the policy's embedding rows; when given, a larger tokenizer is an error.
    """
    return Tokenizer.from_dir(path, model_vocab_size=model_vocab_size)


def _default_eos(special_tokens: Sequence[str]) -> list[str]:
    """Qwen3's stop tokens (``<|im_end|>`` then ``<|endoftext|>``) when present, else the first special."""
    eos = [t for t in (IM_END, "<|endoftext|>") if t in special_tokens]
    return eos or list(special_tokens[:1])


def _default_pad(special_tokens: Sequence[str], eos_tokens: Sequence[str]) -> str | None:
    """A dedicated ``<pad>`` when present, else ``<|endoftext|>`` (as Qwen3), else the first eos."""
    for token in ("<pad>", "<|endoftext|>"):
        if token in special_tokens:
            return token
    return eos_tokens[0] if eos_tokens else None


def _char_hf_tokenizer(chars: str, special_tokens: Sequence[str], added_tokens: Sequence[str] = ()) -> HFTokenizer:
    """One id per character (in order of first appearance), then the special tokens, then ``added_tokens``
    (non-special: one id each, matched before characters, kept by ``decode(skip_special_tokens=True)``).

    Every character is its own pre-token (``[\\s\\S]`` also matches newlines) and ``Fuse`` joins tokens
    without spaces, so ``decode(encode(s)) == s`` for any ``s`` over the alphabet.
    """
    alphabet = list(dict.fromkeys(chars))
    if not alphabet:
        raise ValueError("build_char_tokenizer needs a non-empty alphabet.")
    tokens = [*special_tokens, *added_tokens]
    clashes = [t for t in tokens if t in alphabet or not t]
    if clashes or len(set(tokens)) != len(tokens):
        raise ValueError(
            "Special and added tokens must be distinct, non-empty and not single alphabet characters; "
            f"got {special_tokens} and {added_tokens}."
        )
    hf = HFTokenizer(models.WordLevel({c: i for i, c in enumerate(alphabet)}, unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    if added_tokens:
        hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return hf


def build_char_tokenizer(
    chars: str,
    special_tokens: Sequence[str],
    path: str | os.PathLike[str],
    eos_tokens: Sequence[str] | None = None,
    pad_token: str | None = None,
    added_tokens: Sequence[str] = (),
) -> Tokenizer:
    """Writes a character-level tokenizer (for the tiny default model) to ``path`` and loads it back.

    Files written: ``tokenizer.json``; ``tokenizer_config.json`` (eos_token = ``eos_tokens[0]``, pad_token,
    and a ChatML ``chat_template`` when ``<|im_start|>``/``<|im_end|>`` are special tokens, so HF
    ``AutoTokenizer`` renders the same prompts); ``generation_config.json`` (eos_token_id = all
    ``eos_tokens``, pad_token_id). Ids: characters first, in order, then ``special_tokens``, then ``added_tokens``.

    Args:
      chars: the alphabet; duplicates are ignored. Text outside it cannot be encoded.
      special_tokens: e.g. ``["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]``.
      path: output directory (created if needed).
      eos_tokens: stop tokens; default ``<|im_end|>``, ``<|endoftext|>`` where present, else the first
        special token.
      pad_token: default ``<pad>``, else ``<|endoftext|>``, else the first eos token.
      added_tokens: multi-character tokens that are text, not control (e.g. the tool tags ``<calculator>``):
        one id each after the special tokens, and ``decode`` keeps them even with ``skip_special_tokens``.
    """
    special_tokens = list(special_tokens)
    eos_tokens = list(eos_tokens) if eos_tokens is not None else _default_eos(special_tokens)
    pad_token = pad_token if pad_token is not None else _default_pad(special_tokens, eos_tokens)
    unknown = [t for t in [*eos_tokens, pad_token] if t is not None and t not in special_tokens]
    if unknown:
        raise ValueError(f"eos/pad tokens {unknown} must be among special_tokens {special_tokens}.")
    hf = _char_hf_tokenizer(chars, special_tokens, list(added_tokens))
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    hf.save(str(out / TOKENIZER_FILE))
    _write_char_configs(hf, out, special_tokens, eos_tokens, pad_token)
    return Tokenizer.from_dir(out)


def _write_char_configs(
    hf: HFTokenizer, out: Path, special_tokens: list[str], eos_tokens: list[str], pad_token: str | None
) -> None:
    """tokenizer_config.json and generation_config.json in the keys HF checkpoints use."""
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_tokens[0] if eos_tokens else None,
        "pad_token": pad_token,
        "clean_up_tokenization_spaces": False,
    }
    if IM_START in special_tokens and IM_END in special_tokens:
        tok_config["chat_template"] = CHATML_JINJA
    gen_config = {
        "eos_token_id": [hf.token_to_id(t) for t in eos_tokens],
        "pad_token_id": hf.token_to_id(pad_token) if pad_token is not None else None,
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(gen_config, indent=2) + "\n", encoding="utf-8")
