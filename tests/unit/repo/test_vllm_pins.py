"""The vLLM releases the command-line tests judge with come from the pin files in hack/: none found is an
error that names them, never a suite whose every parser test is skipped for an empty parameter set."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures import vllm_cli


def test_no_pin_file_is_an_error_not_a_silent_skip(tmp_path: Path) -> None:
    assert vllm_cli.checked_versions() == vllm_cli.CHECKED_VERSIONS and vllm_cli.CHECKED_VERSIONS
    with pytest.raises(RuntimeError, match="no vLLM pin file"):
        vllm_cli.checked_versions(tmp_path)
