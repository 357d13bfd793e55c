"""The Helm chart on a real API server: install, run the operator with the chart's ServiceAccount, upgrade,
uninstall.

The operator cannot run as a container here (no container runtime: kwok plays kubelet), so the chart's
Deployment pods are kwok's, and the operator runs as a local process with exactly what the chart gives its
pod: a token of the chart's ServiceAccount, the container's command and arguments (only the liveness address
moved to a free loopback port; the metrics port is a free one, set as the chart's value), and the container's
environment. A model reaching Ready proves the chart's RBAC suffices; SelfSubjectAccessReviews with the same
token prove it is not broader than the rules of `disagg-operator rbac`; the audit log proves the writes were
the chart ServiceAccount's own.

The control plane is shared: the operator started here watches only this test's namespaces.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from disagg_connector import contract
from disagg_operator.api.models import DEFAULT_VLLM_VERSION
from disagg_operator.manifests import dump_all
from disagg_operator.rbac import rules
from hack.gen import chart_sync
from tests.fixtures.helm import CHART, helm, values_args
from disagg_bench.ports import free_port

from tests.fixtures.e2e.models import model_manifest
from disagg_bench.operator_process import OperatorProcess
from tests.fixtures.e2e.operator import scrape
from tests.fixtures.e2e.waiting import condition, wait_for

GROUP, VERSION, PLURAL = contract.API_GROUP, contract.API_VERSION, contract.PLURAL
RELEASE_LABEL = "app.kubernetes.io/instance"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


# --- helpers -------------------------------------------------------------------------------------------


def make_namespace(core: client.CoreV1Api, name: str, labels: dict[str, str] | None = None) -> None:
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels or {})))
    wait_for(f"default ServiceAccount in {name}", lambda: core.read_namespaced_service_account("default", name), 30)


def token_kubeconfig(cluster, token: str, path: Path) -> Path:
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "chart-sa",
        "clusters": [{"name": "local", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": "chart-sa", "user": {"token": token}}],
        "contexts": [{"name": "chart-sa", "context": {"cluster": "local", "user": "chart-sa"}}],
    }))  # fmt: skip
    return path


def can(api: client.ApiClient, verb: str, resource: str, namespace: str | None = None, group: str = "",
        subresource: str | None = None) -> bool:  # fmt: skip
    review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
        resource_attributes=client.V1ResourceAttributes(
            verb=verb, resource=resource, group=group, namespace=namespace, subresource=subresource)))  # fmt: skip
    return bool(client.AuthorizationV1Api(api).create_self_subject_access_review(review).status.allowed)


def chart_operator(deployment: client.V1Deployment, kubeconfig: Path, log_dir: Path, extra_args: list[str]) -> OperatorProcess:
    """The operator as the chart's container would run it (its command, args and env), as a local process."""
    (container,) = deployment.spec.template.spec.containers
    env = {e.name: e.value for e in container.env or [] if e.value is not None}

    def command(liveness_url: str, _metrics_port: int) -> list[str]:  # the chart's args name their own
        args = list(container.args)
        args[args.index("--liveness") + 1] = liveness_url
        return [*container.command, *args, *extra_args]

    return OperatorProcess(str(kubeconfig), log_dir, extra_env=env, command=command)


def kopf_objects(lister) -> list[dict[str, Any]]:
    """Items of a kopf.dev list; none while the chart has not installed kopf's CRDs yet (a fresh cluster)."""
    try:
        return lister()["items"]
    except ApiException as e:
        if e.status == 404:
            return []
        raise


def release_objects(api: client.ApiClient, release: str, namespaces: list[str]) -> list[str]:
    """Every object labelled with the release, by kind/namespace/name (the kinds the chart can render)."""
    selector = f"{RELEASE_LABEL}={release}"
    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    custom = client.CustomObjectsApi(api)
    found: list[str] = []
    for ns in namespaces:
        for kind, lister in (
            ("Deployment", apps.list_namespaced_deployment), ("ReplicaSet", apps.list_namespaced_replica_set),
            ("Pod", core.list_namespaced_pod), ("Service", core.list_namespaced_service),
            ("ServiceAccount", core.list_namespaced_service_account), ("ConfigMap", core.list_namespaced_config_map),
            ("Role", rbac.list_namespaced_role), ("RoleBinding", rbac.list_namespaced_role_binding),
        ):  # fmt: skip
            found += [f"{kind} {ns}/{o.metadata.name}" for o in lister(ns, label_selector=selector).items]
        found += [f"KopfPeering {ns}/{o['metadata']['name']}" for o in
                  kopf_objects(lambda: custom.list_namespaced_custom_object("kopf.dev", "v1", ns, "kopfpeerings", label_selector=selector))]  # fmt: skip
        # helm's own release records
        found += [f"Secret {ns}/{s.metadata.name}" for s in core.list_namespaced_secret(ns, label_selector=f"owner=helm,name={release}").items]
    found += [f"ClusterRole {o.metadata.name}" for o in rbac.list_cluster_role(label_selector=selector).items]
    found += [f"ClusterRoleBinding {o.metadata.name}" for o in rbac.list_cluster_role_binding(label_selector=selector).items]
    found += [f"ClusterKopfPeering {o['metadata']['name']}" for o in
              kopf_objects(lambda: custom.list_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", label_selector=selector))]  # fmt: skip
    return sorted(found)


def sa_writes(cluster, username: str, since: str) -> list[dict[str, Any]]:
    return [
        e for e in cluster.audit_events()
        if e.get("verb") in WRITE_VERBS and e.get("stage") == "ResponseComplete"
        and (e.get("user") or {}).get("username") == username and e.get("requestReceivedTimestamp", "") > since
    ]  # fmt: skip


def unexpected_denials(log: str) -> list[str]:
    """Any permission the operator lacked (rbac.rules() includes kopf's own start-up reads too)."""
    return [line for line in log.splitlines() if re.search(r"[Ff]orbidden|Not enough permissions", line)]


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 1))


def get_model(custom: client.CustomObjectsApi, ns: str, name: str) -> dict[str, Any]:
    return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


def wait_ready(custom: client.CustomObjectsApi, ns: str, name: str, timeout: float = 150) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        obj = get_model(custom, ns, name)
        current = (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
        return obj if current and condition(obj, "Ready").get("status") == "True" else None

    return wait_for(f"{ns}/{name} Ready", ready, timeout)


def model(name: str) -> dict[str, Any]:
    return model_manifest(name)


def engine_images(api: client.ApiClient, ns: str, name: str) -> set[str]:
    deps = client.AppsV1Api(api).list_namespaced_deployment(ns, label_selector=f"{contract.LABEL_MODEL}={name}").items
    return {c.image for d in deps if d.metadata.labels.get(contract.LABEL_ROLE) in ("prefill", "decode")
            for c in d.spec.template.spec.containers}  # fmt: skip


def fence(cluster, api: client.ApiClient, name: str, label: str, allowed_user: str, tmp: Path) -> None:
    """Only `allowed_user` among ServiceAccounts outside kube-system may write in namespaces labelled `label`.

    The control plane may be shared with other sessions whose operators watch every namespace; without the
    fence one of them could reconcile this test's model first, and the chart's ServiceAccount would prove
    nothing. A ValidatingAdmissionPolicy refuses their writes here (controllers in kube-system, kwok and
    the admin stay allowed)."""
    key, _, value = label.partition("=")
    manifests = [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy", "metadata": {"name": name},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"namespaceSelector": {"matchLabels": {key: value}}, "resourceRules": [
                      {"apiGroups": ["*"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE", "DELETE"], "resources": ["*/*"]}]},
                  "validations": [{"expression": (
                      "!request.userInfo.username.startsWith('system:serviceaccount:')"
                      " || request.userInfo.username.startsWith('system:serviceaccount:kube-system:')"
                      f" || request.userInfo.username == '{allowed_user}'"),
                      "message": "fenced by tests/e2e/test_helm.py: only the operator under test writes here"}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding", "metadata": {"name": name},
         "spec": {"policyName": name, "validationActions": ["Deny"]}},
    ]  # fmt: skip
    path = tmp / f"{name}.yaml"
    path.write_text(dump_all(manifests))  # quotes label values such as "3e2461" that kubectl reads as numbers
    applied = cluster.kubectl("apply", "--server-side", "-f", str(path), check=False)
    assert applied.returncode == 0, applied.stderr
    namespace = next(n.metadata.name for n in client.CoreV1Api(api).list_namespace(label_selector=label).items)

    def effective() -> bool:
        probe = cluster.kubectl("create", "configmap", f"fence-probe-{uuid.uuid4().hex[:6]}", "-n", namespace,
                                "--as=system:serviceaccount:fence:probe", "--as-group=system:masters", check=False)  # fmt: skip
        if probe.returncode == 0:
            return False
        assert "fenced by tests/e2e/test_helm.py" in probe.stderr, probe.stderr
        return True

    wait_for("the admission fence to take effect", effective, 30)


def unfence(cluster, name: str) -> None:
    cluster.kubectl("delete", "validatingadmissionpolicybinding", name, "--ignore-not-found", check=False)
    cluster.kubectl("delete", "validatingadmissionpolicy", name, "--ignore-not-found", check=False)


# --- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture
def helm_env(cluster, crd_installed, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A release namespace (Pod Security `restricted`), two model namespaces; all removed afterwards."""
    api = cluster.api_client()
    core = client.CoreV1Api(api)
    suffix = uuid.uuid4().hex[:6]
    env = {
        "api": api, "core": core, "release": f"dop-{suffix}", "ns": f"helm-op-{suffix}",
        "a": f"helm-a-{suffix}", "b": f"helm-b-{suffix}", "tmp": tmp_path, "operators": [],
        # The chart's operator runs here as a local process: /metrics on a port no one else holds.
        "metrics_port": free_port(),
    }  # fmt: skip
    make_namespace(core, env["ns"], {"pod-security.kubernetes.io/enforce": "restricted",
                                     "pod-security.kubernetes.io/enforce-version": "latest"})  # fmt: skip
    fence_label = f"disagg.dev/e2e-fence={suffix}"
    make_namespace(core, env["a"], {"disagg.dev/e2e-fence": suffix})
    make_namespace(core, env["b"], {"disagg.dev/e2e-fence": suffix})
    fence_name = f"helm-e2e-fence-{suffix}"
    try:
        fence(cluster, api, fence_name, fence_label, f"system:serviceaccount:{env['ns']}:{env['release']}-disagg-operator", tmp_path)
        yield env
    finally:
        unfence(cluster, fence_name)
        for op in env["operators"]:
            op.stop()
        helm("uninstall", env["release"], "-n", env["ns"], "--wait", "--ignore-not-found", kubeconfig=cluster.kubeconfig, check=False)
        for ns in (env["a"], env["b"], env["ns"]):
            try:
                core.delete_namespace(ns, propagation_policy="Background")
            except ApiException as e:
                if e.status != 404:
                    raise


def install(cluster, env: dict[str, Any], command: str, values: dict[str, Any]) -> str:
    """Every install and upgrade sets the free metrics port: an upgrade without it would reset it to 8081."""
    values = {"metricsPort": env["metrics_port"], **values}
    result = helm(
        command, env["release"], str(CHART), "-n", env["ns"], "--wait", "--timeout", "180s",
        *values_args(values, env["tmp"]), kubeconfig=cluster.kubeconfig,
    )  # fmt: skip
    return result.stdout


def sa_token(cluster, env: dict[str, Any], fullname: str) -> str:
    return cluster.kubectl("create", "token", fullname, "-n", env["ns"], "--duration=1h").stdout.strip()


# --- tests -----------------------------------------------------------------------------------------------


def test_bad_values_fail_at_install_and_create_nothing(cluster, helm_env) -> None:
    env = helm_env
    result = helm("install", env["release"], str(CHART), "-n", env["ns"], "--set", "replicaCount=0",
                  "--set", "watchNamespaces={Not_A_Namespace}", kubeconfig=cluster.kubeconfig, check=False)  # fmt: skip
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert "/replicaCount" in result.stderr and "/watchNamespaces/0" in result.stderr
    assert release_objects(env["api"], env["release"], [env["ns"]]) == []


def test_install_run_upgrade_uninstall(cluster, helm_env) -> None:
    env = helm_env
    api, ns, a, b, release = env["api"], env["ns"], env["a"], env["b"], env["release"]
    fullname = f"{release}-disagg-operator"
    sa_user = f"system:serviceaccount:{ns}:{fullname}"
    custom = client.CustomObjectsApi(api)
    rbac = client.RbacAuthorizationV1Api(api)
    apps = client.AppsV1Api(api)

    # --- 1. install, cluster-wide, one replica ------------------------------------------------------------
    metrics_port = env["metrics_port"]
    notes = install(cluster, env, "install", {})
    assert "kind: DisaggregatedModel" in notes and "kubectl apply" in notes, notes
    assert "keeps the CRD and every" in notes
    dep = apps.read_namespaced_deployment(fullname, ns)
    assert dep.status.ready_replicas == 1, "the operator pod passed Pod Security 'restricted' and is Ready (kwok)"
    assert api.sanitize_for_serialization(rbac.read_cluster_role(fullname))["rules"] == rules()
    crd_names = {c.metadata.name for c in client.ApiextensionsV1Api(api).list_custom_resource_definition().items}
    assert {"disaggregatedmodels.disagg.dev", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= crd_names

    # The split of rules into namespaced/cluster-scoped agrees with the API server's discovery.
    scoped: dict[str, bool] = {}
    for namespaced in (True, False):
        out = cluster.kubectl("api-resources", f"--namespaced={str(namespaced).lower()}", "-o", "name").stdout
        scoped.update({line.split(".", 1)[0]: namespaced for line in out.split()})
    namespaced_resources = {r for rule in chart_sync.namespaced_rules(rules()) for r in rule["resources"]}
    for resource in {r.split("/", 1)[0] for rule in rules() for r in rule["resources"]}:
        assert resource in scoped, f"{resource} unknown to the API server"
        assert scoped[resource] == (resource in namespaced_resources), f"{resource}: namespaced={scoped[resource]}"

    token = sa_token(cluster, env, fullname)
    sa_api = cluster.token_api_client(token)
    # Least privilege, cluster-wide: what the operator needs, and nothing around it.
    assert can(sa_api, "watch", PLURAL, None, GROUP) and can(sa_api, "patch", PLURAL, a, GROUP, "status")
    assert can(sa_api, "create", "deployments", a, "apps") and can(sa_api, "list", "pods", a)
    for verb, resource, namespace, group in [
        ("get", "secrets", a, ""), ("list", "secrets", None, ""), ("watch", "secrets", "kube-system", ""),
        ("create", "pods", a, ""), ("delete", "pods", a, ""), ("create", "pods", a, ""), ("get", "configmaps", a, ""),
        ("list", "nodes", None, ""), ("delete", "namespaces", None, ""), ("create", PLURAL, a, GROUP),
        ("delete", PLURAL, a, GROUP), ("update", "customresourcedefinitions", None, "apiextensions.k8s.io"),
        ("create", "clusterroles", None, "rbac.authorization.k8s.io"),
        ("create", "clusterrolebindings", None, "rbac.authorization.k8s.io"),
        ("escalate", "roles", a, "rbac.authorization.k8s.io"), ("bind", "roles", a, "rbac.authorization.k8s.io"),
        ("create", "statefulsets", a, "apps"), ("create", "serviceaccounts/token", a, ""),
        ("impersonate", "serviceaccounts", a, ""), ("create", "persistentvolumeclaims", a, ""),
    ]:  # fmt: skip
        assert not can(sa_api, verb, resource, namespace, group), f"the chart's SA may {verb} {group}/{resource} in {namespace}"

    # The operator, as the chart runs it, with the chart's token (watching only this test's namespace).
    since = now_rfc3339()
    kubeconfig = token_kubeconfig(cluster, token, env["tmp"] / "sa-kubeconfig")
    op = chart_operator(dep, kubeconfig, env["tmp"], ["--namespace", a])
    assert op.command("x", 0)[:3] == ["disagg-operator", "run", "--standalone"] and op.extra_env["DISAGG_ENGINE_IMAGE"]
    env["operators"].append(op.start())
    # /metrics through the chart's Service: its targetPort names the container port the operator serves on.
    (svc,) = client.CoreV1Api(api).list_namespaced_service(ns, label_selector=f"{RELEASE_LABEL}={release}").items
    (svc_port,) = svc.spec.ports
    (port,) = [p.container_port for p in dep.spec.template.spec.containers[0].ports if p.name == svc_port.target_port]
    assert port == metrics_port and svc_port.name == "http-metrics"
    before = scrape(port)
    custom.create_namespaced_custom_object(GROUP, VERSION, a, PLURAL, model("qwen"))
    try:
        first = wait_ready(custom, a, "qwen")
    except AssertionError:
        raise AssertionError(f"not Ready; operator log:\n{op.log()[-6000:]}") from None
    after = scrape(port)
    success = 'controller_runtime_reconcile_total{controller="disaggregatedmodel",result="success"}'
    assert after[success] > before.get(success, 0)
    assert after['disagg_operator_children_applied_total{kind="Deployment"}'] >= 3
    assert engine_images(api, a, "qwen") == {op.extra_env["DISAGG_ENGINE_IMAGE"]}, "the engine image default comes from the chart"
    assert first["status"]["vllmVersion"] == DEFAULT_VLLM_VERSION["nvidia"], "the release it runs, which an upgrade keeps"
    if cluster.audit_log:
        writes = sa_writes(cluster, sa_user, since)
        denied = [e for e in writes if (e.get("responseStatus") or {}).get("code", 200) in (401, 403)]
        assert not denied, f"the chart's SA was refused: {[(e['verb'], e['objectRef']) for e in denied]}"
        # Server-side apply: a create is a PATCH too.
        written = {e["objectRef"]["resource"] for e in writes if e["objectRef"].get("namespace") == a}
        assert {"deployments", "services", "serviceaccounts", "roles", "rolebindings", PLURAL} <= written, written
        assert any(e["objectRef"].get("subresource") == "status" for e in writes), "status written by the chart's SA"
    op.stop()
    assert not unexpected_denials(op.log()), unexpected_denials(op.log())

    # --- 2. upgrade: only namespace a, two replicas (peering), other model defaults and resources ----------
    new_engine = "registry.example.com/ml/vllm-runtime:0.33.0-efa-2"
    values = {
        "watchNamespaces": [a], "replicaCount": 2,
        "modelDefaults": {"engineImage": new_engine, "neuronEngineImage": "registry.example.com/ml/vllm-runtime:0.33.0-neuron-2",
                          "routerImage": "registry.example.com/ml/disagg-router:0.1.0-2"},
        "resources": {"requests": {"cpu": "200m", "memory": "300Mi"}, "limits": {"memory": "1Gi"}},
    }  # fmt: skip
    install(cluster, env, "upgrade", values)
    dep = apps.read_namespaced_deployment(fullname, ns)
    (container,) = dep.spec.template.spec.containers
    assert dep.spec.replicas == 2 and dep.status.ready_replicas == 2
    assert {e.name: e.value for e in container.env}["DISAGG_ENGINE_IMAGE"] == new_engine
    assert container.resources.requests == {"cpu": "200m", "memory": "300Mi"}
    leftovers = release_objects(api, release, [ns, a, b])
    assert not [o for o in leftovers if o.startswith("ClusterKopfPeering ")], leftovers
    # Namespaced mode keeps one ClusterRole: only kopf's cluster-scoped start-up reads, nothing to write.
    cluster_rules = client.RbacAuthorizationV1Api(api).read_cluster_role(fullname).rules
    assert {(tuple(r.resources), tuple(r.verbs)) for r in cluster_rules} == {
        (("customresourcedefinitions",), ("list", "watch")), (("namespaces",), ("list", "watch")),
    }
    assert f"Role {a}/{fullname}" in leftovers and f"RoleBinding {a}/{fullname}" in leftovers
    assert f"KopfPeering {a}/{fullname}" in leftovers and not [o for o in leftovers if f" {b}/" in o]
    # Old ReplicaSets are the Deployment's history (revisionHistoryLimit), not orphans: owned by it.
    for rs in apps.list_namespaced_replica_set(ns, label_selector=f"{RELEASE_LABEL}={release}").items:
        assert [o.name for o in rs.metadata.owner_references] == [fullname]

    # Namespaced now: the same token lost everything outside namespace a.
    assert can(sa_api, "list", PLURAL, a, GROUP) and can(sa_api, "patch", "kopfpeerings", a, "kopf.dev")
    for verb, resource, namespace, group in [
        ("list", PLURAL, b, GROUP), ("list", PLURAL, None, GROUP), ("create", "deployments", b, "apps"),
        ("patch", "clusterkopfpeerings", None, "kopf.dev"), ("get", "secrets", a, ""), ("list", "pods", b, ""),
    ]:  # fmt: skip
        assert not can(sa_api, verb, resource, namespace, group), f"namespaced SA may {verb} {resource} in {namespace}"

    # Run the HA command line exactly (random priority wrapper, peering, --namespace a): the model moves to
    # a new revision with the new engine image, and the operator keeps the KopfPeering alive.
    since = now_rfc3339()
    op = chart_operator(dep, kubeconfig, env["tmp"], [])
    argv = op.command("x", 0)
    assert argv[:2] == ["/bin/sh", "-c"] and "--peering" in argv and "--standalone" not in argv
    assert argv[argv.index("--metrics-port") + 1] == str(metrics_port), "the upgrade kept the free metrics port"
    env["operators"].append(op.start())

    def rolled() -> dict[str, Any] | None:
        obj = get_model(custom, a, "qwen")
        ok = obj["status"].get("revision") != first["status"]["revision"] and condition(obj, "Ready").get("status") == "True"
        return obj if ok and engine_images(api, a, "qwen") == {new_engine} else None

    try:
        wait_for("the new engine image to roll out", rolled, 150)
    except AssertionError:
        raise AssertionError(f"not rolled out; operator log:\n{op.log()[-6000:]}") from None
    peering = custom.get_namespaced_custom_object("kopf.dev", "v1", a, "kopfpeerings", fullname)
    assert peering.get("status"), "the operator registered itself in the chart's KopfPeering"
    if cluster.audit_log:
        writes = sa_writes(cluster, sa_user, since)
        assert not [e for e in writes if (e.get("responseStatus") or {}).get("code", 200) in (401, 403)], writes
        assert any(e["objectRef"]["resource"] == "kopfpeerings" for e in writes)
    op.stop()
    assert not unexpected_denials(op.log()), unexpected_denials(op.log())

    # --- 3. uninstall: nothing of the release is left; the CRD and the models stay, as documented ---------
    helm("uninstall", release, "-n", ns, "--wait", kubeconfig=cluster.kubeconfig)
    wait_for("the release's objects to be gone", lambda: release_objects(api, release, [ns, a, b]) == [] or None, 90)
    assert client.ApiextensionsV1Api(api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    kept = get_model(custom, a, "qwen")
    assert kept["metadata"].get("finalizers") in (None, []), "no finalizer: models can be deleted with no operator"
    assert engine_images(api, a, "qwen") == {new_engine}, "the model's engines keep running, unmanaged"
    def token_rejected() -> bool:
        # The API server caches successful token reviews for a few seconds; then the deleted ServiceAccount's
        # token no longer authenticates at all (401), it is not merely unauthorised (403).
        try:
            client.CoreV1Api(sa_api).list_namespaced_pod(a)
        except ApiException as e:
            assert e.status in (401, 403), e
            return e.status == 401
        raise AssertionError("the chart's token still lists pods after the uninstall")

    wait_for("the chart's ServiceAccount token to stop authenticating", token_rejected, 60)
    # Deleting a model after the uninstall does not hang, and the garbage collector removes its children.
    custom.delete_namespaced_custom_object(GROUP, VERSION, a, PLURAL, "qwen")
    wait_for("the model to be deleted", lambda: not custom.list_namespaced_custom_object(GROUP, VERSION, a, PLURAL)["items"], 30)
    wait_for("its children to be collected", lambda: not engine_images(api, a, "qwen"), 60)
