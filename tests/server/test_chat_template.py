"""Chat templates as transformers renders them, BOS never doubled, generation_config.json defaults as vLLM applies
them; through the real ``openai`` client against the real server.

Tokenizers are trained with the ``tokenizers`` library and saved with transformers (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``; :mod:`tests.support.tokenizers`); oracles are transformers'
``AutoTokenizer.apply_chat_template`` and greedy ``generate``.
"""

from __future__ import annotations

import json
import os

import openai
import pytest
import torch

from server.api import create_app
from server.api.generation import generation_defaults
from server.api.serve import build_engine
from server.chat_template import ChatTemplate, ChatTemplateError, checkpoint_template
from server.config import ConfigError, build_config
from server.tokenizer import HFTokenizer
from tests.support.checkpoints import load_hf, make_checkpoint
from tests.support.serving import FakeEngine, UvicornThread
from tests.support.tokenizers import CHATML, make_tokenizer

DEEPSEEK_LIKE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<|User|>{{ m.content }}"
    "{% else %}<|Assistant|>{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}{% endif %}"
    "{% if loop.index >= 4 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|>{% endif %}{{ {'n': messages|length, 'é': '<&>'} | tojson }}"
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "hi", "reasoning_content": "be nice", "tool_calls": None},
    {"role": "user", "content": "how are you?"},
]


def _hf_tokenizer(path: str):  # noqa: ANN202
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("template", [CHATML, DEEPSEEK_LIKE], ids=["chatml", "deepseek_like"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(tmp_path, template: str, add_generation_prompt: bool) -> None:  # noqa: ANN001
    path = make_tokenizer(str(tmp_path), template)
    hf, ours = _hf_tokenizer(path), HFTokenizer(path)
    chat = ChatTemplate(ours.chat_template, "test")  # type: ignore[arg-type]
    for kwargs in ({}, {"enable_thinking": False}):
        want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        got = chat.render(MESSAGES, ours.special_tokens, add_generation_prompt, kwargs=kwargs)
        assert got == want
        ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, **kwargs)["input_ids"]
        assert ours.encode(got) == ids
    if template == DEEPSEEK_LIKE:  # BOS once: from the template, not again from the post-processor
        assert ids[0] == ours.bos_token_id == 0 and ids[1] != 0


def test_continue_final_message_equals_transformers(tmp_path) -> None:  # noqa: ANN001
    path = make_tokenizer(str(tmp_path), CHATML)
    hf, ours = _hf_tokenizer(path), HFTokenizer(path)
    chat = ChatTemplate(CHATML, "test")
    messages = [*MESSAGES, {"role": "assistant", "content": "I am"}]
    want = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert chat.render(messages, ours.special_tokens, False, continue_final_message=True) == want
    with pytest.raises(ChatTemplateError, match="continue_final_message: cannot be combined"):
        chat.render(messages, ours.special_tokens, True, continue_final_message=True)


def test_template_errors_name_the_field(tmp_path) -> None:  # noqa: ANN001
    chat = ChatTemplate(CHATML, "test")
    with pytest.raises(ChatTemplateError, match="messages: the chat template refused .*must start with system"):
        chat.render([{"role": "assistant", "content": "x"}], {})
    with pytest.raises(ChatTemplateError, match=r"chat_template_kwargs: \['messages'\] are set by the server"):
        chat.render(MESSAGES, {}, kwargs={"messages": []})
    with pytest.raises(ValueError, match="origin: the chat template is not valid Jinja .line 1"):
        ChatTemplate("{% for %}", "origin")
    with pytest.raises(Exception, match="underscore"):  # the sandbox: no way to CPython internals
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}", "t").render([{"role": "user"}], {})


def test_template_locations_as_transformers_reads_them(tmp_path) -> None:  # noqa: ANN001
    """chat_template.jinja wins over tokenizer_config.json; a named list picks 'default'; additional templates."""
    path = make_tokenizer(str(tmp_path / "t"), CHATML)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = [{"name": "default", "template": DEEPSEEK_LIKE}, {"name": "tool_use", "template": "x"}]
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    assert checkpoint_template(path, config) == _hf_tokenizer(path).chat_template == CHATML
    os.remove(os.path.join(path, "chat_template.jinja"))
    assert checkpoint_template(path, config) == _hf_tokenizer(path).chat_template
    assert ChatTemplate(checkpoint_template(path, config), "t").source == DEEPSEEK_LIKE  # type: ignore[arg-type]
    os.makedirs(os.path.join(path, "additional_chat_templates"))
    with open(os.path.join(path, "additional_chat_templates", "rag.jinja"), "w") as f:
        f.write("rag")
    with pytest.raises(ValueError, match=r"several chat templates \['rag'\] and none named 'default'"):
        ChatTemplate(checkpoint_template(path, config), "t")  # type: ignore[arg-type]


def test_generation_defaults_as_vllm(tmp_path) -> None:  # noqa: ANN001
    gen = {
        "temperature": 0.6,
        "top_p": 1.0,
        "top_k": 20,
        "repetition_penalty": 1.0,
        "max_new_tokens": 64,
        "do_sample": True,
        "eos_token_id": [1, 2],
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert generation_defaults(str(tmp_path), "auto") == {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    assert generation_defaults(str(tmp_path), "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7.0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p: must be in"):
        generation_defaults(str(tmp_path), "auto")


def test_chat_template_option_is_checked_at_start_up(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="chat-template: .*neither a Jinja template nor a readable file"):
        build_config(cli_values={"chat-template": str(tmp_path / "missing.jinja")})
    with pytest.raises(ConfigError, match="chat-template: .*not valid Jinja"):
        build_config(cli_values={"chat-template": "{% if %}"})


def _fake_server(tokenizer_path: str, **options: str) -> UvicornThread:
    engine = FakeEngine()
    engine.tokenizer = HFTokenizer(tokenizer_path)
    return UvicornThread(create_app(build_config(cli_values={"log-level": "warning", **options}), engine))


def test_no_template_is_a_400_naming_chat_template_and_override_fixes_it(tmp_path) -> None:  # noqa: ANN001
    path = make_tokenizer(str(tmp_path / "t"), None)
    with _fake_server(path) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="random-qwen3-moe", messages=MESSAGES[:2], max_tokens=2)  # type: ignore[arg-type]
        assert err.value.status_code == 400 and "chat_template" in err.value.message
        assert "--chat-template" in err.value.message
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    with _fake_server(path, **{"chat-template": str(template)}) as srv:
        r = openai.OpenAI(base_url=srv.url + "/v1", api_key="x").post(
            "/../tokenize", cast_to=object, body={"messages": MESSAGES, "add_generation_prompt": True}
        )
    want = _hf_tokenizer(make_tokenizer(str(tmp_path / "t2"), CHATML)).apply_chat_template(
        MESSAGES, add_generation_prompt=True
    )["input_ids"]
    assert r["tokens"] == want  # type: ignore[index]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):  # noqa: ANN001, ANN201
    """A tiny Qwen3-MoE checkpoint with the DeepSeek-like template (BOS from the template) behind the real server
    (one spawned worker); generation_config.json stops on an id transformers' greedy output reaches."""
    path = str(tmp_path_factory.mktemp("chat"))
    hf_tok = _hf_tokenizer(make_tokenizer(path, DEEPSEEK_LIKE))
    make_checkpoint("qwen3_moe", path, vocab_size=len(hf_tok), eos_token_id=1)
    prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    hf = load_hf(path)
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():  # (an explicit mask: the prompt starts with BOS id 0, which generate would take for padding)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    greedy = out[0, len(prompt) :].tolist()
    stop_at = next(j for j in range(1, len(greedy)) if greedy[j] not in greedy[:j] and greedy[j] > 1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, greedy[stop_at]], "max_new_tokens": 7, "top_k": 50}, f)
    config = build_config(
        {"model": path, "ep-size": 1, "max-model-len": 128, "served-model-name": "tiny", "log-level": "warning"}
    )
    with UvicornThread(create_app(config, build_engine(config))) as srv:
        srv.facts = {"prompt": prompt, "greedy": greedy, "stop_at": stop_at, "tokenizer": hf_tok}
        yield srv


def test_chat_prompt_and_completion_equal_transformers(chat_server) -> None:  # noqa: ANN001
    facts = chat_server.facts
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused")
    resp = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert resp.usage is not None and resp.usage.prompt_tokens == len(facts["prompt"])
    choice = resp.choices[0]
    assert choice.model_extra is not None and choice.model_extra["prompt_token_ids"] == facts["prompt"]
    assert choice.model_extra["token_ids"] == facts["greedy"]
    assert choice.message.content == facts["tokenizer"].decode(facts["greedy"], skip_special_tokens=True)


def test_generation_config_stop_ids_and_max_tokens(chat_server) -> None:  # noqa: ANN001
    """Generation stops on any id of generation_config.json's eos_token_id list; its max_new_tokens is the default
    max_tokens (its top_k 50 is transformers' default, which vLLM does not apply: greedy stays greedy anyway)."""
    facts = chat_server.facts
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused")
    resp = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
    )
    assert resp.choices[0].model_extra["token_ids"] == facts["greedy"][: facts["stop_at"] + 1]  # type: ignore[index]
    assert resp.choices[0].finish_reason == "stop"
    resp = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 7
    assert resp.choices[0].finish_reason == "length"


def test_tokenize_messages_and_prompt_as_transformers(chat_server) -> None:  # noqa: ANN001
    """/tokenize: messages exactly as the chat request's prompt; a prompt with the tokenizer's BOS by default."""
    import httpx

    tok = chat_server.facts["tokenizer"]
    r = httpx.post(chat_server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert r["tokens"] == chat_server.facts["prompt"]
    r = httpx.post(chat_server.url + "/tokenize", json={"messages": MESSAGES, "chat_template": "{{ 1 }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    r = httpx.post(chat_server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert r["tokens"] == tok("hello world")["input_ids"] and r["tokens"][0] == tok.bos_token_id
    completion = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused").completions.create(
        model="tiny", prompt="hello world", max_tokens=1, temperature=0, extra_body={"return_token_ids": True}
    )
    assert completion.choices[0].model_extra["prompt_token_ids"] == r["tokens"]  # type: ignore[index]
