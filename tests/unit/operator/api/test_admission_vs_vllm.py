"""The extraArgs rule refuses exactly what vLLM would read as a flag the operator manages.

vLLM's own parser (the cached CPU environment) reads each refused spelling appended to a rendered command
line: every one changes a managed setting (or names a file of settings); every admitted extra flag leaves
them all as rendered.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.vllm_cli import CHECKED_VERSIONS, check_command_lines
from tests.fixtures.api_cases import INVALID, VALID_EDGES
from tests.fixtures.render import command_lines

from tests.fixtures.models import dm

pytestmark = pytest.mark.vllm

MANAGED_FIELDS = ("model", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "block_size",
                  "served_model_name", "port", "kv_connector", "kv_role", "engine_id", "kv_buffer_device",
                  "kv_connector_extra_config",
                  # what vLLM's config post-init leaves of the connector (--kv-offloading-size replaces it there)
                  "kv_connector_after_post_init", "kv_role_after_post_init")


def _extra_args(patch: dict[str, Any]) -> list[str]:
    for section in ("engine", "prefill", "decode"):
        if "extraArgs" in patch.get(section, {}):
            return patch[section]["extraArgs"]
    return []


REFUSED = [(case, _extra_args(patch)) for case, patch, path, _ in INVALID if path.endswith(".extraArgs")]
ADMITTED = [(case, _extra_args(patch)) for case, patch in VALID_EDGES if _extra_args(patch)]


@pytest.mark.parametrize("version", CHECKED_VERSIONS)
def test_refused_and_admitted_extra_args_as_vllm_reads_them(version: str) -> None:
    assert len(REFUSED) >= 6 and ADMITTED
    (base,) = [i for i in command_lines(dm()) if i["id"].endswith("/prefill")]
    lines = [{"id": "base", "argv": base["argv"]}]
    # --config file.yaml fails here because vLLM opens the (absent) file: it would read flags from it.
    lines += [{"id": case, "argv": base["argv"] + args} for case, args in REFUSED + ADMITTED]
    results = {r_id["id"]: r for r_id, r in zip(lines, check_command_lines(lines, version))}
    rendered = results["base"]["parsed"]
    assert results["base"]["ok"], results["base"]["error"]

    for case, args in REFUSED:
        parsed = results[case]["parsed"] or {}
        changed = [f for f in MANAGED_FIELDS if parsed.get(f) != rendered[f]]
        assert changed or not results[case]["ok"], f"{case}: vLLM read {args} without touching a managed setting"
    for case, args in ADMITTED:
        assert results[case]["ok"], f"{case}: {results[case]['error']}"
        parsed = results[case]["parsed"]
        assert {f: parsed[f] for f in MANAGED_FIELDS} == {f: rendered[f] for f in MANAGED_FIELDS}, case
