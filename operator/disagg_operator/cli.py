"""`disagg-operator`: render, validate and plan DisaggregatedModels offline, print the CRD.

`render` prints exactly what the operator would apply (for GitOps review and debugging); `validate`
reports every problem with its field path; `plan` says what a change will do (new revision or not and
why, the rollout steps, the peak pods and accelerators). Bad input exits non-zero with a message, never
a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import getpass
import os
import socket
import sys
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from disagg_connector import contract

from .api.crd import render_crd_yaml
from .api.models import DisaggregatedModel
from .api.validation import SpecError, parse
from .changeplan import PlanError, change_plan
from .config import DefaultsError, RenderDefaults
from .manifests import dump_all, load_all
from .rbac import cluster_role
from . import gangs
from .render import gang, render

if TYPE_CHECKING:
    from .metrics import OperatorMetrics

EXIT_INVALID = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3  # run: a port the operator must serve cannot be bound


class InputError(Exception):
    """A file that cannot be read as DisaggregatedModel documents."""


class StartError(Exception):
    """`run` cannot serve an endpoint (a port taken, an address not here): said before kopf starts."""


def _read_documents(source: str) -> list[tuple[str, Any]]:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as error:
        raise InputError(f"cannot read {source}: {error.strerror or error}") from None
    try:
        docs = load_all(text)
    except yaml.YAMLError as error:
        raise InputError(f"{source} is not valid YAML: {error}") from None
    if not docs:
        raise InputError(f"{source} holds no documents")
    labelled = []
    for index, doc in enumerate(docs):
        name = doc.get("metadata", {}).get("name") if isinstance(doc, dict) else None
        labelled.append((f"{source}#{index}" + (f" ({name})" if name else ""), doc))
    return labelled


def _only_models(docs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Skip other kinds in a mixed file (a Namespace, a Secret) but say so."""
    models = []
    for label, doc in docs:
        if isinstance(doc, dict) and doc.get("kind") not in (None, contract.KIND):
            print(f"{label}: skipped kind {doc.get('kind')}", file=sys.stderr)
            continue
        models.append((label, doc))
    return models


def _cluster_gangs() -> tuple[bool, frozenset[str] | None]:
    """What the cluster of the kubeconfig offers gangs: PodGroups served, and the gang labels a bound admission
    policy covers (None where the operator's user may not list policies)."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    from .kube import Cluster, error_message, load_api_client

    try:
        cluster = Cluster(load_api_client())
        served = cluster.serves(gang.POD_GROUP_API_VERSION, gang.POD_GROUP_KIND)
    except ConfigException as error:
        raise InputError(f"--cluster needs a kubeconfig (KUBECONFIG or ~/.kube/config): {error}") from None
    except (ApiException, HTTPError) as error:
        raise InputError(f"cannot reach the API server: {error}") from None
    try:
        covered = gangs.policy_covers(cluster.list_cluster(gangs.ADMISSION_API_VERSION, gangs.POLICY_KIND),
                                     cluster.list_cluster(gangs.ADMISSION_API_VERSION, gangs.BINDING_KIND))  # fmt: skip
    except ApiException as error:
        print(f"note: cannot list MutatingAdmissionPolicies: {error_message(error)}", file=sys.stderr)
        covered = None
    return served, covered


def cmd_validate(args: argparse.Namespace) -> int:
    status = 0
    looked_at = _cluster_gangs() if args.cluster else ()
    for label, doc in _only_models(_read_documents(args.filename)):
        try:
            dm = parse(doc)
        except SpecError as error:
            status = EXIT_INVALID
            print(f"{label}: invalid", file=sys.stderr)
            for problem in error.problems:
                print(f"  {problem}", file=sys.stderr)
            continue
        transfer = render(dm).plan
        print(f"{label}: valid ({transfer.mode} via {transfer.backend}: {transfer.reason})")
        print(f"  gangs: {gangs.outlook(dm, *looked_at)[1]}")
    return status


def _defaults(error: type[Exception]) -> RenderDefaults:
    """The operator's defaults from its environment (the chart's modelDefaults); a bad one is `error`."""
    try:
        return RenderDefaults.from_env()
    except DefaultsError as problem:
        raise error(str(problem)) from None


def cmd_render(args: argparse.Namespace) -> int:
    defaults = _defaults(InputError)
    objects: list[dict[str, Any]] = []
    for label, doc in _only_models(_read_documents(args.filename)):
        try:
            dm = parse(doc)
        except SpecError as error:
            print(f"{label}: invalid", file=sys.stderr)
            for problem in error.problems:
                print(f"  {problem}", file=sys.stderr)
            return EXIT_INVALID
        if args.namespace:
            dm = dm.model_copy(update={"metadata": dm.metadata.model_copy(update={"namespace": args.namespace})})
        objects += render(dm, defaults).objects
    sys.stdout.write(dump_all(objects))
    return 0


def _model_of(label: str, doc: Any, namespace: str | None = None) -> DisaggregatedModel:
    if isinstance(doc, dict) and "status" in doc:  # a live object (kubectl get -o yaml): of its status, only the
        # release its engines run is part of the change (a spec that names none keeps it: resolve.held_release)
        running = (doc.get("status") or {}).get("vllmVersion")
        kept = {"status": {"vllmVersion": running}} if running in contract.VLLM_VERSIONS else {}  # one this operator knows
        doc = {k: v for k, v in doc.items() if k != "status"} | kept
    try:
        dm = parse(doc)
    except SpecError as error:
        raise InputError(f"{label} is invalid:\n" + "\n".join(f"  {p}" for p in error.problems)) from None
    if namespace:
        dm = dm.model_copy(update={"metadata": dm.metadata.model_copy(update={"namespace": namespace})})
    return dm


def _one_model(source: str, namespace: str | None) -> DisaggregatedModel:
    models = _only_models(_read_documents(source))
    if len(models) != 1:
        raise InputError(f"{source} holds {len(models)} DisaggregatedModels: plan takes one")
    return _model_of(*models[0], namespace)


def _live_model(new: DisaggregatedModel, defaults: RenderDefaults) -> DisaggregatedModel | None:
    """The model as the cluster of the kubeconfig has it, or None if it does not exist yet."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    from .kube import Cluster, error_message, load_api_client

    where = f"{new.metadata.namespace}/{new.metadata.name}"
    ref = {"apiVersion": new.api_version, "kind": new.kind,
           "metadata": {"name": new.metadata.name, "namespace": new.metadata.namespace}}  # fmt: skip
    try:
        live = Cluster(load_api_client()).get(ref)
    except ConfigException as error:
        raise InputError(f"--from-cluster needs a kubeconfig (KUBECONFIG or ~/.kube/config): {error}") from None
    except ApiException as error:
        raise InputError(f"cannot read DisaggregatedModel {where}: {error_message(error)}") from None
    except HTTPError as error:
        raise InputError(f"cannot reach the API server to read {where}: {error}") from None
    if live is None:
        print(f"{where} does not exist in the cluster: planning a first create", file=sys.stderr)
        return None
    current = _model_of(f"the live DisaggregatedModel {where}", live)
    running, rendered = (live.get("status") or {}).get("revision"), render(current, defaults, live.get("status")).revision
    if running and running != rendered:
        print(f"note: {where} runs revision {running}, but its spec renders {rendered} here: the operator's default "
              "images differ from this shell's (DISAGG_ENGINE_IMAGE, DISAGG_ENGINE_IMAGES, DISAGG_NEURON_ENGINE_IMAGE)", file=sys.stderr)  # fmt: skip
    return current


def cmd_plan(args: argparse.Namespace) -> int:
    defaults = _defaults(InputError)
    new = _one_model(args.filename, args.namespace)
    current = _one_model(args.current, args.namespace) if args.current else _live_model(new, defaults) if args.from_cluster else None
    try:
        planned = change_plan(current, new, defaults)
    except PlanError as error:
        raise InputError(str(error)) from None
    if args.from_cluster:
        planned = dataclasses.replace(planned, gangs=gangs.outlook(new, *_cluster_gangs())[1])
    sys.stdout.write(planned.to_json() if args.output == "json" else planned.to_text())
    return 0


def cmd_rbac(_: argparse.Namespace) -> int:
    sys.stdout.write(dump_all([cluster_role()]))
    return 0


def cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(render_crd_yaml())
    return 0


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _serve_metrics(args: argparse.Namespace) -> OperatorMetrics:
    from .metrics import OperatorMetrics  # only `run` needs prometheus_client

    metrics = OperatorMetrics(workers=args.workers)
    if not args.metrics_port:
        return metrics
    try:
        metrics.serve(args.metrics_port, args.metrics_address)
    except OSError as error:
        where = _endpoint(args.metrics_address, args.metrics_port)
        change = ("choose another port with --metrics-port (0 turns /metrics off)" if error.errno == errno.EADDRINUSE
                  else "check --metrics-address and --metrics-port")  # fmt: skip
        raise StartError(f"cannot serve /metrics on {where}: {error.strerror or error}; {change}") from None
    return metrics


def _try_bind(host: str, port: int) -> None:
    """Bind as aiohttp will for kopf (SO_REUSEADDR, every address of the host), then let go."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)


def _check_liveness(url: str) -> None:
    """kopf binds --liveness only after its startup handlers ran, and a taken port then ends it with a
    traceback in its log: find out now, and say which flag to change."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        raise StartError(f"--liveness {url}: kopf serves only http:// URLs")
    try:
        host, port = parts.hostname or "localhost", parts.port or 80  # kopf's defaults
    except ValueError as error:
        raise StartError(f"--liveness {url}: {error}") from None
    try:
        _try_bind(host, port)
    except OSError as error:
        change = "choose another port in --liveness" if error.errno == errno.EADDRINUSE else "check --liveness"
        where = _endpoint(host, port)
        raise StartError(f"cannot serve the liveness endpoint on {where}: {error.strerror or error}; {change}") from None


def peer_identity(environ: Mapping[str, str], uid: int, hostname: str, pid: int) -> str | None:
    """The operator's identity among kopf peers, where kopf's own cannot be made (None: kopf's). kopf takes
    $POD_ID (the chart sets it to the pod's name), else ``<user>@<host>/...`` from getpass.getuser(), which
    raises in a container whose numeric user has no /etc/passwd entry (the image's 65532): then the uid
    stands in for the user name."""
    if "POD_ID" in environ:
        return None
    try:
        getpass.getuser()
    except (OSError, KeyError):  # Python 3.13: OSError; older: pwd's KeyError
        return f"uid{uid}@{hostname}/{pid}"
    return None


def cmd_run(args: argparse.Namespace) -> int:
    """Run the operator (kopf) against the cluster of the kubeconfig or the pod's service account."""
    # Ports first, before kopf and any cluster access: a taken port exits here at once, not as kopf's
    # startup activity retried every 60 s with liveness never up. /metrics stays bound from here on.
    defaults = _defaults(StartError)
    metrics = _serve_metrics(args)
    if args.liveness:
        _check_liveness(args.liveness)

    import kopf

    from . import handlers  # registers the handlers

    options = handlers.Options(
        workers=args.workers,
        resync_seconds=args.resync_seconds,
        metrics=metrics,
        defaults=defaults,
        peering=None if args.standalone else args.peering,
        priority=args.priority,
        clusterwide=not args.namespace,
    )
    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=args.standalone,
        clusterwide=not args.namespace,
        namespaces=args.namespace or [],
        liveness_endpoint=args.liveness,
        peering_name=None if args.standalone else args.peering,
        priority=args.priority,
        memo=handlers.OperatorMemo(options),
        identity=peer_identity(os.environ, os.getuid(), socket.gethostname(), os.getpid()),  # type: ignore[arg-type]  # kopf's Identity: a NewType of str
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg-operator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="report every problem of DisaggregatedModel manifests")
    validate.add_argument("-f", "--filename", required=True, help="YAML file, or - for stdin")
    validate.add_argument("--cluster", action="store_true",
                          help="also say whether the models' gangs will hold on the cluster of the kubeconfig")
    validate.set_defaults(func=cmd_validate)
    rend = sub.add_parser("render", help="print the manifests the operator would apply")
    rend.add_argument("-f", "--filename", required=True, help="YAML file, or - for stdin")
    rend.add_argument("-n", "--namespace", help="namespace to render into (default: the manifest's)")
    rend.set_defaults(func=cmd_render)
    plan = sub.add_parser("plan", help="what applying a manifest will do: new revision or not and why, the rollout "
                          "steps, the peak pods and accelerators per role")  # fmt: skip
    plan.add_argument("-f", "--filename", required=True, help="the new DisaggregatedModel (YAML file, or - for stdin)")
    against = plan.add_mutually_exclusive_group()
    against.add_argument("--current", help="the model as it is now (a file, e.g. from kubectl get -o yaml); "
                         "neither this nor --from-cluster: a first create")  # fmt: skip
    against.add_argument("--from-cluster", action="store_true",
                         help="read the model as it is now from the cluster of the kubeconfig (name and namespace from -f), "
                         "and say whether its gangs will hold there")
    plan.add_argument("-n", "--namespace", help="the model's namespace (default: the manifest's)")
    plan.add_argument("-o", "--output", choices=("text", "json"), default="text")
    plan.set_defaults(func=cmd_plan)
    run = sub.add_parser("run", help="run the operator")
    run.add_argument("-n", "--namespace", action="append", help="watch only this namespace (repeatable); default: all")
    run.add_argument("--standalone", action="store_true", help="no peering: the only replica (local runs, tests)")
    run.add_argument("--peering", default=contract.OPERATOR_NAME, help="kopf peering object for HA (default %(default)s)")
    run.add_argument("--priority", type=int, default=0, help="peering priority; the highest active replica works")
    run.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    run.add_argument("--metrics-port", type=int, default=8081, help="port of /metrics (Prometheus); 0 turns it off")
    run.add_argument("--metrics-address", default="0.0.0.0", help="address /metrics listens on")
    run.add_argument("--workers", type=int, default=4, help="models reconciled at once (default %(default)s)")
    run.add_argument("--resync-seconds", type=float, default=300.0,
                     help="every model is reconciled at least this often, events or not (default %(default)s)")
    run.add_argument("-v", "--verbose", action="store_true")
    run.set_defaults(func=cmd_run)
    rbac = sub.add_parser("rbac", help="print the ClusterRole the operator needs")
    rbac.set_defaults(func=cmd_rbac)
    crd = sub.add_parser("crd", help="print the CustomResourceDefinition")
    crd.set_defaults(func=cmd_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except StartError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
