"""The GGUF-built tokenizer and chat template against transformers' conversion of the same file."""

from __future__ import annotations

from typing import Any

import pytest

from minimill.models.chat_template import ChatTemplateError, render_chat_template
from minimill.models.types import LoadedModel

TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    " 123 4567 89 3.14159 1,000,000",
    "def f(x):\n    return x**2  # square\n\nprint(f(12))\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "naïve café résumé 日本語のテキスト Ελληνικά русский",
    "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧‍👦",
    "   leading\t\ttabs\n\n\n  trailing   ",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "I'm here, you're there, they'll go, we'd see, it's done.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>minimill<file_sep>src/a.py<|endoftext|>",
    "x=1e-5;y=0x1F;z=0b1010 // comment",
    "",
    "a" * 300,
    "\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_and_text_as_transformers(text: str, loaded_f32: LoadedModel,
                                           hf_gguf_tokenizer: Any) -> None:
    tok = loaded_f32.tokenizer
    ids = tok.encode(text)
    assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf_gguf_tokenizer.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens(loaded_f32: LoadedModel, hf_gguf_tokenizer: Any) -> None:
    tok = loaded_f32.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.vocab_size == len(hf_gguf_tokenizer) == 49152
    assert tok.encode("<|im_end|>") == [2]
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.decode([1, 4093, 2]) == "user"
    assert tok.token_to_str(4093) == "user"
    assert tok.token_to_str(2) == "<|im_end|>"


CONVERSATIONS = [
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi"}],  # the template adds its default system prompt
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3? Ünïcödé 😀"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(messages: list[dict[str, str]],
                                            add_generation_prompt: bool,
                                            loaded_f32: LoadedModel,
                                            hf_gguf_tokenizer: Any) -> None:
    ours = loaded_f32.tokenizer.apply_chat_template(messages, add_generation_prompt)
    theirs = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_template_errors_are_typed() -> None:
    msgs = [{"role": "user", "content": "x"}]
    strict = ("{% if messages[0]['role'] != 'system' %}"
              "{{ raise_exception('need system') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="need system"):
        render_chat_template(strict, msgs)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat_template("{% for m in messages %}", msgs)
    # Templates are untrusted: the sandbox refuses to reach Python internals.
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", msgs)


def test_template_helpers_and_special_tokens() -> None:
    template = ("{{ bos_token }}{% for m in messages %}{% generation %}{{ m | tojson }}"
                "{% endgeneration %}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
                "{{ eos_token }}")
    msgs = [{"role": "user", "content": "é<b>"}, {"role": "user", "content": "2"},
            {"role": "user", "content": "3"}]
    out = render_chat_template(template, msgs, special_tokens={"bos_token": "<s>",
                                                              "eos_token": "</s>"})
    assert out == ('<s>{"role": "user", "content": "é<b>"}{"role": "user", "content": "2"}</s>')
