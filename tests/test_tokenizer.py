"""Tests for rollverify_jax.models.tokenizer: tokenizers are built in tmp_path, never fetched from a hub."""

import json
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from rollverify_jax.data.prompts import PromptRenderer
from rollverify_jax.models.tokenizer import (
    EMPTY_THINK,
    Tokenizer,
    build_char_tokenizer,
    chatml_messages,
    chatml_prompt,
    load_tokenizer,
)

ALPHABET = string.ascii_letters + string.digits + " \n\t\r+-*/=().,:;!?'\"<>|_é数🙂"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Step 1: 12 + 7 = 19\nStep 2: 19 * 3 = 57\nAnswer: 57",
    "Rollout pauses, verification keeps a prefix, and the rest is regenerated.",
    "  leading spaces, trailing spaces  and\ttabs\n\nand blank lines",
    "Unicode too: naïve café, 数学, émojis 🙂.",
]


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("char_tok")
    build_char_tokenizer(ALPHABET, SPECIALS, path)
    return path


@pytest.fixture(scope="module")
def char_tok(char_dir):
    return Tokenizer.from_dir(char_dir)


def _write_json(path, obj):
    path.write_text(json.dumps(obj), encoding="utf-8")


def _train_bpe(path, with_bos=False):
    """A small byte-level BPE (the Qwen family's kind) trained on SENTENCES, saved as path/tokenizer.json."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS[:3],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(SENTENCES * 3, trainer=trainer)
    if with_bos:
        bos = hf.token_to_id("<|endoftext|>")
        hf.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
        )
    path.mkdir(parents=True, exist_ok=True)
    hf.save(str(path / "tokenizer.json"))
    return hf


# (a) character tokenizer --------------------------------------------------------------------------


def test_char_round_trip_keeps_spaces_and_newlines(char_tok):
    text = "  Step 1: 3 + 4 = 7\n\nStep 2:\t7 * 2 = 14 \r\nAnswer: 14\n  "
    ids = char_tok.encode(text)
    assert len(ids) == len(text)  # one id per character, whitespace included
    assert char_tok.decode(ids) == text
    assert char_tok.decode_batch([ids, ids[:5]]) == [text, text[:5]]
    assert char_tok.encode_batch([text, " "]) == [ids, char_tok.encode(" ")]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, max_size=60))
def test_char_round_trip_property(char_tok, text):
    # A special token spelled out in the text ('<pad>' is in the alphabet) is parsed as that token, as HF
    # tokenizers do, and decoding drops specials: such texts do not round-trip by design.
    assume(not any(special in text for special in char_tok.special_tokens))
    assert char_tok.decode(char_tok.encode(text)) == text


def test_char_ids_are_alphabet_order_then_specials(char_tok):
    assert [char_tok.token_id(c) for c in ALPHABET] == list(range(len(ALPHABET)))
    assert char_tok.special_tokens == {t: len(ALPHABET) + i for i, t in enumerate(SPECIALS)}
    assert char_tok.vocab_size == len(ALPHABET) + len(SPECIALS)


def test_char_special_tokens_encode_as_one_id_and_are_skipped(char_tok):
    sp = char_tok.special_tokens
    ids = char_tok.encode("a <|im_end|>\n<pad>")
    assert ids == [
        char_tok.token_id("a"),
        char_tok.token_id(" "),
        sp["<|im_end|>"],
        char_tok.token_id("\n"),
        sp["<pad>"],
    ]
    assert char_tok.decode(ids) == "a \n"
    assert char_tok.decode(ids, skip_special_tokens=False) == "a <|im_end|>\n<pad>"


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_plain_text_encodes_no_special_id_and_round_trips(char_tok, tmp_path, kind):
    """Text nobody vetted (a tool's output) holding every special token of the vocabulary: ``plain_text`` encodes
    each as its characters, never its id, and decoding (keeping or skipping specials) gives the text back; the
    default encoding still reads them as markup."""
    if kind == "char":
        tok = char_tok
    else:
        _train_bpe(tmp_path)
        tok = Tokenizer.from_dir(tmp_path)
    text = "Answer: 5 " + " | ".join(tok.special_tokens) + "\n<|im_end|><|endoftext|>"
    special_ids = set(tok.special_tokens.values())
    ids = tok.encode(text, plain_text=True)
    assert len(special_ids) >= 3 and not special_ids & set(ids)
    assert tok.decode(ids, skip_special_tokens=False) == tok.decode(ids) == text
    assert special_ids <= set(tok.encode(text))  # as markup: each is one id


def test_char_eos_and_pad_ids(char_tok, char_dir):
    sp = char_tok.special_tokens
    assert char_tok.eos_ids == (sp["<|im_end|>"], sp["<|endoftext|>"])
    assert char_tok.pad_id == sp["<pad>"]
    config = json.loads((char_dir / "tokenizer_config.json").read_text())
    generation = json.loads((char_dir / "generation_config.json").read_text())
    assert (config["eos_token"], config["pad_token"]) == ("<|im_end|>", "<pad>")
    assert generation == {
        "eos_token_id": [sp["<|im_end|>"], sp["<|endoftext|>"]],
        "pad_token_id": sp["<pad>"],
    }


def test_char_explicit_eos_and_pad(tmp_path):
    specials = ["<eos>", "<stop>"]
    tok = build_char_tokenizer("ab", specials, tmp_path, eos_tokens=["<stop>", "<eos>"], pad_token="<eos>")
    assert tok.eos_ids == (3, 2)
    assert tok.pad_id == 2


def test_char_decode_accepts_arrays(char_tok):
    ids = np.asarray([char_tok.encode("ab c"), char_tok.encode("x\ny ")], dtype=np.int32)
    assert char_tok.decode(ids[0]) == "ab c"
    assert char_tok.decode_batch(ids) == ["ab c", "x\ny "]


def test_char_unknown_character_is_a_clear_error(char_tok):
    with pytest.raises(ValueError, match="cannot encode"):
        char_tok.encode("~")


def test_char_builder_rejects_bad_specials(tmp_path):
    with pytest.raises(ValueError, match="single alphabet characters"):
        build_char_tokenizer("ab", ["a"], tmp_path)
    with pytest.raises(ValueError, match="must be among special_tokens"):
        build_char_tokenizer("ab", ["<x>"], tmp_path, pad_token="<pad>")


def test_char_tokenizer_matches_transformers(char_dir, char_tok):
    from transformers import AutoTokenizer

    peer = AutoTokenizer.from_pretrained(str(char_dir))
    text = "Q: 2 + 2 =\n  ?<|im_end|> done\t"
    ids = char_tok.encode(text)
    assert peer.encode(text, add_special_tokens=False) == ids
    assert peer.decode(ids, skip_special_tokens=True) == char_tok.decode(ids)
    assert peer.decode(ids, skip_special_tokens=False) == char_tok.decode(ids, skip_special_tokens=False)
    assert peer.eos_token_id == char_tok.eos_ids[0] and peer.pad_token_id == char_tok.pad_id


# (b) trained BPE vs transformers ------------------------------------------------------------------


@pytest.mark.parametrize("with_bos", [False, True])
def test_bpe_parity_with_transformers(tmp_path, with_bos):
    from transformers import PreTrainedTokenizerFast

    _train_bpe(tmp_path, with_bos=with_bos)
    tok = Tokenizer.from_dir(tmp_path)
    peer = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    texts = [*SENTENCES, "unseen words: zygote quorum", "<|im_start|>user\nhi<|im_end|>\n", ""]
    for text in texts:
        for add in (False, True):
            ids = tok.encode(text, add_special_tokens=add)
            assert ids == peer.encode(text, add_special_tokens=add), (text, add)
            for skip in (False, True):
                assert tok.decode(ids, skip_special_tokens=skip) == peer.decode(ids, skip_special_tokens=skip)
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.encode_batch(texts) == [peer.encode(t, add_special_tokens=False) for t in texts]
    assert tok.vocab_size == len(peer)
    assert tok.special_tokens == {t: peer.convert_tokens_to_ids(t) for t in SPECIALS[:3]}


# (c) eos / pad ids from config files --------------------------------------------------------------


def test_eos_ids_from_both_configs(tmp_path):
    hf = _train_bpe(tmp_path)
    end, im_end = hf.token_to_id("<|endoftext|>"), hf.token_to_id("<|im_end|>")
    _write_json(tmp_path / "tokenizer_config.json", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    _write_json(tmp_path / "generation_config.json", {"eos_token_id": [im_end, end, im_end]})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_ids == (im_end, end)  # deduplicated, tokenizer_config first
    assert tok.pad_id == end


def test_eos_dict_form_and_int_id_and_pad_fallbacks(tmp_path):
    hf = _train_bpe(tmp_path)
    end, im_end = hf.token_to_id("<|endoftext|>"), hf.token_to_id("<|im_end|>")
    eos = {"content": "<|endoftext|>", "special": True}
    _write_json(tmp_path / "tokenizer_config.json", {"eos_token": eos})
    _write_json(tmp_path / "generation_config.json", {"eos_token_id": im_end, "pad_token_id": im_end})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_ids == (end, im_end)
    assert tok.pad_id == im_end  # generation_config's pad_token_id when tokenizer_config has none
    (tmp_path / "generation_config.json").unlink()
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_ids == (end,) and tok.pad_id == end  # pad falls back to the first eos id


def test_special_tokens_map_is_a_fallback(tmp_path):
    hf = _train_bpe(tmp_path)
    tokens_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    _write_json(tmp_path / "special_tokens_map.json", tokens_map)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_ids == (hf.token_to_id("<|im_end|>"),)
    assert tok.pad_id == hf.token_to_id("<|endoftext|>")


def test_no_configs_means_no_eos(tmp_path):
    _train_bpe(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_ids == () and tok.pad_id is None


def test_eos_token_missing_from_vocab_names_file(tmp_path):
    _train_bpe(tmp_path)
    _write_json(tmp_path / "tokenizer_config.json", {"eos_token": "</s>"})
    with pytest.raises(ValueError, match=r"eos_token of tokenizer_config.json.*'</s>'"):
        Tokenizer.from_dir(tmp_path)


def test_bad_json_names_file(tmp_path):
    _train_bpe(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        Tokenizer.from_dir(tmp_path)


# (d) vocabulary larger than the model's -----------------------------------------------------------


def test_vocab_too_large_names_both_sizes(char_dir, char_tok):
    size = char_tok.vocab_size
    with pytest.raises(ValueError, match=rf"vocab_size {size}\b.*model's vocab_size is {size - 1}\b"):
        Tokenizer.from_dir(char_dir, model_vocab_size=size - 1)
    assert Tokenizer.from_dir(char_dir, model_vocab_size=size).vocab_size == size
    assert Tokenizer.from_dir(char_dir, model_vocab_size=size + 64).vocab_size == size  # padded embeddings


# (e) missing files --------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=rf"{missing}.*does not exist.*tokenizer.json"):
        Tokenizer.from_dir(missing)


def test_missing_tokenizer_json(tmp_path):
    _write_json(tmp_path / "tokenizer_config.json", {"eos_token": "<|im_end|>"})
    with pytest.raises(FileNotFoundError, match=rf"No tokenizer.json in {tmp_path}"):
        Tokenizer.from_dir(tmp_path)


def test_path_is_a_file(char_dir):
    with pytest.raises(NotADirectoryError, match="not a directory"):
        Tokenizer.from_dir(char_dir / "tokenizer.json")


# (f) chat template --------------------------------------------------------------------------------


def test_chat_template_exact_text(char_tok):
    assert char_tok.apply_chat_template("2+2?") == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert char_tok.apply_chat_template("2+2?", system="Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert char_tok.apply_chat_template("hi", enable_thinking=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert char_tok.apply_chat_template("hi", enable_thinking=True) == chatml_prompt("hi")
    no_prompt = char_tok.apply_chat_template("hi", add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"
    assert chatml_prompt("x", enable_thinking=False).endswith(EMPTY_THINK)


def test_chat_template_matches_transformers_render(char_dir, char_tok):
    from transformers import AutoTokenizer

    peer = AutoTokenizer.from_pretrained(str(char_dir))
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "1+1=?"}]
    for thinking in (None, False):
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        rendered = peer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert rendered == char_tok.apply_chat_template("1+1=?", system="sys", enable_thinking=thinking)


def test_a_prompt_renderer_encodes_a_records_prompt(char_tok):
    sp = char_tok.special_tokens
    chat = PromptRenderer(char_tok, chat=True).encode({"prompt": "1+1", "answer": "2"})
    assert chat.dtype == np.int32 and chat[0] == sp["<|im_start|>"]
    assert char_tok.decode(chat) == "user\n1+1\nassistant\n"
    assert char_tok.decode(chat, skip_special_tokens=False) == chatml_prompt("1+1")
    assert PromptRenderer(char_tok).encode({"prompt": "1+1"}).tolist() == char_tok.encode("1+1")
    with pytest.raises(ValueError, match="chat=True"):
        PromptRenderer(char_tok, system="s").encode({"prompt": "1+1"})


def test_render_prompt_takes_a_records_messages_and_system_prompt(char_tok, tmp_path):
    """A record's own messages are rendered whole (multi-turn, system included) by the checkpoint's template and by
    the ChatML fallback alike; TrainConfig.system_prompt fills in only where the record brings no system message;
    enable_thinking reaches the template as its variable."""
    turns = [{"role": "system", "content": "Own."}, {"role": "user", "content": "1+1?"},
             {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2?"}]
    build_char_tokenizer(ALPHABET, SPECIALS, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    _write_json(tmp_path / "tokenizer_config.json", config)
    fallback = Tokenizer.from_dir(tmp_path)
    assert char_tok.chat_template is not None and fallback.chat_template is None
    for tok in (char_tok, fallback):
        own = tok.render_prompt("2+2?", chat=True, messages=turns, system="Global.", enable_thinking=False)
        assert own == chatml_messages(turns, enable_thinking=False) and own.endswith(EMPTY_THINK)
        added = tok.render_prompt("2+2?", chat=True, messages=turns[1:], system="Global.")
        assert added == chatml_messages([{"role": "system", "content": "Global."}, *turns[1:]])
        assert tok.render_prompt("2+2?", chat=True, system="S") == chatml_prompt("2+2?", system="S")
        assert tok.render_prompt("2+2?", chat=False, messages=turns) == "2+2?"  # a raw prompt: the record's text
    with pytest.raises(ValueError, match="chat message 1 must be"):
        char_tok.render_prompt("x", chat=True, messages=[turns[0], {"role": "user"}])


def test_the_run_encodes_and_counts_its_prompts_alike(char_tok):
    """Rollout and evaluation encode (PromptRenderer.encode) and the start-up length check counts
    (PromptRenderer.lengths) the same prompt, rendered with the run's TrainConfig settings."""
    from rollverify_jax.run.builder import prompt_renderer
    from rollverify_jax.run.spec import TrainConfig

    train = TrainConfig(chat_template=True, system_prompt="Be brief.", enable_thinking=False)
    renderer = prompt_renderer(train, char_tok)
    assert renderer == PromptRenderer(char_tok, chat=True, system="Be brief.", enable_thinking=False)
    records = [{"prompt": "1+1?", "answer": "2"},
               {"prompt": "2+2?", "answer": "4", "messages": [{"role": "system", "content": "Own system."},
                                                              {"role": "user", "content": "2+2?"}]}]
    encoded = [renderer.encode(r) for r in records]
    assert char_tok.decode(encoded[0], skip_special_tokens=False) == chatml_prompt("1+1?", "Be brief.", True, False)
    assert "Own system." in char_tok.decode(encoded[1]) and "Be brief." not in char_tok.decode(encoded[1])
    assert renderer.render(records[0]) == char_tok.decode(encoded[0], skip_special_tokens=False)
    for chunk in (1, 4096):  # repeated prompts are encoded once, whatever the batches
        assert renderer.lengths(records * 2, chunk=chunk).tolist() == [len(e) for e in encoded] * 2
    with pytest.raises(ValueError, match="TrainConfig.system_prompt shapes the chat prompt: set "
                                         "TrainConfig.chat_template = True"):
        TrainConfig(system_prompt="Be brief.")
    with pytest.raises(ValueError, match="enable_thinking must be True, False or None"):
        TrainConfig(chat_template=True, enable_thinking="no")


def test_chat_template_needs_chatml_special_tokens(tmp_path):
    tok = build_char_tokenizer("abc ", ["<|endoftext|>"], tmp_path)
    with pytest.raises(ValueError, match=r"no special token\(s\) \['<\|im_start\|>', '<\|im_end\|>'\]"):
        tok.apply_chat_template("abc")
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert PromptRenderer(tok).encode({"prompt": "abc"}).tolist() == [0, 1, 2]


# An instruct model's own template that is not ChatML (Llama-3-like headers, a bos token, a system default,
# a role check through raise_exception, a loop control): the prompt must be the one transformers renders.
_OTHER_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|start|>system\nDefault.<|end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if m['content'] == 'skip' %}{% continue %}{% endif %}"
    "<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
)


@pytest.mark.parametrize("where", ["tokenizer_config", "named_list", "jinja_file"])
def test_checkpoint_chat_template_renders_as_transformers_does(tmp_path, where):
    from transformers import AutoTokenizer

    build_char_tokenizer(ALPHABET, [*SPECIALS, "<s>", "<|start|>", "<|end|>"], tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["bos_token"] = "<s>"
    if where == "tokenizer_config":
        config["chat_template"] = _OTHER_TEMPLATE
    elif where == "named_list":
        config["chat_template"] = [{"name": "tool_use", "template": "x"},
                                   {"name": "default", "template": _OTHER_TEMPLATE}]
    else:
        del config["chat_template"]
        (tmp_path / "chat_template.jinja").write_text(_OTHER_TEMPLATE)
    _write_json(tmp_path / "tokenizer_config.json", config)
    ours = Tokenizer.from_dir(tmp_path)
    peer = AutoTokenizer.from_pretrained(str(tmp_path))
    for system in (None, "Be brief."):
        for thinking in (None, False):
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": " 1+1=? "}]
            kwargs = {} if thinking is None else {"enable_thinking": thinking}
            want = peer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
            got = ours.apply_chat_template(" 1+1=? ", system=system, enable_thinking=thinking)
            assert got == want and got.startswith("<s><|start|>system\n")
    assert "Default." in ours.apply_chat_template("hi") and "Default." not in ours.apply_chat_template("hi", "S")


def test_chat_template_errors_name_the_problem(tmp_path):
    build_char_tokenizer(ALPHABET, SPECIALS, tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match="chat template failed: only user turns"):
        Tokenizer.from_dir(tmp_path).apply_chat_template("hi")
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    _write_json(tmp_path / "tokenizer_config.json", {**config, "chat_template": [{"name": "rag", "template": "x"}]})
    with pytest.raises(ValueError, match="none named 'default'"):
        Tokenizer.from_dir(tmp_path)


# factory ------------------------------------------------------------------------------------------


def test_load_tokenizer(char_dir, char_tok):
    tok = load_tokenizer(char_dir, model_vocab_size=1000)
    assert tok.vocab_size == char_tok.vocab_size and tok.eos_ids == char_tok.eos_ids
    with pytest.raises(ValueError):
        load_tokenizer(char_dir, model_vocab_size=2)
