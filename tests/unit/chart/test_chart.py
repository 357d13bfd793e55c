"""The Helm chart, judged by the real helm (built by hack/cluster.sh) and the Kubernetes schemas.

`helm lint --strict` and `helm template` across value sets; every rendered object valid for Kubernetes 1.34;
bad values refused by values.schema.json with a message that names the value; the chart's CRD and RBAC rules
are the generated ones (one source each).
"""

from __future__ import annotations

import shlex
import stat
import json
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from disagg_operator import config
from disagg_operator.api.models import IMAGED_NVIDIA_RELEASES
from disagg_operator.cli import build_parser
from disagg_operator.rbac import rules
from hack.gen import chart_sync
from tests.fixtures.helm import CHART, REPO, helm, values_args

KUBE_VERSION = "1.34"
NAMESPACE = "disagg-system"
RELEASE = "dop"
FULLNAME = f"{RELEASE}-disagg-operator"
# Kinds that are not in Kubernetes' own schemas: checked against the chart's CRDs / by hand below.
CUSTOM_KINDS = {("kopf.dev/v1", "KopfPeering"), ("kopf.dev/v1", "ClusterKopfPeering"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
                ("monitoring.coreos.com/v1", "PrometheusRule"), ("monitoring.coreos.com/v1", "PodMonitor")}  # fmt: skip

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "ha-cluster": {"replicaCount": 3},
    "ha-namespaced": {"replicaCount": 2, "watchNamespaces": ["team-a"], "peering": {"name": "llm-ops"}},
    "customised": {
        "image": {"repository": "registry.example.com/ml/disagg-operator", "digest": "sha256:" + "ab" * 32, "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "modelDefaults": {
            "engineImage": "registry.example.com/ml/vllm-runtime:0.33.0-efa-1",
            "engineImages": {"0.34.0": "registry.example.com/ml/vllm-runtime:0.34.0-efa-1"},
            "neuronEngineImage": "registry.example.com/ml/vllm-runtime:0.33.0-neuron-1",
            "routerImage": "registry.example.com/ml/disagg-router@sha256:" + "cd" * 32,
        },
        "healthPort": 9090,
        "hostNetwork": True,
        "verbose": True,
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": 2, "memory": "2Gi"}},
        "nodeSelector": {"node-role.kubernetes.io/control": "true"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"example.com/team": "ml"},
        "podLabels": {"example.com/cost-center": "42"},
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
        "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/none"}},
        "metrics": {"service": {"port": 9090}, "serviceMonitor": {"enabled": True, "interval": "1m", "labels": {"release": "prom"}},
                    "routerPodMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}},
        "alerts": {"enabled": True, "labels": {"release": "prom"}, "rolloutStuck": {"for": "4h"}},
        "dashboards": {"enabled": True, "labels": {"release": "prom"}, "annotations": {"example.com/owner": "ml"}},
    },
    "bring-your-own-rbac": {
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "ops-operator"},
        "metrics": {"service": {"enabled": False}},
    },
}  # fmt: skip


def render(values: dict[str, Any], tmp_path: Path, *extra: str) -> list[dict[str, Any]]:
    result = helm(
        "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", f"{KUBE_VERSION}.0",
        *values_args(values, tmp_path), *extra,
    )  # fmt: skip
    return result.docs()


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = by_kind(docs, "Deployment")
    return dep


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = deployment(docs)["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(params=list(VALUE_SETS), ids=list(VALUE_SETS))
def value_set(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, VALUE_SETS[request.param]


# --- lint and schema validity ---------------------------------------------------------------------------


def test_lint_strict(value_set, tmp_path: Path) -> None:
    _, values = value_set
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values_args(values, tmp_path))
    assert "0 chart(s) failed" in result.stdout


def test_every_rendered_object_is_valid_kubernetes(value_set, tmp_path: Path) -> None:
    name, values = value_set
    docs = render(values, tmp_path, "--include-crds")
    assert docs, name
    crd_kinds = {(f"{c['spec']['group']}/{v['name']}", c["spec"]["names"]["kind"])
                 for c in by_kind(docs, "CustomResourceDefinition") for v in c["spec"]["versions"]}  # fmt: skip
    for obj in docs:
        key = (obj["apiVersion"], obj["kind"])
        where = f"{name}: {obj['kind']}/{obj['metadata'].get('name')}"
        if key in CUSTOM_KINDS:
            if obj["apiVersion"].startswith("kopf.dev/"):
                assert key in crd_kinds, f"{where}: the chart's crds/ do not define it"
                assert set(obj) == {"apiVersion", "kind", "metadata"}, where
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        if obj["kind"] not in {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}:
            assert obj["metadata"].get("namespace"), f"{where}: namespaced object without a namespace"


def test_labels_and_names(value_set, tmp_path: Path) -> None:
    name, values = value_set
    for obj in render(values, tmp_path):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE, name
        assert labels["app.kubernetes.io/managed-by"] == "Helm", name
        # The operator reacts to Deployments/Pods labelled managed-by=disagg-operator: never its own.
        assert labels["app.kubernetes.io/managed-by"] != "disagg-operator"
        assert obj["metadata"]["name"].startswith(FULLNAME) or obj["metadata"]["name"] == "llm-ops"


# --- one source: CRD and RBAC ---------------------------------------------------------------------------


def test_generated_files_are_fresh() -> None:
    assert chart_sync.stale() == [], "run `python -m hack.gen.chart_sync` (charts/ is stale)"


def test_chart_crd_is_identical_to_crds_dir(tmp_path: Path) -> None:
    assert chart_sync.CHART_CRD.read_bytes() == chart_sync.SOURCE_CRD.read_bytes()
    # ... and helm ships it unchanged.
    shipped = [d for d in render({}, tmp_path, "--include-crds") if d["kind"] == "CustomResourceDefinition"]
    for source in yaml.safe_load_all(chart_sync.SOURCE_CRD.read_text()):
        assert source in shipped
    assert sorted(d["metadata"]["name"] for d in shipped) == sorted(
        ["disaggregatedmodels.disagg.dev", "disaggregatedroles.disagg.dev", "clusterkopfpeerings.kopf.dev",
         "kopfpeerings.kopf.dev"]
    )


def test_cluster_role_is_rbac_rules(tmp_path: Path) -> None:
    docs = render({}, tmp_path)
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == rules()
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": FULLNAME}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")


def test_namespaced_roles_are_rbac_rules_less_cluster_scope(tmp_path: Path) -> None:
    docs = render(VALUE_SETS["namespaced"], tmp_path)
    # Cluster-scoped reads only (none today): a ClusterRole exists exactly when there are some.
    reads = chart_sync.cluster_read_rules(rules())
    assert [r["rules"] for r in by_kind(docs, "ClusterRole")] == ([reads] if reads else [])
    assert len(by_kind(docs, "ClusterRoleBinding")) == (1 if reads else 0)
    assert not [r for rule in reads for r in rule["resources"] if r not in chart_sync.CLUSTER_SCOPED]
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in reads)
    expected = chart_sync.namespaced_rules(rules())
    roles, bindings = by_kind(docs, "Role"), by_kind(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for role in roles:
        assert role["rules"] == expected
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    # Only cluster-scoped resources were dropped, nothing else.
    dropped = {r for rule in rules() for r in rule["resources"]} - {r for rule in expected for r in rule["resources"]}
    assert dropped == {r for rule in rules() for r in rule["resources"] if r in chart_sync.CLUSTER_SCOPED}
    assert "clusterkopfpeerings" in dropped and "kopfpeerings" not in dropped
    # The operator is told to watch exactly these namespaces.
    args = operator_container(docs)["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--namespace"] == ["team-a", "team-b"]


def test_rbac_create_false_renders_no_rbac(tmp_path: Path) -> None:
    docs = render(VALUE_SETS["bring-your-own-rbac"], tmp_path)
    kinds = {d["kind"] for d in docs}
    assert kinds == {"Deployment"}, kinds
    assert deployment(docs)["spec"]["template"]["spec"]["serviceAccountName"] == "ops-operator"


# --- the operator Deployment -----------------------------------------------------------------------------


def test_deployment_is_locked_down(value_set, tmp_path: Path) -> None:
    name, values = value_set
    docs = render(values, tmp_path)
    pod = deployment(docs)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = operator_container(docs)
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in sc
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, (name, probe)
    port = values.get("healthPort", 8080)
    assert container["ports"] == [{"name": "health", "containerPort": port, "protocol": "TCP"},
                                  {"name": "metrics", "containerPort": values.get("metricsPort", 8081), "protocol": "TCP"}]
    assert f"http://0.0.0.0:{port}/healthz" in container["args"]
    assert container["args"][container["args"].index("--metrics-port") + 1] == str(values.get("metricsPort", 8081))
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    # the pod network unless asked; on the node's, DNS still resolves cluster names
    on_host = values.get("hostNetwork", False)
    assert pod.get("hostNetwork", False) is on_host
    assert pod.get("dnsPolicy") == ("ClusterFirstWithHostNet" if on_host else None)


def test_the_operator_is_known_to_its_peers_by_its_pod_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """kopf reads its peer identity from POD_ID; without it, from the user name, which the image's uid lacks."""
    from kopf._core.engines.peering import detect_own_id

    env = operator_container(render({}, tmp_path))["env"]
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in env
    monkeypatch.setenv("POD_ID", "disagg-operator-7d9f-x2x4k")
    assert detect_own_id(manual=False) == "disagg-operator-7d9f-x2x4k"


def test_model_defaults_come_from_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def env(docs: list[dict[str, Any]]) -> dict[str, str]:
        return {e["name"]: e["value"] for e in operator_container(docs)["env"] if "value" in e}

    # The chart's defaults are the operator's built-in ones (config.py), so both read the same.
    assert env(render({}, tmp_path)) == {
        "DISAGG_ENGINE_IMAGE": config.ENGINE_IMAGE,
        "DISAGG_ENGINE_IMAGES": "{}",
        "DISAGG_NEURON_ENGINE_IMAGE": config.NEURON_ENGINE_IMAGE,
        "DISAGG_ROUTER_IMAGE": config.ROUTER_IMAGE,
    }
    custom = VALUE_SETS["customised"]
    got = env(render(custom, tmp_path))
    assert got["DISAGG_ENGINE_IMAGE"] == custom["modelDefaults"]["engineImage"]
    assert got["DISAGG_NEURON_ENGINE_IMAGE"] == custom["modelDefaults"]["neuronEngineImage"]
    assert got["DISAGG_ROUTER_IMAGE"] == custom["modelDefaults"]["routerImage"]
    assert got["TZ"] == "UTC"
    # What the operator does with them: config.RenderDefaults.from_env reads exactly these names.
    for key, value in got.items():
        if key.startswith("DISAGG_"):
            monkeypatch.setenv(key, value)
    defaults = config.RenderDefaults.from_env()
    assert (defaults.engine_image, defaults.neuron_engine_image, defaults.router_image) == (
        custom["modelDefaults"]["engineImage"], custom["modelDefaults"]["neuronEngineImage"], custom["modelDefaults"]["routerImage"],
    )  # fmt: skip
    # Each release's image: the default release's is engineImage, a listed one its entry, the rest the built-in name.
    assert defaults.engine_image_for("0.33.0", "nvidia") == custom["modelDefaults"]["engineImage"]
    assert defaults.engine_image_for("0.34.0", "nvidia") == custom["modelDefaults"]["engineImages"]["0.34.0"]
    assert defaults.engine_image_for("0.26.0", "nvidia") == f"{config.ENGINE_REPOSITORY}:0.26.0-efa"


def test_engine_images_name_the_releases_the_operator_has_images_of(tmp_path: Path) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    releases = schema["properties"]["modelDefaults"]["properties"]["engineImages"]["properties"]
    assert tuple(releases) == IMAGED_NVIDIA_RELEASES


def test_image_reference(tmp_path: Path) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"], "Chart.yaml appVersion must be the package version"
    assert operator_container(render({}, tmp_path))["image"] == f"ghcr.io/disagg-dev/disagg-operator:{project['version']}"
    custom = VALUE_SETS["customised"]["image"]
    assert operator_container(render(VALUE_SETS["customised"], tmp_path))["image"] == f"{custom['repository']}@{custom['digest']}"


def test_standalone_and_peering(tmp_path: Path) -> None:
    single = render({}, tmp_path)
    container = operator_container(single)
    assert container["command"] == ["disagg-operator"] and "--standalone" in container["args"]
    assert deployment(single)["spec"]["strategy"] == {"type": "Recreate"}, "two standalone operators must never overlap"
    assert not [d for d in single if d["apiVersion"].startswith("kopf.dev/")]

    ha = render(VALUE_SETS["ha-cluster"], tmp_path)
    (peering,) = by_kind(ha, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == FULLNAME
    args = operator_container(ha)["args"]
    assert "--standalone" not in args and args[args.index("--peering") + 1] == FULLNAME
    assert deployment(ha)["spec"]["replicas"] == 3
    assert deployment(ha)["spec"]["strategy"]["type"] == "RollingUpdate"

    ha_ns = render(VALUE_SETS["ha-namespaced"], tmp_path)
    assert not by_kind(ha_ns, "ClusterKopfPeering")
    (kp,) = by_kind(ha_ns, "KopfPeering")
    assert (kp["metadata"]["name"], kp["metadata"]["namespace"]) == ("llm-ops", "team-a")


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_command_line_is_the_operators(name: str, tmp_path: Path) -> None:
    """The container's command and args run the real CLI parser; the HA shell wrapper adds a numeric priority."""
    container = operator_container(render(VALUE_SETS[name], tmp_path))
    if container["command"] == ["disagg-operator"]:
        args = container["args"]
    else:
        # Run the wrapper with a stand-in disagg-operator that prints its argv, one per line.
        bindir = tmp_path / "bin"
        bindir.mkdir()
        fake = bindir / "disagg-operator"
        fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
        out = subprocess.run(
            [*container["command"], *container["args"]], capture_output=True, text=True, check=True,
            env={"PATH": f"{bindir}:/usr/bin:/bin"},
        ).stdout.splitlines()  # fmt: skip
        assert out[: len(container["args"])] == container["args"], shlex.join(out)
        assert out[-2] == "--priority" and out[-1].isdigit(), out
        args = out
    parsed = build_parser().parse_args(args)
    assert parsed.command == "run"
    assert parsed.namespace == (VALUE_SETS[name].get("watchNamespaces") or None)
    assert parsed.standalone == (VALUE_SETS[name].get("replicaCount", 1) == 1)


def test_service_and_service_monitor(tmp_path: Path) -> None:
    docs = render({}, tmp_path)
    (svc,) = by_kind(docs, "Service")
    selector = deployment(docs)["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"] == selector
    assert svc["spec"]["ports"] == [{"name": "http-metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]
    assert not by_kind(docs, "ServiceMonitor"), "the ServiceMonitor is opt-in"

    docs = render(VALUE_SETS["customised"], tmp_path)
    (monitor,) = by_kind(docs, "ServiceMonitor")
    (svc,) = by_kind(docs, "Service")
    assert monitor["spec"]["endpoints"] == [{"port": "http-metrics", "path": "/metrics", "interval": "1m"}]
    assert all(svc["metadata"]["labels"][k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert monitor["metadata"]["labels"]["release"] == "prom"


# --- bad values are refused ------------------------------------------------------------------------------

BAD_VALUES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("zero-replicas", {"replicaCount": 0}, ["/replicaCount", "minimum"]),
    ("replicas-as-text", {"replicaCount": "two"}, ["/replicaCount", "string"]),
    ("unknown-key", {"replicas": 2}, ["additional properties 'replicas' not allowed"]),
    ("typo-in-nested-key", {"modelDefaults": {"engineImg": "x/y:1"}}, ["/modelDefaults", "engineImg"]),
    ("bad-pull-policy", {"image": {"pullPolicy": "Sometimes"}}, ["/image/pullPolicy"]),
    ("bad-namespace", {"watchNamespaces": ["Team_A"]}, ["/watchNamespaces/0", "Team_A"]),
    ("duplicate-namespace", {"watchNamespaces": ["a", "a"]}, ["/watchNamespaces", "are equal"]),
    ("empty-engine-image", {"modelDefaults": {"engineImage": ""}}, ["/modelDefaults/engineImage"]),
    ("image-with-spaces", {"modelDefaults": {"routerImage": "my router:1"}}, ["/modelDefaults/routerImage"]),
    ("privileged-port", {"healthPort": 80}, ["/healthPort", "minimum"]),
    ("bad-digest", {"image": {"digest": "latest"}}, ["/image/digest"]),
    ("bad-quantity", {"resources": {"requests": {"memory": "lots"}}}, ["/resources/requests/memory"]),
    ("env-overrides-default", {"extraEnv": [{"name": "DISAGG_ENGINE_IMAGE", "value": "x"}]}, ["/extraEnv/0/name"]),
    ("image-of-unknown-release", {"modelDefaults": {"engineImages": {"0.35.0": "x/y:1"}}}, ["/modelDefaults/engineImages", "0.35.0"]),
]  # fmt: skip


@pytest.mark.parametrize(("case", "values", "fragments"), BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_schema_refuses_bad_values(case: str, values: dict[str, Any], fragments: list[str], tmp_path: Path) -> None:
    for command in (["template", RELEASE], ["lint", "--strict"]):
        result = helm(*command, str(CHART), *values_args(values, tmp_path), check=False)
        message = result.stderr + result.stdout
        assert result.returncode != 0, f"{case}: helm {command[0]} accepted {values}"
        assert "values don't meet the specifications of the schema" in message, message
        for fragment in fragments:
            assert fragment in message, f"{case}: {fragment!r} not in:\n{message}"


def test_service_monitor_needs_the_service(tmp_path: Path) -> None:
    values = {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}
    result = helm("template", RELEASE, str(CHART), "--kube-version", f"{KUBE_VERSION}.0", *values_args(values, tmp_path), check=False)
    assert result.returncode != 0 and "metrics.serviceMonitor.enabled needs metrics.service.enabled" in result.stderr


def test_cluster_scoped_reads_get_a_cluster_role_in_namespaced_mode(tmp_path: Path) -> None:
    """kopf observes CRDs and namespaces (cluster-scoped): namespaced installs grant exactly those reads
    through a ClusterRole, and the per-namespace Roles hold the rest of rbac.rules()."""
    cluster_scoped = [
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    ]
    assert all(rule in rules() for rule in cluster_scoped)
    docs = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", f"{KUBE_VERSION}.0",
                *values_args(VALUE_SETS["namespaced"], tmp_path)).docs()  # fmt: skip
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert cluster_role["rules"] == cluster_scoped
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    for role in by_kind(docs, "Role"):
        assert role["rules"] == chart_sync.namespaced_rules(rules())
        assert not {"customresourcedefinitions", "namespaces"} & {r for rule in role["rules"] for r in rule["resources"]}
    for obj in docs:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


