"""Pod preflight: is the fabric this vLLM pod was scheduled for really there?

Runs as an init container before vLLM (the operator renders exactly this command line)::

    disagg-preflight --backend {UCX,LIBFABRIC} --efa-devices N --accelerator {nvidia,neuron,none}
                     --accelerator-count N --hugepages-2mi-bytes N --shm-min-bytes N
                     [--termination-log PATH]

On the first failed check it exits 1 and writes ONE line ``<Reason>: <what to change>`` to the
termination log (Kubernetes shows it as the container's termination message) and to stderr. The
operator maps the reason to the fabric condition with :func:`parse_termination_message`. On success
it prints ``preflight ok: ...`` and exits 0.

Device and sysfs paths are read under ``$DISAGG_PREFLIGHT_ROOT`` (default ``/``) so tests can point
them at a fake tree.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Sequence

from disagg_connector import contract
from disagg_connector.contract.preflight import REASONS, PreflightReason, format_termination_message

ROOT_ENV = "DISAGG_PREFLIGHT_ROOT"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
HUGEPAGE_2MI = 2 * 1024 * 1024


class PreflightFailure(Exception):
    def __init__(self, reason: PreflightReason, message: str) -> None:
        assert reason in REASONS, reason
        self.reason = reason
        self.message = " ".join(message.split())  # one line, always
        super().__init__(f"{reason}: {self.message}")


def _root() -> str:
    return os.environ.get(ROOT_ENV) or "/"


def _p(*parts: str) -> str:
    return os.path.join(_root(), *parts)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            s = f.read().strip()
    except OSError:
        return None
    if s == "max":
        return -1
    try:
        return int(s)
    except ValueError:
        return None


def _fmt_bytes(n: int) -> str:
    for unit, size in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n} bytes"


# --- checks ---------------------------------------------------------------------------------------
def check_nixl_import() -> str:
    try:
        import nixl._api  # noqa: F401
    except Exception as e:
        raise PreflightFailure(
            PreflightReason.NIXL_IMPORT_FAILED,
            f"python cannot import nixl ({type(e).__name__}: {e}); use the vLLM runtime image that ships nixl (pip install nixl) for this Python and CUDA version",
        ) from e
    try:
        from importlib.metadata import version

        return version("nixl")
    except Exception:
        return "?"


def check_backend(backend: str) -> None:
    from disagg_connector.nixl_agent import BackendUnavailable, NixlUnavailable, make_agent

    try:
        agent = make_agent(f"disagg-preflight-{os.getpid()}", backend)
        del agent
    except NixlUnavailable as e:
        raise PreflightFailure(PreflightReason.NIXL_IMPORT_FAILED, f"nixl cannot be loaded: {e}") from e
    except BackendUnavailable as e:
        hint = (
            "run on a node with EFA devices and libfabric's efa provider (FI_PROVIDER=efa), or set kvTransfer.backend to UCX"
            if backend == "LIBFABRIC"
            else "use an image whose nixl build has the UCX plugin, or set kvTransfer.backend to LIBFABRIC on EFA nodes"
        )
        raise PreflightFailure(PreflightReason.NIXL_BACKEND_UNAVAILABLE, f"NIXL could not instantiate the {backend} backend ({e.detail}); {hint}") from e


def efa_view() -> tuple[int, list[str]]:
    """(uverbs devices this container can open, RDMA devices sysfs lists with their drivers)."""
    uverbs = [p for p in glob.glob(_p("dev", "infiniband", "uverbs*")) if re.search(r"uverbs\d+$", p)]
    sysfs = []
    for dev in sorted(glob.glob(_p("sys", "class", "infiniband", "*"))):
        drv = os.path.join(dev, "device", "driver")
        driver = os.path.basename(os.path.realpath(drv)) if os.path.exists(drv) else "?"
        sysfs.append(f"{os.path.basename(dev)}({driver})")
    return len(uverbs), sysfs


def check_efa(n: int) -> str:
    if n <= 0:
        return "efa=off"
    have, sysfs = efa_view()
    if have < n:
        seen = f"; sysfs lists {', '.join(sysfs)}" if sysfs else "; sysfs lists no RDMA devices"
        raise PreflightFailure(
            PreflightReason.EFA_DEVICES_MISSING,
            f"{n} EFA devices requested but {have} /dev/infiniband/uverbs* devices are in the container{seen}; "
            f"request {contract.EFA_RESOURCE} on an EFA-enabled instance with the EFA device plugin running, or lower efa.count",
        )
    return f"efa={have}/{n}"


def check_accelerators(kind: str, n: int) -> str:
    if kind == "none" or n <= 0:
        return "accelerators=none"
    if kind not in contract.ACCELERATOR_RESOURCES:
        raise ValueError(kind)
    found = [p for p in glob.glob(_p("dev", f"{kind}*")) if re.search(rf"/{kind}\d+$", p)]
    resource = contract.ACCELERATOR_RESOURCES[kind]
    if len(found) < n:
        raise PreflightFailure(
            PreflightReason.ACCELERATORS_MISSING,
            f"{n} {kind} devices requested but {len(found)} are visible in /dev; request {n} {resource} with the device plugin running on the node, or lower accelerator.count",
        )
    return f"{kind}={len(found)}/{n}"


def check_hugepages(nbytes: int) -> str:
    if nbytes <= 0:
        return "hugepages=off"
    need_pages = -(-nbytes // HUGEPAGE_2MI)
    free = _read_int(_p("sys", "kernel", "mm", "hugepages", "hugepages-2048kB", "free_hugepages"))
    limit = None
    for path in (_p("sys", "fs", "cgroup", "hugetlb.2MB.max"), _p("sys", "fs", "cgroup", "hugetlb", "hugetlb.2MB.limit_in_bytes")):
        limit = _read_int(path)
        if limit is not None:
            break
    problems = []
    if free is None:
        problems.append("the kernel exposes no 2Mi hugepage pool")
    elif free < need_pages:
        problems.append(f"{free} free 2Mi hugepages on the node, {need_pages} needed")
    if limit is not None and limit != -1 and limit < nbytes:
        problems.append(f"the pod's hugetlb cgroup limit is {_fmt_bytes(limit)}")
    if problems:
        raise PreflightFailure(
            PreflightReason.HUGEPAGES_MISSING,
            f"{_fmt_bytes(nbytes)} of 2Mi hugepages requested but {'; '.join(problems)}; "
            f"request {contract.HUGEPAGES_RESOURCE} in the pod's resources and reserve them on the node (vm.nr_hugepages), or lower network.efa.hugepages",
        )
    return f"hugepages={_fmt_bytes(nbytes)}"


def check_shm(nbytes: int) -> str:
    if nbytes <= 0:
        return "shm=off"
    path = _p("dev", "shm")
    try:
        st = os.statvfs(path)
    except OSError as e:
        raise PreflightFailure(PreflightReason.SHARED_MEMORY_TOO_SMALL, f"cannot stat {path} ({e}); mount an emptyDir with medium Memory at /dev/shm") from e
    size = st.f_frsize * st.f_blocks
    if size < nbytes:
        raise PreflightFailure(
            PreflightReason.SHARED_MEMORY_TOO_SMALL,
            f"/dev/shm is {_fmt_bytes(size)}, {_fmt_bytes(nbytes)} required; mount an emptyDir with medium Memory and sizeLimit >= {_fmt_bytes(nbytes)} at /dev/shm, or raise network.efa.sharedMemory",
        )
    return f"shm={_fmt_bytes(size)}"


def run_checks(args: argparse.Namespace) -> str:
    """All checks in order; the first failure raises PreflightFailure. Returns the ok summary."""
    parts = [f"nixl={check_nixl_import()}"]
    # devices before the backend: a LIBFABRIC failure on a node without EFA is reported as
    # missing EFA devices when devices were requested.
    parts.append(check_efa(args.efa_devices))
    check_backend(args.backend)
    parts.insert(1, f"backend={args.backend}")
    parts.append(check_accelerators(args.accelerator, args.accelerator_count))
    parts.append(check_hugepages(args.hugepages_2mi_bytes))
    parts.append(check_shm(args.shm_min_bytes))
    return " ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="disagg-preflight", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("UCX", "LIBFABRIC"), required=True)
    ap.add_argument("--efa-devices", type=int, default=0)
    ap.add_argument("--accelerator", choices=("nvidia", "neuron", "none"), default="none")
    ap.add_argument("--accelerator-count", type=int, default=0)
    ap.add_argument("--hugepages-2mi-bytes", type=int, default=0)
    ap.add_argument("--shm-min-bytes", type=int, default=0)
    ap.add_argument("--termination-log", default=DEFAULT_TERMINATION_LOG)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # keep stdout/stderr to our one line (NIXL logs INFO to stdout and native errors to stderr);
    # set NIXL_LOG_LEVEL yourself to see them
    os.environ.setdefault("NIXL_LOG_LEVEL", "FATAL")
    try:
        summary = run_checks(args)
    except PreflightFailure as f:
        line = format_termination_message(f.reason, f.message)
        try:
            with open(args.termination_log, "w") as fh:
                fh.write(line + "\n")
        except OSError:
            pass
        print(line, file=sys.stderr, flush=True)
        return 1
    print(f"preflight ok: {summary}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
