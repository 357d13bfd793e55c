"""The permissions the operator needs, in one place: the Helm chart and the e2e tests use this.

Least privilege: the operator reads and writes only the kinds it renders, reads pods for status and
annotates the pods it retires (draining mark, deletion cost), resizes older revisions' Deployments and LeaderWorkerSets,
writes Events (kopf posts warnings) and its peering objects (HA). Creating the router's Role requires
holding its permissions (pods get/list/watch), which the operator has for status anyway. kopf reads
CRDs and namespaces at start-up. No Secrets.
"""

from __future__ import annotations

from typing import Any

from disagg_connector import contract

from .render import LWS_API_VERSION, LWS_PLURAL, MANAGED_KINDS

WRITE = ["get", "list", "watch", "create", "update", "patch", "delete"]
READ = ["get", "list", "watch"]


def group_of(api_version: str) -> str:
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def rules() -> list[dict[str, Any]]:
    by_group: dict[str, list[str]] = {}
    for api_version, _, plural in MANAGED_KINDS:
        by_group.setdefault(group_of(api_version), []).append(plural)
    managed = [{"apiGroups": [g], "resources": sorted(r), "verbs": WRITE} for g, r in sorted(by_group.items())]
    return [
        {"apiGroups": [contract.API_GROUP], "resources": [contract.PLURAL], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [contract.API_GROUP], "resources": [f"{contract.PLURAL}/status"], "verbs": ["get", "patch", "update"]},
        *managed,
        {"apiGroups": [contract.API_GROUP], "resources": [f"{contract.ROLE_PLURAL}/status"], "verbs": ["get", "patch", "update"]},
        # Retirement: a draining mark and the deletion cost on a leaving pod; older revisions resized.
        {"apiGroups": [""], "resources": ["pods"], "verbs": [*READ, "patch"]},
        # Why a gang's pods cannot be scheduled where the scheduler does not say: the weights' claim exists?
        {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch", "update"]},
        {"apiGroups": [group_of(LWS_API_VERSION)], "resources": [f"{LWS_PLURAL}/scale"],
         "verbs": ["get", "patch", "update"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings", "kopfpeerings"], "verbs": ["get", "list", "watch", "patch"]},
        # kopf's own discovery at start-up: without these it retries for ~55 s before falling back.
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    ]


def cluster_role(name: str = contract.OPERATOR_NAME) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {contract.LABEL_NAME: contract.OPERATOR_NAME}},
        "rules": rules(),
    }
