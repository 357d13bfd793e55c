#!/bin/bash
# Packs vLLM 0.26.0 + NIXL 1.5.1 + vLLM's small dependencies + what the harness (disagg-localrun) imports
# beyond the machine's own packages, for an H200 machine that already has Python 3.12 and torch
# 2.11.0+cu130 (and no network), as xz archives in two folders of under 64 MiB each (one device call carries
# at most 64 MiB with the working tree, ~3 MB):
#   OUT/a1/a1.tar.xz    vllm/_C_stable_libtorch.abi3.so                                          (~56 MB)
#   OUT/a2/rest.tar.xz  everything else of the site dir                                          (~49 MB)
#   OUT/a2/fa3.tar.xz   vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so                                  (~8 MB)
#   OUT/a3/*.whl        the peer routers of peers.txt, as their wheels (vllm-router 0.1.17: 23.7 MB; its own
#                       imports are the machine's or the pack's, tests/unit/repo/test_gpu_pack.py checks it)
# On the GPU machine: extract both into one folder (hack/gpu/run.sh does), export PYTHONPATH=that folder
# and VLLM_USE_FLASHINFER_SAMPLER=0 (flashinfer is left out; vLLM 0.26.0's sampler imports it unguarded).
# Dropped to fit: FA2 kernels (Hopper uses FA3), _moe_C (MoE models only), vllm-rs, fmha_sm100 (Blackwell),
# deep_gemm headers, nixl_ep, UCX perftest libs. wheels.txt beside this file lists every vLLM wheel and its size.
# Usage: hack/gpu/pack.sh [OUT] [all|a3]   (default ./.gpu, all; put OUT in .git/info/exclude). About 10 min of
# xz on 2 cores; `a3` only downloads the peers' wheels (seconds).
set -eu
PY=${PY:-python3}
OUT=$(mkdir -p "${1:-.gpu}" && cd "${1:-.gpu}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
W=${W:-/tmp/vllm-pack}; SITE=$W/site
mkdir -p $W/whl
# pip matches manylinux tags exactly: every tag a wheel of wheels.txt carries is listed.
TAGS="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  --platform any"
dl() { $PY -m pip download -q --no-deps $TAGS -d $W/whl "$@"; }
# The peers (a3): their wheels as they are (a zip already; unzipped into the site on the machine)
mkdir -p $OUT/a3
$PY -m pip download -q --no-deps $TAGS -d $OUT/a3 $(grep -v '^#' $HERE/peers.txt | awk 'NF {print $1}' | sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/')
ls -la $OUT/a3
[ "${2:-all}" = a3 ] && exit 0
dl vllm==0.26.0
grep -v -E "^(vllm-|TOTAL)" $HERE/wheels.txt | awk '{print $1}' | sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/' > $W/reqs.txt
# The harness renders with disagg_operator (kubernetes' quantity parser, cel-python for admission rules) and
# runs the router (orjson): the project's pins (pyproject.toml, connector/pyproject.toml) and their frozen
# closure, minus what the machine (machine-packages.txt) or wheels.txt has. tests/unit/repo/test_gpu_pack.py
# fails when an import of the harness or the router is in none of them.
cat >> $W/reqs.txt <<'PINS'
orjson==3.13.0
kubernetes==37.0.2
cel-python==0.5.0
aiohttp-retry==2.9.1
durationpy==0.11
google-re2==1.1.20251105
oauthlib==4.0.1
pendulum==3.3.0
requests-oauthlib==2.0.0
tzdata==2026.6
websocket-client==1.9.2
PINS
dl -r $W/reqs.txt
rm -rf $SITE && mkdir -p $SITE
$PY -m pip install -q --no-index --no-deps --no-compile $TAGS --target $SITE $(ls $W/whl/*.whl | grep -v /whl/vllm-)
(cd $SITE && unzip -q -o $W/whl/vllm-0.26.0-*.whl)
cd $SITE
rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so \
  vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm/include nixl_ep nixl_ep_cu13 bin \
  nixl_cu13.libs/ucx/libucx_perftest_*
rm -f vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
find . -name "*.la" -delete
mkdir -p $OUT/a1 $OUT/a2
tar cf - vllm/_C_stable_libtorch.abi3.so | xz -9 -T2 > $OUT/a1/a1.tar.xz
tar cf - vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so | xz -9 -T2 > $OUT/a2/fa3.tar.xz
tar cf - --exclude=./vllm/_C_stable_libtorch.abi3.so --exclude=./vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so . \
  | xz -9 -T2 > $OUT/a2/rest.tar.xz
ls -la $OUT/a1 $OUT/a2
