"""contract/kv_blocks computes what vLLM computes: each checked release's own block hasher
(``get_request_block_hasher`` over a real ``Request``, ``init_none_hash`` with PYTHONHASHSEED) run in that
release's CPU environment gives the same hashes, its own ``BlockPool`` publishes ``BlockStored`` events
carrying ``external_hash`` of them, and the hand-written canonical CBOR is cbor2's byte for byte.

All cases of one release go through one process (importing vLLM is the slow part).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import textwrap
from typing import Any

import cbor2
import pytest

from disagg_connector.contract import kv_blocks
from tests.fixtures.vllm_cli import CHECKED_VERSIONS, vllm_python

RESULT = "kv-blocks-result: "
# Runs in a vLLM environment: JSON cases on stdin, one answer per case on the stdout line after RESULT.
VLLM_HASHER = textwrap.dedent(
    """
    import json, os, sys
    RESULT = "kv-blocks-result: "
    cases = json.load(sys.stdin)
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

    out = []
    for i, case in enumerate(cases):
        if case["seed"] is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = case["seed"]
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if case["int_hashes"] else "0"
        fn = get_hash_fn_by_name(case["algo"])
        kcu.init_none_hash(fn)
        req = Request(
            request_id=f"r{i}",
            prompt_token_ids=case["tokens"],
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=kcu.get_request_block_hasher(case["block_size"], fn),
        )
        # What the engine publishes: its block pool caches the request's full blocks, as the scheduler
        # does after a prefill, and queues BlockStored events.
        n_full = len(req.block_hashes)
        pool = BlockPool(num_gpu_blocks=n_full + 1, enable_caching=True, hash_block_size=case["block_size"],
                         enable_kv_cache_events=True)
        if n_full:
            pool.cache_full_blocks(req, pool.get_new_blocks(n_full), 0, n_full, case["block_size"], 0)
        published = [h for event in pool.take_events() for h in event.block_hashes]
        out.append({
            "none_hash": kcu.NONE_HASH.hex(),
            "hashes": [h.hex() for h in req.block_hashes],
            "published": [h if isinstance(h, int) else {"bytes": h.hex()} for h in published],
        })
    print(RESULT + json.dumps(out))  # vLLM logs to stdout too
    """
)


def _cases() -> list[dict[str, Any]]:
    rng = random.Random(19)
    vocab = 151_936  # Qwen3's: token ids past 2**16 need CBOR's 4-byte head
    long_prompt = [rng.randrange(vocab) for _ in range(16 * 7 + 5)]  # 7 full blocks, a partial 8th
    cases = [
        {"tokens": long_prompt, "block_size": 16, "seed": "0", "algo": "sha256_cbor"},
        {"tokens": long_prompt, "block_size": 16, "seed": "0", "algo": "sha256"},
        {"tokens": long_prompt, "block_size": 32, "seed": "12345", "algo": "sha256_cbor"},
        # Every CBOR head size: ids below 24, one byte, two bytes, four bytes.
        {"tokens": [0, 1, 23, 24, 255, 256, 65535, 65536, vocab - 1, 7, 8, 9], "block_size": 4, "seed": "7",
         "algo": "sha256_cbor"},
        {"tokens": [5] * 15, "block_size": 16, "seed": "0", "algo": "sha256_cbor"},  # no full block: no hash
        {"tokens": list(range(64)), "block_size": 16, "seed": "0", "algo": "sha256_cbor"},  # exact multiple
        {"tokens": long_prompt[:48], "block_size": 16, "seed": "0", "algo": "sha256_cbor", "int_hashes": False},
    ]
    for case in cases:
        case.setdefault("int_hashes", True)
    return cases


CASES = _cases()


@pytest.fixture(scope="module", params=CHECKED_VERSIONS)
def vllm_answers(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    version: str = request.param
    cases = list(CASES)
    if version >= "0.33.0":
        # 0.33.0 seeds NONE_HASH with "vllm-none-hash" when PYTHONHASHSEED is unset (0.26.0: random bytes).
        cases.append({**CASES[0], "seed": None})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    proc = subprocess.run(
        [vllm_python(version), "-c", VLLM_HASHER],
        input=json.dumps(cases), capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    return version, cases, json.loads(line.removeprefix(RESULT))


@pytest.mark.vllm
def test_block_hashes_match_vllm(vllm_answers: tuple[str, list[dict[str, Any]], list[dict[str, Any]]]) -> None:
    version, cases, answers = vllm_answers
    assert len(answers) == len(cases)
    for case, answer in zip(cases, answers):
        seed = kv_blocks.DEFAULT_NONE_HASH_SEED if case["seed"] is None else case["seed"]
        ours = kv_blocks.block_hashes(case["tokens"], case["block_size"], seed, case["algo"])
        where = f"vLLM {version}, {case['algo']}, seed {case['seed']!r}, block {case['block_size']}"
        assert kv_blocks.none_hash(seed, case["algo"]).hex() == answer["none_hash"], where
        assert [h.hex() for h in ours] == answer["hashes"], where
        assert len(ours) == len(case["tokens"]) // case["block_size"], where  # a partial block has no hash
        # What the engine's BlockStored events carry, and the index key that folds both forms together.
        external = [kv_blocks.external_hash(h, case["int_hashes"]) for h in ours]
        theirs = [e if isinstance(e, int) else bytes.fromhex(e["bytes"]) for e in answer["published"]]
        assert external == theirs, where
        assert [kv_blocks.hash_key(e) for e in theirs] == kv_blocks.block_hash_keys(
            case["tokens"], case["block_size"], seed, case["algo"]
        ), where


@pytest.mark.vllm
def test_a_prefix_shares_its_leading_hashes_with_vllm_too(
    vllm_answers: tuple[str, list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    # Case 6 is case 0's first 48 tokens: its three hashes are case 0's first three.
    _, _, answers = vllm_answers
    assert answers[6]["hashes"] == answers[0]["hashes"][:3]
    assert answers[0]["hashes"] != answers[1]["hashes"]  # the algorithm matters
    assert answers[0]["hashes"][:1] != answers[2]["hashes"][:1]  # so do the seed and the block size


@pytest.mark.parametrize(
    "obj",
    [
        None, 0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -24, -25, -(2**64),
        b"", b"x" * 23, b"y" * 24, b"z" * 300, "", "vllm-none-hash", "é" * 40,
        (), (1, 2, 3), (b"\x00" * 32, tuple(range(30)), None), [1, (2, [3, None])],
    ],
)
def test_canonical_cbor_is_cbor2s(obj: object) -> None:
    assert kv_blocks.canonical_cbor(obj) == cbor2.dumps(obj, canonical=True)


def test_both_block_encoders_are_cbor2s() -> None:
    # The hand-written one (no cbor2 installed) and the cbor2 one the router uses give the same bytes.
    assert kv_blocks._cbor_block is kv_blocks._cbor_block_cbor2
    rng = random.Random(3)
    for size in (1, 16, 23, 24, 128):
        tokens = [rng.randrange(200_000) for _ in range(size)]
        parent = rng.randbytes(32)
        expected = cbor2.dumps((parent, tuple(tokens), None), canonical=True)
        assert kv_blocks._cbor_block_stdlib(parent, tokens) == expected
        assert kv_blocks._cbor_block_cbor2(parent, tokens) == expected


def test_without_cbor2_the_hashes_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = random.Random(5).choices(range(150_000), k=16 * 9 + 3)
    with_cbor2 = kv_blocks.block_hashes(tokens, 16, "0")
    monkeypatch.setattr(kv_blocks, "_cbor_block", kv_blocks._cbor_block_stdlib)
    assert kv_blocks.block_hashes(tokens, 16, "0") == with_cbor2
    assert len(with_cbor2) == 9


def test_iterating_stops_early() -> None:
    tokens = list(range(16 * 4))
    it = kv_blocks.iter_block_hashes(tokens, 16, "0")
    assert next(it) == kv_blocks.block_hashes(tokens[:16], 16, "0")[0]
    assert list(it) == kv_blocks.block_hashes(tokens, 16, "0")[1:]


def test_refusals() -> None:
    with pytest.raises(ValueError):
        kv_blocks.block_hashes([1, 2], 0, "0")
    with pytest.raises(ValueError):
        kv_blocks.block_hashes([1, 2], 1, "0", "xxhash")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kv_blocks.canonical_cbor(2**64)  # a bignum: never a token id
    with pytest.raises(TypeError):
        kv_blocks.canonical_cbor(1.5)


def test_hash_key_folds_both_event_forms() -> None:
    [h] = kv_blocks.block_hashes(list(range(16)), 16, "0")
    as_int = kv_blocks.external_hash(h)
    as_bytes = kv_blocks.external_hash(h, int_hashes=False)
    assert isinstance(as_int, int) and as_int < 2**64
    assert as_bytes == h
    assert kv_blocks.hash_key(as_int) == kv_blocks.hash_key(as_bytes) == as_int
