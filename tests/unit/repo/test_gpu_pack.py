"""The GPU harness's pack carries what the harness and the router import (hack/gpu/README.md).

The lent machine has no network: every third-party module that `disagg-localrun` and the router import,
directly or through the operator's rendering, must come from the machine's own packages
(hack/gpu/machine-packages.txt), the vLLM wheels of the pack (hack/gpu/wheels.txt) or the pins pack.sh adds.
Checked here without a GPU, from the import graph, so that a new import cannot break the next GPU session.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import re
import sys

import grimp

import pytest

from tests.fixtures.models import REPO

GPU = REPO / "hack" / "gpu"
# What the machine runs of ours: the harness (which renders with the operator and starts the router).
ENTRY_PACKAGES = ("disagg_bench.localrun", "disagg_connector.router")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried() -> set[str]:
    """Distribution names the GPU machine will have: its own, the pack's wheels, pack.sh's pins."""
    machine = {line.split("==")[0] for line in (GPU / "machine-packages.txt").read_text().splitlines()
               if line and not line.startswith("#")}  # fmt: skip
    wheels = {line.split("-")[0] for line in (GPU / "wheels.txt").read_text().splitlines() if line.endswith("MB")
              and not line.startswith("TOTAL")}  # fmt: skip
    pins = re.search(r"<<'PINS'\n(.*?)\nPINS", (GPU / "pack.sh").read_text(), re.S)
    assert pins, "pack.sh no longer lists its pins in a <<'PINS' block: update this test with it"
    pinned = {line.split("==")[0] for line in pins.group(1).splitlines() if line.strip()}
    return {_normal(n) for n in machine | wheels | pinned}


def imported_distributions() -> dict[str, set[str]]:
    """Third-party distribution -> the modules of ours (reachable from the entry packages) that import it."""
    graph = grimp.build_graph("disagg_operator", "disagg_connector", "disagg_bench", include_external_packages=True)
    ours = ("disagg_operator", "disagg_connector", "disagg_bench")
    entries = {m for entry in ENTRY_PACKAGES for m in graph.modules if m == entry or m.startswith(entry + ".")}
    reachable = entries | {m for e in entries for m in graph.find_upstream_modules(e) if m.startswith(ours)}
    found: dict[str, set[str]] = {}
    owners = importlib.metadata.packages_distributions()
    for module in sorted(reachable):
        for imported in graph.find_modules_directly_imported_by(module):
            top = imported.split(".")[0]
            if top in ours or top in sys.stdlib_module_names:
                continue
            for dist in owners.get(top, [top]):
                found.setdefault(_normal(dist), set()).add(module)
    return found


def test_the_pack_carries_every_import_of_the_harness_and_the_router() -> None:
    have = carried()
    imports = imported_distributions()
    assert {"aiohttp", "orjson", "pydantic", "cel-python", "kubernetes"} <= set(imports), sorted(imports)  # it reads
    missing = {dist: sorted(users)[:3] for dist, users in imports.items() if dist not in have}
    assert not missing, f"not on the GPU machine, in wheels.txt or in pack.sh's pins (add a pin to pack.sh): {missing}"


def peers() -> dict[str, set[str]]:
    """The peer routers' wheels (hack/gpu/peers.txt) -> their Requires-Dist, as peers.txt records them."""
    out = {}
    for line in (GPU / "peers.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            wheel, _, requires = line.partition(" requires: ")
            out[wheel.split()[0]] = {_normal(r) for r in requires.split()}
    return out


def test_the_pack_carries_what_the_peer_routers_need() -> None:
    rows = peers()
    assert any(w.startswith("vllm_router-0.1.17-") for w in rows), rows  # the pinned peer of issue 20
    have = carried()
    missing = {wheel: sorted(requires - have) for wheel, requires in rows.items() if requires - have}
    assert not missing, f"a peer's dependency is not on the GPU machine, in wheels.txt or in pack.sh's pins: {missing}"
    assert "peers.txt" in (GPU / "pack.sh").read_text(), "pack.sh no longer downloads the peers of peers.txt into a3"


@pytest.mark.parametrize("wheel", sorted(peers()))
def test_peers_txt_lists_each_wheels_own_requirements(wheel: str) -> None:
    """Against the distribution's own metadata: the test extra pins the same release into the test environment
    (hack/setup.sh installs it), so this needs no download."""
    name, version = wheel.split("-")[:2]
    assert importlib.metadata.version(name) == version, f"the test extra pins another {name} than peers.txt lists"
    requires = importlib.metadata.requires(name) or []
    wanted = {_normal(re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0]) for r in requires if "extra ==" not in r}
    assert peers()[wheel] == wanted
