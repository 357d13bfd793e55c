"""disagg-localrun migrate's judgement, pure (bench/disagg_bench/localrun/migrate.py): each stream of the crash pass
against the uninterrupted reference."""

from __future__ import annotations

from disagg_bench.localrun.migrate import Stream, markdown, summarize

TOKENS = 4


def _stream(index: int, kind: str, ids: list[int], *, xid: str = "", stamps: list[float] | None = None, done: bool = True,
            error: str | None = None) -> Stream:  # fmt: skip
    return Stream(index, kind, xid=xid or f"x{index}", text="".join(f" t{i}" for i in ids), ids=ids,
                  stamps=stamps or [0.1 * n for n in range(len(ids))], done=done, error=error)  # fmt: skip


def test_migrated_streams_are_judged_whole_exact_and_by_their_gap():
    reference = [_stream(0, "completions", [1, 2, 3, 4]), _stream(1, "chat", [5, 6, 7, 8]), _stream(2, "chat", [9, 9, 9, 9])]
    crash = [
        _stream(0, "completions", [1, 2, 3, 4], stamps=[0.0, 0.1, 0.2, 0.9]),  # moved: a 0.7 s gap after the kill at 0.25
        _stream(1, "chat", [5, 6, 0, 0], stamps=[0.0, 0.1, 0.2, 0.3]),  # moved, whole, not exact
        _stream(2, "chat", [9, 9], done=False, error="the answer is incomplete"),  # stayed, cut
    ]
    summary = summarize(reference, crash, {"x0", "x1"}, killed_at=0.25, tokens=TOKENS)
    moved, stayed = summary["migrated"], summary["not migrated"]
    assert (moved["streams"], moved["whole"], moved["exact"]) == (2, 2, 1)
    assert moved["exact_by_kind"] == {"chat": "0/1", "completions": "1/1"}
    assert moved["gap_ms"]["max"] == 700.0 and moved["itl_ms_p50"] == 100.0
    assert (stayed["streams"], stayed["whole"], stayed["exact"], stayed["cut"]) == (1, 0, 0, ["the answer is incomplete"])
    assert summary["reference_whole"] == 3


def test_the_report_names_what_was_killed_and_every_cut_stream():
    reference = [_stream(0, "completions", [1, 2, 3, 4])]
    crash = [_stream(0, "completions", [1], done=False, error="no other pair took its continuation")]
    result = {"engines": "push 1P2D, vllm", "streams": 1, "kinds": ["completions"], "prompt_tokens": 8, "output_tokens": TOKENS,
              "kill_after": 1, "killed": {"engine": "decode-1", "running_then": 1.0}, "router_migrations": {"failed": 1.0},
              "summary": summarize(reference, crash, {"x0"}, killed_at=0.0, tokens=TOKENS)}  # fmt: skip
    text = markdown(result)
    assert "decode-1 killed" in text and '{"failed": 1.0}' in text
    assert "| migrated | 1 | 0 | 0 |" in text and "- no other pair took its continuation" in text
