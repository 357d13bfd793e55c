"""Prefill and decode engines: pod template, Deployment and headless Service of one role."""

from __future__ import annotations

import math
from typing import Any

from disagg_connector import contract

from ..api.models import DisaggregatedModel, RoleSpec
from ..config import RenderDefaults
from ..quantity import format_bytes, parse_quantity
from ..resolve import TransferPlan
from . import gang, placement, vllm
from .meta import metadata

ACCELERATOR_RESOURCE = contract.ACCELERATOR_RESOURCES
EFA_RESOURCE = contract.EFA_RESOURCE
HUGEPAGES_RESOURCE = contract.HUGEPAGES_RESOURCE
HEALTH_PATH = "/health"
STARTUP_PERIOD_SECONDS = 10
PREFLIGHT_COMMAND = "disagg-preflight"
# Of the grace period, what vLLM's own shutdown gets after the preStop returns: SIGTERM aborts what is
# left, the engine core and worker processes are terminated (vLLM joins them for up to 5 s before it
# kills them), NIXL and the accelerator contexts are released, uvicorn closes its connections; plus the
# preStop's last scrape (up to 2 s). Past the grace period the kubelet sends SIGKILL.
SHUTDOWN_MARGIN_SECONDS = 15
# The engines of a role whose engine spans pods: one LeaderWorkerSet group each (sigs.k8s.io/lws, v0.9.0 tested).
LWS_API_VERSION, LWS_KIND, LWS_PLURAL = "leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"
ENGINE_KINDS = ("Deployment", LWS_KIND)
# What to do when the cluster does not serve a kind the operator renders (a CRD that is not installed).
INSTALL_HINTS = {
    LWS_KIND: "a role whose engine spans pods runs as a LeaderWorkerSet: install LeaderWorkerSet (v0.9.0 is tested: "
    "kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/v0.9.0/manifests.yaml), "
    "or give each engine the accelerators of all its ranks (accelerator.count = tensor x pipeline x data)",
}


def engine_image(dm: DisaggregatedModel, role: RoleSpec, release: str, defaults: RenderDefaults) -> str:
    """The spec's image, else the operator's image of the release the engines run."""
    if dm.spec.engine.image:
        return dm.spec.engine.image
    image = defaults.engine_image_for(release, role.accelerator.type)
    if image is None:  # admission refuses a release without an image; a release held from status can get here
        raise ValueError(f"the operator has no {role.accelerator.type} engine image of vLLM {release}, which this model "
                         "runs: set spec.engine.image to an image of it, or spec.engine.vllmVersion to a release the "
                         "operator has an image of")  # fmt: skip
    return image


def _device_resources(dm: DisaggregatedModel, role: RoleSpec) -> dict[str, str]:
    """Extended resources must be equal in requests and limits; these win over user resources."""
    devices = {ACCELERATOR_RESOURCE[role.accelerator.type]: str(role.accelerator.count)}
    if role.efa.count > 0:
        devices[EFA_RESOURCE] = str(role.efa.count)
        if dm.spec.network.efa.hugepages != "0":
            devices[HUGEPAGES_RESOURCE] = dm.spec.network.efa.hugepages
    return devices


def resources(dm: DisaggregatedModel, role: RoleSpec) -> dict[str, Any]:
    devices = _device_resources(dm, role)
    requests, limits = {**role.resources.requests, **devices}, {**role.resources.limits, **devices}
    tier = vllm.role_cpu_tier_bytes(role)
    if tier is not None:
        # the CPU tier is host memory each engine core pins: the scheduler must count it, the OOM killer allow it
        added = tier * role.shape.ranks_per_pod
        requests["memory"] = format_bytes(int(parse_quantity(requests.get("memory", 0))) + added)
        if "memory" in limits:
            limits["memory"] = format_bytes(int(parse_quantity(limits["memory"])) + added)
    return {"requests": requests, "limits": limits}


def _tolerations(role: RoleSpec) -> list[dict[str, Any]]:
    keys = [ACCELERATOR_RESOURCE[role.accelerator.type]]
    if role.efa.count > 0:
        keys.append(EFA_RESOURCE)
    defaults = [{"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in keys]
    return defaults + [t.model_dump(by_alias=True, exclude_none=True) for t in role.tolerations]


def _security_context(dm: DisaggregatedModel, role: RoleSpec) -> dict[str, Any] | None:
    if role.efa.count == 0:
        return None
    if dm.spec.network.efa.privileged:
        return {"privileged": True}
    # Registering memory with the EFA device pins pages: IPC_LOCK lifts the memlock limit.
    return {"capabilities": {"add": ["IPC_LOCK"]}}


def _ports(dm: DisaggregatedModel, role: RoleSpec) -> list[dict[str, Any]]:
    ports = [{"name": contract.HTTP_PORT_NAME, "containerPort": contract.HTTP_PORT, "protocol": "TCP"}]
    base = dm.spec.kv_transfer.side_channel_port
    for rank in range(role.parallelism.data):
        name = contract.NIXL_PORT_NAME if rank == 0 else f"{contract.NIXL_PORT_NAME}-dp{rank}"
        port = contract.side_channel_port(base, rank)
        ports.append({"name": name, "containerPort": port, "protocol": "TCP"})
    if dm.spec.publishes_kv_events:
        for name, base in ((contract.KV_EVENTS_PORT_NAME, contract.KV_EVENTS_PORT),
                           (contract.KV_EVENTS_REPLAY_PORT_NAME, contract.KV_EVENTS_REPLAY_PORT)):  # fmt: skip
            ports += [
                {"name": name if rank == 0 else f"{name}-dp{rank}",
                 "containerPort": contract.kv_events_port(base, rank), "protocol": "TCP"}
                for rank in range(role.parallelism.data)
            ]  # fmt: skip
    return ports


def _probes(dm: DisaggregatedModel) -> dict[str, Any]:
    def http_get(period: int, failures: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": HEALTH_PATH, "port": contract.HTTP_PORT_NAME},
            "periodSeconds": period,
            "timeoutSeconds": 5,
            "failureThreshold": failures,
        }

    startup_failures = math.ceil(dm.spec.engine.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)
    return {
        # Weight loading can take many minutes: only the startup probe waits for it.
        "startupProbe": http_get(STARTUP_PERIOD_SECONDS, startup_failures),
        "readinessProbe": http_get(5, 3),
        "livenessProbe": http_get(10, 6),
    }


def pre_stop_deadline_seconds(dm: DisaggregatedModel) -> int:
    """How long the preStop may wait for the engine to be idle: the grace period less vLLM's shutdown."""
    return max(0, dm.spec.engine.termination_grace_period_seconds - SHUTDOWN_MARGIN_SECONDS)


def _pre_stop(dm: DisaggregatedModel) -> dict[str, Any]:
    """Stay up until nothing is in flight: the router sends a terminating pod nothing new, and
    disagg-drain waits (bounded) until vLLM's own gauges say no request runs or waits and no KV block is
    held (a prefill's blocks wait for their decode's read), then returns so the kubelet sends SIGTERM,
    on which vLLM aborts whatever is left (docs/design.md, "Engine pod lifecycle")."""
    command = [
        contract.DRAIN_COMMAND,
        "--port", str(contract.HTTP_PORT),
        "--deadline-seconds", str(pre_stop_deadline_seconds(dm)),
    ]  # fmt: skip
    return {"exec": {"command": command}}


def _bytes(quantity: str) -> int:
    return int(parse_quantity(quantity))


def preflight_container(
    dm: DisaggregatedModel, role: RoleSpec, plan: TransferPlan, image: str, res: dict[str, Any]
) -> dict[str, Any]:
    """Checks the fabric before vLLM starts; a failure names itself in the termination message."""
    huge = dm.spec.network.efa.hugepages if role.efa.count > 0 else "0"
    command = [
        PREFLIGHT_COMMAND,
        "--backend", plan.backend,
        "--efa-devices", str(role.efa.count),
        "--accelerator", role.accelerator.type,
        "--accelerator-count", str(role.accelerator.count),
        "--hugepages-2mi-bytes", str(_bytes(huge)),
        "--shm-min-bytes", str(_bytes(dm.spec.network.efa.shared_memory)),
    ]  # fmt: skip
    container: dict[str, Any] = {
        "name": "preflight",
        "image": image,
        "imagePullPolicy": dm.spec.engine.image_pull_policy,
        "command": command,
        "resources": res,  # the same devices as vLLM: the device plugin hands them to this container too
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    security = _security_context(dm, role)
    if security:
        container["securityContext"] = security
    return container


def weights_claim(dm: DisaggregatedModel) -> str | None:
    """The PersistentVolumeClaim the engines read the weights from (spec.model.source pvc://claim/path), if any."""
    source = dm.spec.model.source
    if source is None or not source.uri.startswith("pvc://"):
        return None
    return source.uri.removeprefix("pvc://").split("/", 1)[0]


def _volumes(dm: DisaggregatedModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": dm.spec.network.efa.shared_memory}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if (claim := weights_claim(dm)) is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": f"{vllm.MODEL_MOUNT_ROOT}/{claim}", "readOnly": True})
    return volumes, mounts


def identity_annotations(dm: DisaggregatedModel, role: RoleSpec, plan: TransferPlan) -> dict[str, str]:
    """What the router reads from a pod to address its engine (engine_id comes from name and UID; a pod of
    an engine that spans pods also says how many ranks it serves, its first from its LWS worker index) and, where
    the engines publish them, to follow its KV cache events."""
    par = role.parallelism
    spans = {contract.ANNOTATION_DP_SIZE_LOCAL: str(role.shape.ranks_per_pod)} if role.shape.spans_pods else {}
    return {
        **spans,
        contract.ANNOTATION_TP_SIZE: str(par.tensor),
        contract.ANNOTATION_PP_SIZE: str(par.pipeline),
        contract.ANNOTATION_DP_SIZE: str(par.data),
        contract.ANNOTATION_SIDE_CHANNEL_PORT: str(dm.spec.kv_transfer.side_channel_port),
        contract.ANNOTATION_HTTP_PORT: str(contract.HTTP_PORT),
        contract.ANNOTATION_TRANSFER_MODE: plan.mode,
        contract.ANNOTATION_VLLM_VERSION: plan.vllm_version,
        **kv_events_annotations(dm),
    }


def kv_events_annotations(dm: DisaggregatedModel) -> dict[str, str]:
    """What a router needs to follow an engine's KV cache: where it publishes its events (each port + the global
    data-parallel rank) and how it hashes blocks. Nothing where the engines publish none."""
    spec = dm.spec
    if not spec.publishes_kv_events:
        return {}
    return {
        contract.ANNOTATION_KV_EVENTS_PORT: str(contract.KV_EVENTS_PORT),
        contract.ANNOTATION_KV_EVENTS_REPLAY_PORT: str(contract.KV_EVENTS_REPLAY_PORT),
        contract.ANNOTATION_KV_HASH_SEED: contract.kv_hash_seed(spec.model.name),
        contract.ANNOTATION_KV_BLOCK_SIZE: str(spec.engine.block_size),
    }


def pod_template(
    dm: DisaggregatedModel, role_name: contract.Role, plan: TransferPlan, defaults: RenderDefaults
) -> dict[str, Any]:
    """The pod template without the revision label (the revision is a hash of this template)."""
    spec = dm.spec
    role: RoleSpec = getattr(spec, role_name)
    image = engine_image(dm, role, plan.vllm_version, defaults)
    res = resources(dm, role)
    volumes, mounts = _volumes(dm)
    command = vllm.serve_command(spec, role_name, plan)
    if role.shape.spans_pods:  # the shell's script is the command, vLLM's command line its arguments
        wrapped = vllm.with_start_rank(command, role.shape)
        command_part, args_part = wrapped[:3], wrapped[3:]
    else:
        command_part, args_part = command[:2], command[2:]
    container: dict[str, Any] = {
        "name": "vllm",
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": command_part,
        "args": args_part,
        "env": vllm.engine_env(spec, role_name, plan),
        "ports": _ports(dm, role),
        "resources": res,
        "volumeMounts": mounts,
        **_probes(dm),
        "lifecycle": {"preStop": _pre_stop(dm)},
    }
    env_from = vllm.env_from(spec)
    if env_from:
        container["envFrom"] = env_from
    security = _security_context(dm, role)
    if security:
        container["securityContext"] = security

    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # engines never talk to the API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.engine.termination_grace_period_seconds,
        "initContainers": [preflight_container(dm, role, plan, image, res)],
        "containers": [container],
        "volumes": volumes,
        "tolerations": _tolerations(role),
        "affinity": placement.affinity(dm, role_name),
    }
    if role.node_selector:
        pod_spec["nodeSelector"] = dict(role.node_selector)
    if role.priority_class_name:
        pod_spec["priorityClassName"] = role.priority_class_name
    if role.scheduler_name:
        pod_spec["schedulerName"] = role.scheduler_name
    pod_spec |= gang.pair_scheduling_group(dm)  # hashed as "the pair of its revision", named by `deployment`
    return {
        "metadata": {
            # the gang label is hashed with the rest: changing it is a new revision, rolled out with drains
            "labels": {**contract.child_labels(dm.metadata.name, role_name), **gang.pod_label(dm, role)},
            "annotations": identity_annotations(dm, role, plan),
        },
        "spec": pod_spec,
    }


def deployment(
    dm: DisaggregatedModel, role_name: contract.Role, template: dict[str, Any], revision: str
) -> dict[str, Any]:
    model = dm.metadata.name
    role: RoleSpec = getattr(dm.spec, role_name)
    rollout = getattr(dm.spec.rollout, role_name)
    labels = contract.child_labels(model, role_name, revision)
    pod_labels = {**template["metadata"]["labels"], **labels, **gang.pair_label(dm, revision)}
    template = gang.name_pair({**template, "metadata": {**template["metadata"], "labels": pod_labels}}, dm, revision)
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {**contract.selector_labels(model, role_name), contract.LABEL_REVISION: revision}},
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": rollout.max_surge,
                "maxUnavailable": rollout.max_unavailable,
            },
        },
        "revisionHistoryLimit": 2,
        "progressDeadlineSeconds": dm.spec.engine.startup_timeout_seconds + 600,
        "template": template,
    }
    # The size here is the role's target; the planner sizes each revision's Deployment step by step.
    spec = {"replicas": role.replicas, **spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(dm, contract.engine_deployment_name(model, role_name, revision), labels),
        "spec": spec,
    }


def leader_worker_set(
    dm: DisaggregatedModel, role_name: contract.Role, template: dict[str, Any], revision: str
) -> dict[str, Any]:
    """The engines of a role whose engine spans pods, for one revision: one LeaderWorkerSet group per engine
    (its replicas count engines), every pod from the same template (the leader is worker 0), the whole group
    recreated when one of its pods restarts (vLLM's data-parallel ranks cannot rejoin a running engine), the
    workers created once the leader exists (they wait for its handshake port themselves)."""
    model = dm.metadata.name
    role: RoleSpec = getattr(dm.spec, role_name)
    labels = contract.child_labels(model, role_name, revision)
    pod_labels = {**template["metadata"]["labels"], **labels, **gang.pair_label(dm, revision)}  # group 0: the pair's
    template = {**template, "metadata": {**template["metadata"], "labels": pod_labels}}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": metadata(dm, contract.engine_deployment_name(model, role_name, revision), labels),
        "spec": {
            "replicas": role.replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": role.shape.pods,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": template,
            },
        },
    }


def engines(dm: DisaggregatedModel, role_name: contract.Role, template: dict[str, Any], revision: str) -> dict[str, Any]:
    """A role's engines of one revision: a Deployment of one pod per engine, or a LeaderWorkerSet of one group
    per engine when an engine spans pods."""
    role: RoleSpec = getattr(dm.spec, role_name)
    build = leader_worker_set if role.shape.spans_pods else deployment
    return build(dm, role_name, template, revision)


def headless_service(dm: DisaggregatedModel, role_name: contract.Role) -> dict[str, Any]:
    """Stable DNS for every pod of a role across revisions (the router discovers pods by label)."""
    model = dm.metadata.name
    role: RoleSpec = getattr(dm.spec, role_name)
    ports = [
        {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
        for p in _ports(dm, role)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(dm, contract.role_service_name(model, role_name), contract.child_labels(model, role_name)),
        "spec": {
            "clusterIP": "None",
            "selector": contract.selector_labels(model, role_name),
            "ports": ports,
            "publishNotReadyAddresses": False,
        },
    }
