"""The router benchmark's shared-prefix prompts give the router's prefix index real work (bench/disagg_bench/router_bench.py,
Peers): every prompt starts with one of a few shared prefixes, which the index then holds, and brings chunks it
has never seen after it, so the index grows with every request."""

from __future__ import annotations

from disagg_connector.router.prefix import PrefixIndex, prompt_key

from disagg_bench.router_bench import SHARED_PREFIXES, Prompts


def test_every_prompt_matches_its_shared_prefix_and_adds_new_chunks() -> None:
    prompts = Prompts("shared-prefix")
    index = PrefixIndex()
    keys = [prompt_key("completions", prompts.next(), 0).chunks for _ in range(4 * SHARED_PREFIXES)]
    for i, chunks in enumerate(keys):
        before = index.size
        matched = index.match(chunks, ["p0"]).get("p0", 0)
        index.insert("p0", chunks)
        if i >= SHARED_PREFIXES:  # its prefix was sent before: the index holds the prefix, not what follows
            assert 0 < matched < len(chunks) - 1, (i, matched, len(chunks))
        assert index.size - before >= len(chunks) - matched - 1 > 0  # new chunks every time
    assert len({c[0] for c in keys}) == SHARED_PREFIXES  # the prompts' first chunks: one per prefix


def test_short_prompts_are_the_headroom_sections_64_words() -> None:
    bodies = [Prompts("short").next() for _ in range(3)]
    assert {b["prompt"] for b in bodies} == {" ".join(["word"] * 64)}
    assert all(b["stream"] and b["max_tokens"] == 32 for b in bodies)
