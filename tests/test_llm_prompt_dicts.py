"""rlserve.LLM.generate takes vLLM's prompt dicts (TextPrompt {"prompt": ...}, TokensPrompt
{"prompt_token_ids": ...}), alone or in a list, and refuses a dict it cannot serve. Before session 18 a
lone dict was iterated as its keys: ``generate({"prompt": "hello"})`` generated from the text "prompt"."""

import pytest

from rlserve import LLM, SamplingParams
from rlserve.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("llama"), dtype="float32", device="cpu")


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_dicts_generate_what_their_text_or_ids_generate(llm):
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [5, 9, 17, 3, 22]
    plain = _ids(llm.generate(["hello there", ids], sp))
    assert _ids(llm.generate({"prompt": "hello there"}, sp)) == plain[:1]
    assert _ids(llm.generate({"prompt_token_ids": ids}, sp)) == plain[1:]
    assert _ids(llm.generate([{"prompt": "hello there"}, {"prompt_token_ids": ids}], sp)) == plain
    # the bug: the dict's key "prompt" as the prompt text
    assert _ids(llm.generate({"prompt": "hello there"}, sp)) != _ids(llm.generate("prompt", sp))


@pytest.mark.parametrize("bad", [{}, {"text": "x"}, {"prompt": "x", "prompt_token_ids": [1]},
                                 {"prompt": "x", "multi_modal_data": {}}])
def test_a_prompt_dict_it_cannot_serve_is_refused_by_index(llm, bad):
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\]"):
        llm.generate(["fine", bad], SamplingParams(max_tokens=2))
