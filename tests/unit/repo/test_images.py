"""The Dockerfiles under images/, read by the official BuildKit parser (PyPI `dockerfile`).

Static checks of every Dockerfile, the vLLM runtimes' too (tests/integration/containers builds and runs the operator's
and the router's): pinned bases, sources that exist, entry points that exist,
the package installed, who the image runs as, labels, no secrets, and build commands that match the chart.
"""

from __future__ import annotations

import glob
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile
import pytest
import yaml

from disagg_operator import config
from disagg_operator.api.models import DEFAULT_VLLM_VERSION, IMAGED_NVIDIA_RELEASES

REPO = Path(__file__).resolve().parents[3]
IMAGES = REPO / "images"
# The distributions: the operator (pyproject.toml), the data plane (connector/pyproject.toml) and the
# benchmarks (bench/pyproject.toml), whose kvbench the engine images carry.
DISTRIBUTIONS = {"operator": ".", "connector": "connector", "bench": "bench"}
SCRIPTS = {
    script: dist
    for dist, root in DISTRIBUTIONS.items()
    for script in tomllib.loads((REPO / root / "pyproject.toml").read_text())["project"]["scripts"]
}
README = (IMAGES / "README.md").read_text()
CHART_VALUES = yaml.safe_load((REPO / "charts" / "disagg-operator" / "values.yaml").read_text())

# image dir -> the distributions it installs (the router and the engines carry no operator code)
INSTALLS = {"operator": ("connector", "operator"), "router": ("connector",), "vllm-runtime": ("connector", "bench"),
            "vllm-runtime-neuron": ("connector", "bench")}  # fmt: skip
# image dir -> (non-root?, the entry points it must carry, the reference the chart/operator use by default)
EXPECTED = {
    "operator": (True, {"disagg-operator"}, f"{CHART_VALUES['image']['repository']}:$VERSION"),
    "router": (True, {"disagg-router"}, config.ROUTER_IMAGE.replace(":0.1.0", ":$VERSION")),
    "vllm-runtime": (False, {"disagg-preflight", "disagg-drain", "kvbench"}, config.ENGINE_IMAGE),
    "vllm-runtime-neuron": (False, {"disagg-preflight", "disagg-drain", "kvbench"}, config.NEURON_ENGINE_IMAGE),
}
OCI_LABELS = {"title", "description", "source", "version", "licenses"}
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIAL)", re.I)


@dataclass
class Stage:
    base: str
    name: str | None
    commands: list[dockerfile.Command] = field(default_factory=list)


def parse(image: str) -> tuple[list[dockerfile.Command], list[Stage], dict[str, str]]:
    """Commands, stages and the global ARG defaults (declared before the first FROM)."""
    commands = list(dockerfile.parse_file(str(IMAGES / image / "Dockerfile")))
    stages: list[Stage] = []
    global_args: dict[str, str] = {}
    for cmd in commands:
        if cmd.cmd == "FROM":
            value = list(cmd.value)
            name = value[2] if len(value) == 3 and value[1].upper() == "AS" else None
            stages.append(Stage(base=value[0], name=name))
        elif stages:
            stages[-1].commands.append(cmd)
        elif cmd.cmd == "ARG":
            key, _, default = cmd.value[0].partition("=")
            global_args[key] = default
    return commands, stages, global_args


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def final(stages: list[Stage]) -> Stage:
    return stages[-1]


@pytest.fixture(params=sorted(EXPECTED))
def image(request: pytest.FixtureRequest) -> str:
    return request.param


def test_every_image_dir_is_covered() -> None:
    assert sorted(p.parent.name for p in IMAGES.glob("*/Dockerfile")) == sorted(EXPECTED)


def test_every_from_is_pinned(image: str) -> None:
    _, stages, args = parse(image)
    seen: set[str] = set()
    for stage in stages:
        base = expand(stage.base, args)
        if base in seen:  # an earlier stage of this file
            continue
        assert "$" not in base, f"{image}: FROM {stage.base} has no default for its ARG"
        ref, _, digest = base.partition("@")
        last = ref.rsplit("/", 1)[-1]
        tag = last.split(":", 1)[1] if ":" in last else ""
        assert tag or digest, f"{image}: FROM {base} is not pinned (no tag, no digest)"
        assert tag != "latest", f"{image}: FROM {base} uses latest"
        if digest:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), base
        if stage.name:
            seen.add(stage.name)


def test_every_copy_source_exists(image: str) -> None:
    commands, stages, _ = parse(image)
    stage_names = {s.name for s in stages if s.name}
    for cmd in commands:
        if cmd.cmd == "ADD":
            pytest.fail(f"{image}: use COPY (and RUN curl with a check) instead of ADD: {cmd.original}")
        if cmd.cmd != "COPY":
            continue
        from_flag = [f for f in cmd.flags if f.startswith("--from=")]
        if from_flag:
            assert from_flag[0].split("=", 1)[1] in stage_names, f"{image}: {cmd.original}"
            continue
        *sources, _dest = cmd.value
        for src in sources:
            assert glob.glob(str(REPO / src)), f"{image}: COPY source {src} does not exist in the repository"
            assert not src.startswith(("/", "..")), src
        ignore = (IMAGES / image / "Dockerfile.dockerignore").read_text().splitlines()
        for src in sources:
            assert f"!{src}" in ignore, f"{image}: {src} is copied but excluded by Dockerfile.dockerignore"


def test_entry_points_exist(image: str) -> None:
    commands, stages, _ = parse(image)
    _, wanted, _ = EXPECTED[image]
    text = "\n".join(" ".join(c.value) for c in commands if c.cmd in {"RUN", "ENTRYPOINT", "CMD"})
    for script in wanted:
        assert script in SCRIPTS, f"{script} is not in pyproject's [project.scripts]"
        assert SCRIPTS[script] in INSTALLS[image], f"{image}: {script} belongs to the {SCRIPTS[script]} distribution"
        assert re.search(rf"(^|[\s\"/]){re.escape(script)}\b", text), f"{image}: {script} is never run or set"
    for cmd in final(stages).commands:
        if cmd.cmd == "ENTRYPOINT":
            program = cmd.value[0] if cmd.json else shlex.split(cmd.value[0])[0]
            assert program in SCRIPTS, f"{image}: ENTRYPOINT {program} is not one of our entry points"
    # Any of our script names mentioned anywhere must be real.
    for word in set(re.findall(r"\b(disagg-[a-z-]+|kvbench)\b", text)):
        assert word in SCRIPTS, f"{image}: {word} is not in [project.scripts]"


def test_package_is_installed_from_the_copied_sources(image: str) -> None:
    _, stages, _ = parse(image)
    for stage in stages:
        copies = [c for c in stage.commands if c.cmd == "COPY" and not any(f.startswith("--from=") for f in c.flags)]
        if not copies:
            continue
        dests = {}
        workdir = "/"
        for cmd in stage.commands:
            if cmd.cmd == "WORKDIR":
                workdir = cmd.value[0]
            if cmd in copies:
                *sources, dest = cmd.value
                for src in sources:
                    dests[src.rstrip("/")] = str(Path(workdir, dest)) if not dest.startswith("/") else dest
        wanted = INSTALLS[image]
        sources = {"connector"} | ({"pyproject.toml", "operator"} if "operator" in wanted else set()) | ({"bench"} & set(wanted))
        assert set(dests) == sources | ({"README.md"} if "operator" in wanted else set()), f"{image}: copies {sorted(dests)}"
        installs = [c.value[0] for c in stage.commands if c.cmd == "RUN" and "pip install" in c.value[0]]
        for dist in wanted:
            root = (dests[dist] if dist in ("connector", "bench") else dests["pyproject.toml"]).rstrip("/")
            root = str(Path(root).parent) if root.endswith("pyproject.toml") else root
            assert any(re.search(rf"pip install [^&]*\"?{re.escape(root)}/?(\[\w+\])?\"?(\s|$)", run) for run in installs), (
                f"{image}: no `pip install {root}` of the copied {dist} distribution"
            )
        return
    pytest.fail(f"{image}: the package is never copied in")


def test_registry_installs_are_pinned(image: str) -> None:
    commands, _, _ = parse(image)
    for cmd in commands:
        if cmd.cmd != "RUN":
            continue
        lexer = shlex.shlex(cmd.value[0], posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        parts: list[list[str]] = [[]]
        for token in lexer:
            if token in {"&&", ";", "||", "|", "(", ")"}:
                parts.append([])
            else:
                parts[-1].append(token)
        for words in parts:
            if not any(Path(w).name in {"pip", "pip3"} for w in words) or "install" not in words:
                continue
            specs = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
            for spec in specs:
                if spec.startswith(("/", ".")):  # local sources and built wheels
                    continue
                assert "==" in spec, f"{image}: `pip install {spec}` is not pinned"


def test_user(image: str) -> None:
    _, stages, _ = parse(image)
    non_root, _, _ = EXPECTED[image]
    users = [c.value[0] for c in final(stages).commands if c.cmd == "USER"]
    if non_root:
        assert users, f"{image}: no USER (runs as root)"
        uid, _, gid = users[-1].partition(":")
        assert uid.isdigit() and int(uid) != 0, f"{image}: USER {users[-1]} must be a numeric non-root uid (runAsNonRoot)"
        assert not gid or (gid.isdigit() and int(gid) != 0)
    else:
        # vLLM with EFA needs CAP_IPC_LOCK, which Kubernetes grants only to root: documented, on purpose.
        assert users and users[-1] in {"root", "0"}, f"{image}: the vLLM image must say USER root explicitly"
        assert "IPC_LOCK" in (IMAGES / image / "Dockerfile").read_text() and "Why the vLLM images run as root" in README


def test_labels_and_no_secrets(image: str) -> None:
    commands, stages, _ = parse(image)
    labels: dict[str, str] = {}
    for cmd in final(stages).commands:
        if cmd.cmd == "LABEL":
            values = list(cmd.value)
            labels.update({values[i]: values[i + 1].strip('"') for i in range(0, len(values), 2)})
    assert {f"org.opencontainers.image.{k}" for k in OCI_LABELS} <= set(labels), f"{image}: {sorted(labels)}"
    for cmd in commands:
        if cmd.cmd in {"ENV", "ARG"}:
            names = cmd.value[::2] if cmd.cmd == "ENV" else [v.split("=", 1)[0] for v in cmd.value]
            for name in names:
                assert not SECRET_NAME.search(name), f"{image}: {cmd.cmd} {name} looks like a secret"
        if cmd.cmd == "RUN":
            assert not re.search(r"(hf_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16})", cmd.value[0]), f"{image}: credential in RUN"


@pytest.mark.parametrize("image", ["vllm-runtime", "vllm-runtime-neuron"])
def test_runtime_image_has_efa_and_nixl_libfabric(image: str) -> None:
    text = (IMAGES / image / "Dockerfile").read_text()
    assert "efa_installer.sh" in text and "--skip-kmod" in text
    assert "FI_PROVIDER=efa" in text and "/opt/amazon/efa/lib" in text
    assert 'NIXL_VERSION=1.5.1' in text
    if image == "vllm-runtime":
        # One Dockerfile for every NVIDIA release the operator has an image of; by default its default release.
        _, stages, args = parse(image)
        assert args["VLLM_VERSION"] == DEFAULT_VLLM_VERSION["nvidia"]
        for release in IMAGED_NVIDIA_RELEASES:
            assert expand(final(stages).base, {**args, "VLLM_VERSION": release}) == f"vllm/vllm-openai:v{release}"
        # --no-deps, like hack/setup.sh: NIXL's wheels would pull a second torch.
        assert re.search(r'pip install --no-deps "nixl==\$\{NIXL_VERSION\}" "nixl-\$\{NIXL_CUDA\}==\$\{NIXL_VERSION\}"', text)
        setup = (REPO / "hack" / "setup.sh").read_text()
        assert re.search(r"--no-deps nixl==1\.5\.1 nixl-cu12==1\.5\.1", setup), "hack/setup.sh and the image disagree on NIXL"


def test_readme_builds_every_image_under_the_chart_reference(image: str) -> None:
    _, _, reference = EXPECTED[image]
    line = next((l for l in README.splitlines() if l.startswith("docker build") and f"images/{image}/Dockerfile " in l), None)
    assert line, f"images/README.md has no `docker build -f images/{image}/Dockerfile` line"
    assert f"-t {reference} ." in line, f"{image}: README builds {line!r}, the chart/operator default is {reference}"
