"""engine.text.prompts: one validator for the pipeline and the engine. A prompt `prompt_problem` refuses is refused by
`LLMEngine.prompt_token_ids` with the same sentence (it used to pass a message with an unknown role to the chat
template), and one it accepts runs."""

from __future__ import annotations

import pytest

from engine.text.prompts import prompt_problem


@pytest.mark.parametrize("prompt", [
    [{"role": "wizard", "content": "hi"}],  # a role outside CHAT_ROLES
    [{"role": "user", "content": 3}],  # content that is not text
    [{"role": "user"}],  # no content
    "   ",
    [],
    {"role": "user", "content": "a dict, not a list"},
])
def test_the_engine_refuses_what_the_pipeline_refuses_with_the_same_words(tiny_engine, prompt: object) -> None:
    problem = prompt_problem(prompt)
    assert problem is not None
    with pytest.raises(ValueError) as e:
        tiny_engine.prompt_token_ids(prompt)
    assert str(e.value) == problem


def test_accepted_prompts_run(tiny_engine, gsm8k_questions: list[str]) -> None:
    q = gsm8k_questions[0]
    for prompt in (q, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}], [1, 2, 3]):
        assert prompt_problem(prompt) is None
        assert tiny_engine.prompt_token_ids(prompt)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_engine.prompt_token_ids([1, 10**9])
