"""The replica's tokenizing step: what a real tokenizer or its chat template refuses for the client's
input is InvalidRequest (the replica's 400), with the refusal's reason; anything else still raises."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from app.replica import LONG_PROMPT_CHARS, longest_token_chars, plain_backend, tokenize, tokenized
from tests.chat_templates import ALTERNATE, ALTERNATING_TEMPLATE
from workers.modeling.synthetic import CHAT_TEMPLATE, build_byte_tokenizer
from workers.protocol import GenerateRequest
from workers.serving.sampling import InvalidRequest, SamplingParams


@pytest.fixture(scope="module")
def strict_tokenizer(tmp_path_factory):
    """A real tokenizer directory, loaded as a served model's would be, whose chat template raises
    when roles do not alternate."""
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = ALTERNATING_TEMPLATE
    path = tmp_path_factory.mktemp("alternating-tokenizer")
    tokenizer.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def chat(*turns: tuple[str, str]) -> GenerateRequest:
    messages = [{"role": role, "content": content} for role, content in turns]
    return GenerateRequest("tenant", "chat", SamplingParams(), messages=messages)


def completion(prompt: str | list[int]) -> GenerateRequest:
    return GenerateRequest("tenant", "completion", SamplingParams(), prompt=prompt)


def test_template_raise_exception_is_invalid_request(strict_tokenizer):
    """The template's own message reaches the client."""
    with pytest.raises(InvalidRequest, match="chat template") as info:
        tokenize(strict_tokenizer, chat(("user", "hi"), ("user", "again")))
    assert ALTERNATE in str(info.value)


def test_alternating_messages_are_tokenized(strict_tokenizer):
    """The same template, satisfied, gives the template's ids."""
    ids = tokenize(strict_tokenizer, chat(("user", "hi"), ("assistant", "yo"), ("user", "?")))
    expected = strict_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert strict_tokenizer.decode(ids) == expected


@pytest.mark.parametrize(
    "template",
    ["{% for m in messages %}{{ m['content'] | no_such_filter }}{% endfor %}", "{% for m in messages %}"],
    ids=["unknown-filter", "syntax-error"],
)
def test_broken_template_is_invalid_request(template):
    """Whatever jinja raises while rendering the chat template is a refusal of this request, not a
    crash of the replica's generate."""
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = template
    with pytest.raises(InvalidRequest, match="chat template"):
        tokenize(tokenizer, chat(("user", "hi")))


def test_lone_surrogate_prompt_is_invalid_request(strict_tokenizer):
    """A string holding a lone surrogate (the tokenizer raises TypeError) is refused with a reason a
    client can act on, as a completion prompt and as chat content."""
    with pytest.raises(InvalidRequest, match="surrogate"):
        tokenize(strict_tokenizer, completion("ok \ud800"))
    with pytest.raises(InvalidRequest, match="surrogate"):
        tokenize(strict_tokenizer, chat(("user", "\udfff")))


def test_model_without_chat_template_is_invalid_request():
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(InvalidRequest, match="no chat template"):
        tokenize(tokenizer, chat(("user", "hi")))


def test_prompt_ids_and_text(strict_tokenizer):
    assert tokenize(strict_tokenizer, completion([5, 6])) == [5, 6]
    assert tokenize(strict_tokenizer, completion("hi")) == strict_tokenizer("hi")["input_ids"]


class BrokenTokenizer:
    """A tokenizer failing for reasons of its own, not the input's."""

    chat_template = CHAT_TEMPLATE

    def __call__(self, text: str) -> dict:
        raise RuntimeError("tokenizer backend crashed")

    def apply_chat_template(self, *args, **kwargs) -> list[int]:
        raise MemoryError


def test_other_failures_are_not_turned_into_400s():
    """Only the refusals of bad input become InvalidRequest: a failing tokenizer still raises."""
    with pytest.raises(RuntimeError, match="crashed"):
        tokenize(BrokenTokenizer(), completion("hi"))
    with pytest.raises(MemoryError):
        tokenize(BrokenTokenizer(), chat(("user", "hi")))


@pytest.mark.parametrize(
    "text",
    ["hi", "", "Hi é€中😀 ok", "a <|begin_of_text|> b <|eot_id|>", "  spaces  \n\ttabs"],
    ids=["short", "empty", "multibyte", "special-token-text", "whitespace"],
)
def test_the_rust_backend_gives_the_tokenizers_own_ids(strict_tokenizer, text):
    """Tokenized in the Rust backend directly, a completion's prompt and a chat's rendered template
    get the ids the tokenizer's own call and apply_chat_template give."""
    assert tokenize(strict_tokenizer, completion(text)) == strict_tokenizer(text)["input_ids"]
    turns = [{"role": "user", "content": text}]
    expected = strict_tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    assert tokenize(strict_tokenizer, chat(("user", text))) == list(expected["input_ids"])


def test_a_backend_set_to_truncate_is_not_used_directly(tmp_path):
    """A tokenizer whose backend truncates (tokenizer.json can say so) is called as the tokenizer, which
    tokenizes the whole prompt."""
    tokenizer = build_byte_tokenizer()
    tokenizer.backend_tokenizer.enable_truncation(max_length=4)
    assert plain_backend(tokenizer) is None
    assert plain_backend(build_byte_tokenizer()) is not None
    assert len(tokenize(tokenizer, completion("a longer prompt than four tokens"))) > 4


def test_a_long_prompt_tokenizes_in_a_thread_to_the_same_ids(strict_tokenizer):
    """Past LONG_PROMPT_CHARS the ids come from the thread's unlocked call: the same as the plain one."""
    text = "graphs replay " * (LONG_PROMPT_CHARS // 10)
    for request in (completion(text), chat(("user", text))):
        assert asyncio.run(tokenized(strict_tokenizer, request, 10**6)) == tokenize(strict_tokenizer, request)


def test_a_prompt_too_long_for_any_tokens_is_refused_before_tokenizing(strict_tokenizer, monkeypatch):
    """More characters than max_model_len of the longest tokens can hold: a 400 naming the field, at
    once; one character fewer than the bound is tokenized (and then measured in tokens)."""
    bound = 64 * longest_token_chars(strict_tokenizer) * 4
    monkeypatch.setattr("app.replica.tokenize", lambda *args: pytest.fail("tokenized a prompt that cannot fit"))
    for request, param in ((completion("x" * (bound + 1)), "prompt"), (chat(("user", "x" * (bound + 1))), "messages")):
        with pytest.raises(InvalidRequest, match="more than max_model_len=64 tokens can hold") as info:
            asyncio.run(tokenized(strict_tokenizer, request, 64))
        assert info.value.param == param
    monkeypatch.undo()
    assert len(asyncio.run(tokenized(strict_tokenizer, completion("x" * bound), 64))) > 64


def test_the_event_loop_runs_while_a_long_prompt_tokenizes(strict_tokenizer):
    """Another stream's work goes on during a long prompt's tokenizing (the Rust tokenizer's single
    call would hold the interpreter lock throughout)."""
    text = "a b c d " * 200_000  # 1.6 MB: hundreds of milliseconds of tokenizing

    async def scenario() -> tuple[int, float]:
        ticks, done = 0, False

        async def other_stream() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(other_stream())
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        await tokenized(strict_tokenizer, completion(text), 10**7)
        seconds, done = time.perf_counter() - t0, True
        await ticker
        return ticks, seconds

    ticks, seconds = scenario_result = asyncio.run(scenario())
    assert seconds > 0.1, scenario_result  # long enough for the loop's ticks to mean something
    assert ticks >= seconds / 0.005 / 4, scenario_result


PARTS_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.mark.parametrize("template", [PARTS_TEMPLATE, CHAT_TEMPLATE], ids=["parts", "string"])
def test_a_template_gets_the_content_in_the_form_it_reads(tmp_path, template):
    """A template that loops over OpenAI's content parts gets them (given the joined string it looped
    over characters and the user's text vanished); a template that reads a string gets the string.
    Either way the ids are transformers' for the conversation as the client sent it."""
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
    ]
    joined = [{"role": m["role"], "content": m["content"][0]["text"]} for m in as_parts]
    ids = tokenize(tokenizer, GenerateRequest("tenant", "chat", SamplingParams(), messages=joined))
    client_form = as_parts if template is PARTS_TEMPLATE else joined
    expected = tokenizer.apply_chat_template(client_form, add_generation_prompt=True, tokenize=False)
    assert "What is 2+2?" in expected and tokenizer.decode(ids) == expected
