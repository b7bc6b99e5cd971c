"""--enable_thinking (ms-swift's): a hybrid-thinking template's `enable_thinking` switch, set for every
rendering of the run; a template without the switch renders the same and the run says so."""

from __future__ import annotations

import pytest

from swiftlite.config import build_config

#: The part of Qwen3's chat template that reads the switch (its generation prompt), on top of a plain
#: template: what matters is that the rendering depends on `enable_thinking` as Qwen3's does.
QWEN3_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")


@pytest.fixture
def tokenizers(tmp_path):
    from swiftlite.models import loading
    template = tmp_path / "qwen3_like.jinja"
    template.write_text(QWEN3_LIKE)
    loading._TOKENIZERS.clear()

    def tok(**values):
        return loading.load_tokenizer(build_config({"model": "tiny-llama", "template": str(template), **values}))
    return tok


def test_false_adds_the_empty_thinking_block_to_every_rendering(tokenizers):
    from swiftlite.data.tokenize import render
    msgs = [{"role": "user", "content": "hi"}]
    default = render(tokenizers(), msgs, add_generation_prompt=True)
    off = render(tokenizers(enable_thinking=False), msgs, add_generation_prompt=True)
    on = render(tokenizers(enable_thinking=True), msgs, add_generation_prompt=True)
    assert "<think>" not in default and default == on
    assert off.startswith(default + "<think>") and off.rstrip().endswith("</think>")
    # the template's text carries the switch, so the tokenization cache key does too
    assert tokenizers(enable_thinking=False).chat_template != tokenizers().chat_template


def test_a_template_without_the_switch_says_the_flag_changes_nothing(capsys):
    from swiftlite.models import loading
    loading._TOKENIZERS.clear()
    plain = loading.load_tokenizer(build_config({"model": "tiny-llama"}))
    flagged = loading.load_tokenizer(build_config({"model": "tiny-llama", "enable_thinking": False}))
    assert flagged.chat_template == plain.chat_template
    assert "--enable_thinking false: this chat template has no enable_thinking switch" in capsys.readouterr().out
