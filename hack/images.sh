#!/usr/bin/env bash
# Build the images/ Dockerfiles with BuildKit (buildkitd + buildctl, built from their Go module by
# `hack/cluster.sh build`), without Docker and without pushing anywhere: each image becomes an OCI
# image layout tarball, the Dockerfiles unchanged.
#
#   hack/images.sh [--base registry|local] [--out DIR] [IMAGE...]     IMAGE: operator, router (default both),
#                     engine-sim (tests only: hack/node/engine-sim/Dockerfile, the engine image's stand-in on the
#                     real node, never published)
#
#   --base registry   (default) the bases the Dockerfiles name (python:3.12.12-slim-trixie, and the
#                     `# syntax=docker/dockerfile:1.12` frontend), pulled from Docker Hub: release images.
#   --base local      no registry needed: a Debian trixie minbase with Debian's python3, made with
#                     mmdebstrap from Debian's packages and given to the build as the named context
#                     `python:3.12.12-slim-trixie` (BuildKit's --opt context:...). It is NOT that image:
#                     Python 3.13 at /usr/bin, and it trusts this machine's CA bundle (so pip works
#                     behind a TLS-intercepting proxy). For tests (tests/integration/containers), never for publishing.
#   --out DIR         where <IMAGE>.tar goes (default $DISAGG_CACHE/images/out), named
#                     ghcr.io/disagg-dev/disagg-<IMAGE>:$VERSION inside.
#
# Environment: DISAGG_CACHE (default ~/.cache/disagg-operator): BuildKit's state and build cache
# ($DISAGG_CACHE/buildkit, so a second build of an unchanged image takes a second or two) and the local
# base ($DISAGG_CACHE/images). VERSION (default: pyproject.toml's) is the build-arg and the tag.
# Needs root (buildkitd's runc worker), runc; for --base local also mmdebstrap and umoci (hack/setup.sh
# installs all three with apt). One build at a time per DISAGG_CACHE (a lock); buildkitd runs only while
# this script does, and everything it mounted is unmounted when it ends.
set -euo pipefail
shopt -s inherit_errexit
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/hack/lib/common.sh"  # CACHE
log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

BASE=registry OUT="$CACHE/images/out"
IMAGES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE="${2:?--base needs registry or local}"; shift 2 ;;
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    operator|router|engine-sim) IMAGES+=("$1"); shift ;;
    *) die "unknown argument '$1': images are operator, router and engine-sim (the vLLM runtimes need their vendor bases: images/README.md)" ;;
  esac
done
[ ${#IMAGES[@]} -gt 0 ] || IMAGES=(operator router)
case "$BASE" in registry|local) ;; *) die "--base is registry or local, not '$BASE'" ;; esac
VERSION="${VERSION:-$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -1)}"
# The base every image/ Dockerfile of the operator and router starts from (tests/unit/repo/test_images.py pins it).
BASE_REF=python:3.12.12-slim-trixie

[ "$(id -u)" = 0 ] || die "buildkitd's runc worker needs root here (rootless BuildKit is not set up)"
BUILDKITD="$(bash "$ROOT/hack/cluster.sh" path buildkitd)"
BUILDCTL="$(bash "$ROOT/hack/cluster.sh" path buildctl)"
[ -x "$BUILDKITD" ] && [ -x "$BUILDCTL" ] || die "no BuildKit binaries: run hack/setup.sh (or hack/cluster.sh build)"
command -v runc >/dev/null || die "runc is not installed: run hack/setup.sh (apt-get install runc)"

mkdir -p "$CACHE/buildkit" "$CACHE/images" "$OUT"
exec 9>"$CACHE/buildkit.lock"
flock 9  # one buildkitd per state directory

# The local base: an OCI layout with one image tagged "base", passed to the build by digest (a tag is refused).
local_base() {
  local apt_pkgs=python3,python3-venv,python-is-python3,ca-certificates
  local key dir
  key="$(printf '%s\n' trixie "$apt_pkgs" | cat - /etc/ssl/certs/ca-certificates.crt | sha256sum | cut -c1-12)"
  dir="$CACHE/images/base-trixie-$key"
  if [ ! -f "$dir/index.json" ]; then
    command -v mmdebstrap >/dev/null && command -v umoci >/dev/null \
      || die "--base local needs mmdebstrap and umoci: run hack/setup.sh (apt-get install mmdebstrap umoci)"
    local tmp start=$SECONDS
    tmp="$(mktemp -d "$CACHE/images/.base.XXXXXX")"
    log "local base: Debian trixie minbase + $apt_pkgs (mmdebstrap) ..."
    # python-is-python3: the Dockerfiles run `python -m venv`. The machine's CA bundle replaces Debian's, so
    # that pip in the build reaches PyPI wherever this machine does.
    mmdebstrap --quiet --variant=minbase --include="$apt_pkgs" \
      --customize-hook='cp /etc/ssl/certs/ca-certificates.crt "$1/etc/ssl/certs/ca-certificates.crt"' \
      trixie "$tmp/rootfs.tar" http://deb.debian.org/debian >&2
    umoci init --layout "$tmp/oci" >&2
    umoci new --image "$tmp/oci:base" >&2
    umoci raw add-layer --image "$tmp/oci:base" "$tmp/rootfs.tar" >&2
    umoci config --image "$tmp/oci:base" --os linux --architecture amd64 --config.cmd python3 \
      --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --config.env LANG=C.UTF-8 >&2
    rm -rf "$dir"; mv "$tmp/oci" "$dir"; rm -rf "$tmp"
    log "local base: ready in $((SECONDS - start))s ($dir)"
  fi
  echo "$dir"
}

opts=()
if [ "$BASE" = local ]; then
  base_dir="$(local_base)"
  digest="$(python3 -c 'import json, sys
index = json.load(open(sys.argv[1]))
print(next(m["digest"] for m in index["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == "base"))' "$base_dir/index.json")"
  # cmdline: the builtin Dockerfile frontend follows `# syntax=` (an image pull) only when it is unset.
  opts=(--oci-layout "base=$base_dir" --opt "context:$BASE_REF=oci-layout://base@$digest" --opt cmdline=builtin)
fi

# buildkitd: the runc worker on the host network (pip in RUN steps), its state and cache under $CACHE/buildkit.
sock="unix://$CACHE/buildkit/buildkitd.sock"
"$BUILDKITD" --root "$CACHE/buildkit/root" --addr "$sock" --oci-worker=true --containerd-worker=false \
  --oci-worker-net=host >"$CACHE/buildkit/buildkitd.log" 2>&1 &
bk_pid=$!
stop_buildkitd() {
  kill "$bk_pid" 2>/dev/null && wait "$bk_pid" 2>/dev/null || true
  # what an interrupted build left mounted, then runc's empty cgroup v1 parents (busy ones stay)
  awk -v r="$CACHE/buildkit/root" '$2 ~ "^"r {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
  rmdir /sys/fs/cgroup/*/buildkit 2>/dev/null || true
}
trap stop_buildkitd EXIT
for _ in $(seq 100); do
  "$BUILDCTL" --addr "$sock" debug workers >/dev/null 2>&1 && break
  kill -0 "$bk_pid" 2>/dev/null || { tail -20 "$CACHE/buildkit/buildkitd.log" >&2; die "buildkitd exited"; }
  sleep 0.2
done

for img in "${IMAGES[@]}"; do
  start=$SECONDS
  name="ghcr.io/disagg-dev/disagg-$img:$VERSION"
  dir="images/$img"; [ "$img" = engine-sim ] && dir=hack/node/engine-sim
  log "building $name from $dir/Dockerfile (base: $BASE) ..."
  "$BUILDCTL" --addr "$sock" build --progress plain --frontend dockerfile.v0 \
    --local context="$ROOT" --local dockerfile="$ROOT/$dir" --opt filename=Dockerfile \
    --opt build-arg:VERSION="$VERSION" "${opts[@]}" \
    --output "type=oci,dest=$OUT/$img.tar.part,name=$name" >"$OUT/$img.build.log" 2>&1 \
    || { tail -40 "$OUT/$img.build.log" >&2; die "building $img failed (whole log: $OUT/$img.build.log)"; }
  mv "$OUT/$img.tar.part" "$OUT/$img.tar"
  log "built $name in $((SECONDS - start))s: $OUT/$img.tar"
done
