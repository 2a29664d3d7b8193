"""Chat templates: output equal to transformers' apply_chat_template, clear errors, and a
sandbox that refuses escapes and stops runaway templates quickly."""
import time

import pytest

from services.tokenizer.chat_template import (ChatTemplate, ChatTemplateError, MessageLimits,
                                              RenderLimitError, RenderLimits)
from services.tokenizer.core import TokenizerCore
from services.tokenizer.testing import CHATML_TEMPLATE, write_tiny_tokenizer_dir

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "system_user": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Say hi.\nTwice, please."}],
    "multi_turn": [{"role": "system", "content": "Be kind."},
                   {"role": "user", "content": "Hi!"},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Tell me a joke about 日本 and 😀."}],
    "ends_with_assistant": [{"role": "user", "content": "Count to three."},
                            {"role": "assistant", "content": "One, two,"}],
    "empty_content": [{"role": "user", "content": ""}],
}

LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
ALTERNATING_WITH_NAMESPACE = (
    "{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.system = m['content'] %}{% endif %}{% endfor %}{{ bos_token }}"
    "{% for m in messages | rejectattr('role', 'equalto', 'system') %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if m['role'] == 'user' %}{{ '[INST] ' + (ns.system + '\n\n' if loop.first and ns.system else '')"
    " + m['content'] + ' [/INST]' }}{% else %}{% generation %}{{ m['content'] + eos_token }}"
    "{% endgeneration %}{% endif %}{% if not loop.last %}{{ ' ' }}{% endif %}{% endfor %}"
)
TOJSON_AND_TOOLS = (
    "{% if tools is not none %}TOOLS{% endif %}{% for m in messages %}"
    "{{ {'role': m.role, 'content': m.content, 'n': loop.index} | tojson }}{% if not loop.last %},{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<gen>{% endif %}"
)


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def smollm2_core(smollm2_dir):
    return TokenizerCore.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_tokenizer_dir(tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="module")
def transformers_tiny(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_template_renders_like_transformers(smollm2_core, transformers_smollm2, name,
                                                    add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = transformers_smollm2.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm2_core.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("name", ["ends_with_assistant", "multi_turn"])
def test_smollm2_continue_final_message_cuts_like_transformers(smollm2_core, transformers_smollm2,
                                                               name):
    messages = CONVERSATIONS[name]
    expected = transformers_smollm2.apply_chat_template(messages, tokenize=False,
                                                        continue_final_message=True)
    got = smollm2_core.apply_chat_template(messages, add_generation_prompt=False,
                                           continue_final_message=True)
    assert got == expected
    assert got.endswith(messages[-1]["content"])


def test_smollm2_tokenized_prompt_matches_transformers(smollm2_core, transformers_smollm2):
    messages = CONVERSATIONS["multi_turn"]
    expected = transformers_smollm2.apply_chat_template(messages, tokenize=True,
                                                        add_generation_prompt=True)
    if isinstance(expected, dict) or hasattr(expected, "keys"):
        expected = expected["input_ids"]
    text = smollm2_core.apply_chat_template(messages, add_generation_prompt=True)
    assert smollm2_core.encode_batch([text], add_special_tokens=False)[0] == list(expected)


@pytest.mark.parametrize("source", [CHATML_TEMPLATE, LLAMA3_STYLE, ALTERNATING_WITH_NAMESPACE,
                                    TOJSON_AND_TOOLS], ids=["chatml", "llama3", "mistral", "tojson"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_other_template_styles_render_like_transformers(tiny_dir, transformers_tiny, source,
                                                        add_generation_prompt):
    core = TokenizerCore.from_dir(tiny_dir)
    template = ChatTemplate(source, core.special_tokens)
    for messages in (CONVERSATIONS["multi_turn"], CONVERSATIONS["system_user"],
                     CONVERSATIONS["ends_with_assistant"]):
        expected = transformers_tiny.apply_chat_template(
            messages, chat_template=source, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_continue_final_message_trims_like_transformers_when_template_strips(tiny_dir,
                                                                            transformers_tiny):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, "}]
    expected = transformers_tiny.apply_chat_template(messages, chat_template=LLAMA3_STYLE,
                                                     tokenize=False, continue_final_message=True)
    template = ChatTemplate(LLAMA3_STYLE, {"bos_token": "<|im_start|>"})
    assert template.render(messages, continue_final_message=True) == expected


def test_template_raise_exception_is_a_clear_error():
    template = ChatTemplate(ALTERNATING_WITH_NAMESPACE, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("messages, match", [
    ([], "must not be empty"),
    ([{"role": "wizard", "content": "hi"}], "role must be one of"),
    ([{"role": "user"}], "content must be a string"),
    ([{"role": "user", "content": 3}], "content must be a string"),
])
def test_bad_messages_are_refused(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(CHATML_TEMPLATE).render(messages)


def test_continue_final_message_with_generation_prompt_is_refused():
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        ChatTemplate(CHATML_TEMPLATE).render(CONVERSATIONS["ends_with_assistant"],
                                             add_generation_prompt=True, continue_final_message=True)


def test_model_without_template_says_how_to_add_one(tmp_path):
    core = TokenizerCore.from_dir(write_tiny_tokenizer_dir(tmp_path, chat_template=None))
    assert core.info().has_chat_template is False
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        core.apply_chat_template(CONVERSATIONS["user_only"], add_generation_prompt=True)


def test_template_that_does_not_compile_is_refused():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m.content }")


FAST = RenderLimits(max_chars=100_000, max_render_s=0.3)


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = messages[0]['content'] * 300 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
], ids=["nested_range", "nested_string_loops", "exponential_macro"])
def test_runaway_template_is_stopped_at_the_time_limit(source):
    start = time.monotonic()
    with pytest.raises(RenderLimitError, match="too long"):
        ChatTemplate(source, limits=FAST).render(CONVERSATIONS["user_only"])
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{{ 'xxxxxxxxxx' }}{% endfor %}",
    "{{ 'x' * 1000000000 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ 'x' | center(1000000000) }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 9 ** 99999999 }}",
    "{% for i in range(1000000000) %}{% endfor %}",
], ids=["output", "str_mul", "concat_doubling", "plus_doubling", "center", "ljust", "percent",
        "format", "pow", "range"])
def test_huge_output_or_values_are_refused_quickly(source):
    start = time.monotonic()
    with pytest.raises(RenderLimitError):
        ChatTemplate(source, limits=FAST).render(CONVERSATIONS["user_only"])
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set x = messages.append({'role': 'user', 'content': 'injected'}) %}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{{ messages[0].update({'content': 'x'}) }}",
], ids=["list_class", "str_class", "cycler_globals", "namespace_globals", "list_append",
        "namespace_dunder", "dict_update"])
def test_sandbox_blocks_attribute_escapes_and_mutation(source):
    with pytest.raises(ChatTemplateError, match="unsafe|underscore"):
        ChatTemplate(source).render(CONVERSATIONS["user_only"])


def test_template_deep_recursion_is_a_clear_error():
    with pytest.raises(RenderLimitError):
        ChatTemplate("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").render(
            CONVERSATIONS["user_only"])


def test_messages_over_the_size_limit_are_refused_before_rendering():
    template = ChatTemplate(CHATML_TEMPLATE, message_limits=MessageLimits(max_chars=1000))
    with pytest.raises(ChatTemplateError, match="messages too long"):
        template.render([{"role": "user", "content": "x" * 2000}])
