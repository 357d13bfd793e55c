"""The operator and router images built from images/*/Dockerfile by BuildKit (hack/images.sh, on a local Debian
base: no registry here) and run with runc as the chart runs them: do they hold what images/README.md says?

The static reading of the same Dockerfiles is tests/unit/repo/test_images.py; these build them.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from disagg_operator import config
from tests.fixtures.images import BuiltImage, unpack_images

REPO = Path(__file__).resolve().parents[3]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CHART = REPO / "charts" / "disagg-operator"
# What the chart would run: image.repository + appVersion, and the model default routerImage.
CHART_REFERENCES = {
    "operator": f"{yaml.safe_load((CHART / 'values.yaml').read_text())['image']['repository']}:"
    f"{yaml.safe_load((CHART / 'Chart.yaml').read_text())['appVersion']}",
    "router": config.ROUTER_IMAGE,
}
NON_ROOT = "65532:65532"


@pytest.fixture(scope="module")
def images(image_tars: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, BuiltImage]:
    published = {name: image_tars[name] for name in ("operator", "router")}
    return unpack_images(published, tmp_path_factory.mktemp("bundles"))


@pytest.mark.parametrize("name", ["operator", "router"])
def test_the_image_is_the_reference_the_chart_runs_with_its_version_labelled(
    images: dict[str, BuiltImage], name: str
) -> None:
    image = images[name]
    assert image.reference == CHART_REFERENCES[name] == f"ghcr.io/disagg-dev/disagg-{name}:{VERSION}"
    assert image.config.labels["org.opencontainers.image.version"] == VERSION
    assert image.config.labels["org.opencontainers.image.title"] == f"disagg-{name}"


@pytest.mark.parametrize("name", ["operator", "router"])
def test_the_image_runs_as_a_numeric_non_root_user_on_a_read_only_root(
    images: dict[str, BuiltImage], name: str
) -> None:
    image = images[name]
    assert image.config.user == NON_ROOT  # numeric: the kubelet checks runAsNonRoot without /etc/passwd
    probe = "import os, tempfile; tempfile.NamedTemporaryFile(dir='/tmp').close(); print(os.getuid(), os.getgid())"
    ran = image.run("-c", probe, entrypoint=("python",))
    assert (ran.returncode, ran.stdout.split()) == (0, ["65532", "65532"]), ran.stderr
    # Nothing but /tmp is writable (the chart mounts an emptyDir there), and the image needs nothing else.
    ran = image.run("-c", "open('/opt/disagg/x', 'w')", entrypoint=("python",))
    assert ran.returncode != 0 and "Read-only file system" in ran.stderr, ran.stderr


@pytest.mark.parametrize("name", ["operator", "router"])
def test_the_image_holds_no_compiler_sources_or_pip_cache(images: dict[str, BuiltImage], name: str) -> None:
    rootfs = images[name].rootfs
    present = [
        path
        for path in ("usr/bin/gcc", "usr/bin/cc", "usr/bin/make", "usr/bin/x86_64-linux-gnu-gcc", "src", "root/.cache/pip")
        if (rootfs / path).exists() or (rootfs / path).is_symlink()
    ]
    assert present == []
    assert images[name].config.env["PATH"].startswith("/opt/disagg/bin:")


def test_the_operator_starts_as_the_chart_starts_it_and_prints_the_chart_crd(images: dict[str, BuiltImage]) -> None:
    operator = images["operator"]
    assert (operator.config.entrypoint, operator.config.exposed_ports) == (("disagg-operator",), {"8080/tcp"})
    assert operator.config.cmd[:2] == ("run", "--standalone")
    ran = operator.run("crd")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == (CHART / "crds" / "disagg.dev_disaggregatedmodels.yaml").read_text()


def test_the_operator_image_renders_a_model_exactly_as_the_source_tree_does(images: dict[str, BuiltImage]) -> None:
    """The templates and the package data made it into the non-editable install."""
    example = (REPO / "examples" / "minimal.yaml").read_text()
    ran = images["operator"].run("render", "-f", "-", stdin=example)
    assert ran.returncode == 0, ran.stderr
    here = subprocess.run(
        [str(Path(sys.executable).parent / "disagg-operator"), "render", "-f", "-"],
        input=example, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert list(yaml.safe_load_all(ran.stdout)) == list(yaml.safe_load_all(here.stdout))


def test_the_router_image_holds_the_data_plane_and_not_the_operator(images: dict[str, BuiltImage]) -> None:
    router = images["router"]
    assert (router.config.entrypoint, router.config.exposed_ports) == (("disagg-router",), {"8000/tcp"})
    ran = router.run("--help")
    assert ran.returncode == 0 and "usage: disagg-router" in ran.stdout, ran.stderr
    probe = (
        "import importlib.util as u\n"
        "for m in ('disagg_connector.router', 'aiohttp', 'uvloop', 'prometheus_client', 'kopf', 'disagg_operator',"
        " 'jinja2', 'celpy'):\n"
        "    print(m, u.find_spec(m) is not None)\n"
    )
    ran = router.run("-c", probe, entrypoint=("python",))
    assert ran.returncode == 0, ran.stderr
    found = dict(line.split() for line in ran.stdout.splitlines())
    assert found == {
        "disagg_connector.router": "True", "aiohttp": "True", "uvloop": "True", "prometheus_client": "True",
        "kopf": "False", "disagg_operator": "False", "jinja2": "False", "celpy": "False",
    }  # fmt: skip
