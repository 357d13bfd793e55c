"""The P/D wire protocol, pure (contract/vllm_pd.py): the legs' bodies and headers, P's answer read and
checked, the shapes of a failed stream."""

from __future__ import annotations

import re

import pytest

from disagg_connector.contract.vllm_pd import (
    DP_RANK_HEADER,
    PrefillAnswerError,
    decode_body,
    error_body,
    leg_headers,
    prefill_transfer_params,
    pull_decode_params,
    returned_request_id,
    stream_failed_early,
)
from tests.fixtures.router import vllm_failed_stream


def test_leg_headers_carry_the_dispatch_id_credentials_and_the_pinned_rank_only_when_asked():
    assert leg_headers("x1", None, None) == {"Content-Type": "application/json", "X-Request-Id": "x1", "Accept-Encoding": "identity"}
    pinned = leg_headers("x1", "Bearer t", 3)
    assert (pinned["Authorization"], pinned[DP_RANK_HEADER]) == ("Bearer t", "3")
    assert DP_RANK_HEADER not in leg_headers("x1", "Bearer t", None)


def test_decode_body_never_passes_the_clients_kv_transfer_params():
    client = {"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil"}}
    assert decode_body(client, None) == {"prompt": "hi"}  # a local decode prefills itself
    assert decode_body(client, {"transfer_id": "t"}) == {"prompt": "hi", "kv_transfer_params": {"transfer_id": "t"}}
    assert client["kv_transfer_params"]["remote_host"] == "evil"  # the client's body is left as it was


def test_pull_decode_params_are_ps_answer_with_the_transfer_id_unless_p_echoed_one():
    assert pull_decode_params("xfer-1", {"remote_engine_id": "p"}) == {"transfer_id": "xfer-1", "remote_engine_id": "p"}
    assert pull_decode_params("xfer-1", {"transfer_id": "echoed"})["transfer_id"] == "echoed"
    assert returned_request_id({"remote_request_id": "cmpl-x-0-ab12cd34"}) == "cmpl-x-0-ab12cd34"
    assert returned_request_id({"remote_request_id": 7}) is None


@pytest.mark.parametrize(
    "answer, mode, error, mismatch",
    [
        ({"kv_transfer_params": {"remote_engine_id": "p"}}, "Pull", None, False),  # 0.26.0 announces no mode
        ({"kv_transfer_params": {"transfer_mode": "push"}}, "Push", None, False),  # 0.33.0 does, in lower case
        ({"kv_transfer_params": {"transfer_mode": "pull"}}, "Push", "transfer_mode 'pull'", True),
        ({"choices": []}, "Pull", "no kv_transfer_params", True),  # not a NIXL kv_producer
        ([1, 2], "Pull", "invalid JSON (not an object)", False),
    ],
)
def test_prefill_answer_is_checked_against_the_revisions_mode(answer, mode, error, mismatch):
    if error is None:
        assert prefill_transfer_params(answer, mode) == answer["kv_transfer_params"]
        return
    with pytest.raises(PrefillAnswerError, match=re.escape(error)) as e:
        prefill_transfer_params(answer, mode)
    assert e.value.mismatch is mismatch


def test_a_stream_that_fails_before_its_first_token_says_why():
    assert stream_failed_early(b'data: {"id": "cmpl-1", "choices": []}\n\n') is None
    assert stream_failed_early(b"") == "an empty stream"
    assert stream_failed_early(vllm_failed_stream(500, "engine died")) == "engine died"
    assert stream_failed_early(b'data: {"error": nope}\n\n') == "error event"


def test_error_body_is_vllms_openai_error():
    assert error_body(504, "late")["error"] == {"message": "late", "type": "GatewayTimeoutError", "param": None, "code": 504}
    assert error_body(400, "bad", param="n")["error"] == {"message": "bad", "type": "BadRequestError", "param": "n", "code": 400}
