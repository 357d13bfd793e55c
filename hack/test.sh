#!/usr/bin/env bash
# The test suite: unit, integration (real NIXL, router with simulated engines), e2e (local control
# plane built from Go modules, or KUBECONFIG with DISAGG_E2E_USE_KUBECONFIG=1). Extra arguments go to
# pytest, e.g. `hack/test.sh tests/unit -k render`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash hack/setup.sh
# Two workers (DISAGG_TEST_WORKERS; 0 runs in this process): one runs every e2e test, the unit and integration
# tests are spread over both (tests/conftest.py, pytest_xdist_make_scheduler).
exec .venv/bin/python -m pytest -n "${DISAGG_TEST_WORKERS:-2}" "${@:-tests}"
