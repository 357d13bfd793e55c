#!/bin/bash
# The H200 runs of real vLLM 0.26.0 behind the router, with disagg-localrun, on the lent device machines.
# The machines have Python 3.12 and torch 2.11.0+cu130 but no network: hack/gpu/pack.sh packs vLLM 0.26.0,
# NIXL and what the harness imports into two archives, carried in .gpu/ (ignored by git) in two calls:
#
#   hack/gpu/run.sh unpack-a1        # call 1, carry .gpu/a1: unpack the compiled kernels into /tmp/site
#   hack/gpu/run.sh push             # call 2 (same machine, within its warm period), carry .gpu/a2:
#                                    #   unpack the rest, then issue 11's sweep: push through the router and
#                                    #   the direct-client baseline, prompts 1k/4k/16k x 1/4/8 per s, one GPU
#   hack/gpu/run.sh pull-1gpu        # call 3 (same machine): pull on one GPU, made fair by disagg-localrun's
#                                    #   UCX overrides for a shared GPU (READ zero-copy over cuda_ipc, as WRITE)
#   hack/gpu/run.sh issue12-push     # on nvidia-h200-x2 (after unpack-a1 there): prefill on GPU0, decode on
#                                    #   GPU1; push-concurrent and push-sequential through the router, direct
#                                    #   push for the TTFT split; prompts 1k/4k/16k x 1/2/4/8; kvbench push and
#                                    #   pull bandwidth on the same GPUs, in the same call
#   hack/gpu/run.sh issue12-pull     # then (same machine): pull through the router and direct, same cells;
#   disagg-localrun report --baseline router-pull OUT/issue12-*-results.json   # one table, ratios to pull
#   hack/gpu/run.sh unpack-a3        # (same machine) carry .gpu/a3: the peer router's wheel (pack.sh OUT a3)
#   hack/gpu/run.sh issue20-peers    # call after unpack-a1, unpack-a3 (same machine), carry .gpu/a2: our router
#                                    #   and vllm-router 0.1.17, push and pull, on the same engines, one GPU,
#                                    #   1k/4k/16k x 2/8 per s, with vLLM's KV-transfer metrics per cell
#                                    #   (SHAPE=qwen3-8b: the 8B shape, hack/gpu/qwen3-8b-h200.yaml)
#   hack/gpu/run.sh issue19-routing  # call after unpack-a1, unpack-a3 (same machine), carry .gpu/a2: issue 19's routing
#                                    #   comparison on one GPU shared by 2 prefill + 1 decode engines (prefix caching
#                                    #   on, push): our router with --prefill-policy least-outstanding and
#                                    #   prefix-and-load, vllm-router with cache_aware, on the same engines, the
#                                    #   multi-turn workload at two session rates, then the no-reuse workload at two
#                                    #   cell (fresh engines); vLLM's prefix-cache counters per engine and cell
#                                    #   (SHAPE=qwen3-8b: the 8B shape, hack/gpu/qwen3-8b-2p1d.yaml)
#   hack/gpu/run.sh issue18-dp2      # one GPU (after unpack-a1): prefill and decode each data parallel over two
#                                    #   "pods" (one process each, as LWS would start them, hack/gpu/qwen3-0.6b-dp2.yaml),
#                                    #   push through the router; per-rank requests and NIXL handshakes (dp.json/.md);
#                                    #   the spec needs parallelism.expert to be admitted, and vLLM 0.26.0 refuses
#                                    #   --enable-expert-parallel on this dense model at startup (with or without
#                                    #   hack/gpu/vllm_dense_xlb.py, VLLM_PATCH=0 for plain vLLM): it serves only in
#                                    #   REHEARSAL=1 (bench/results/h200-issue18-dp.md)
#   hack/gpu/run.sh issue31-cpu-tier # one GPU (after unpack-a1), carry .gpu/a2: a prefill with a CPU tier (MultiConnector
#                                    #   of NIXL push + OffloadingConnector, hack/gpu/qwen3-0.6b-cpu-tier.yaml) and a small
#                                    #   GPU KV, one decode; the multi-turn workload through the router; then the same on
#                                    #   the same file without the tier; vLLM's own counters per cell and whole /metrics pages
#
# Results go to $OUT (results.json, results.md, logs.tar.xz; kvbench.json for issue12), also when the sweep
# runs out of time (each cell is saved as it completes). REHEARSAL=1 runs the same command lines on a CPU
# machine with the simulator in place of vLLM (bench/disagg_bench/vllm_sim/as_vllm.py) and a short sweep.
set -u
stage=${1:?usage: hack/gpu/run.sh unpack-a1|unpack-a3|push|pull-1gpu|issue20-1gpu|issue20-peers|issue19-routing|issue30-migration|issue31-cpu-tier|issue12-push|issue12-pull|issue18-dp2}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/gpu-out}
WORK=${WORK:-/tmp/gpu-work}
mkdir -p "$OUT" "$WORK"
log() { printf '[gpu %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ "${REHEARSAL:-0}" = 1 ]; then
  PY=${PY:-$REPO/.venv/bin/python}
  MODEL_PY=${MODEL_PY:-${DISAGG_CACHE:-$HOME/.cache/disagg-operator}/vllm-0.26.0-cpu/bin/python}  # has tokenizers
  VLLM="$PY -m disagg_bench.vllm_sim.as_vllm"
  # the simulated engines answer as the release the H200 runs (vllm-router learns concurrent push only from 0.33.0's)
  export DISAGG_SIM_PROFILE=fast DISAGG_SIM_VLLM_VERSION=0.26.0 PYTHONPATH=$REPO:$REPO/bench
  QUICK="--prompts 256,1024 --cell-seconds 2 --min-requests 4 --drain-timeout 10"
  BUDGET=${BUDGET:-300}
  PEER_SITE=$WORK/peer-site  # the peer's wheel and its dependencies, from the package index (this machine has one)
  PEER_ROUTER="env PYTHONPATH=$PEER_SITE $MODEL_PY -m vllm_router.launch_router"
else
  PY=python3
  MODEL_PY=python3
  VLLM="python3 -m vllm.entrypoints.cli.main"
  export PYTHONPATH=$SITE:$REPO/operator:$REPO/connector:$REPO/bench
  QUICK=""
  BUDGET=${BUDGET:-450}  # seconds for the sweep; the call's limit is 600 s, unpacking takes ~1 min
  PEER_ROUTER="python3 -m vllm_router.launch_router"  # unpacked into $SITE by unpack-a3; its imports are the pack's
fi
# vLLM 0.26.0's V2 sampler imports flashinfer unguarded (left out of the pack); no hub on the machine;
# NVLink multicast stays off on the multi-GPU kinds (it can take the host's GPUs down for others).
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN

# A harness killed hard leaves its engines (own sessions) holding the GPU: stop those of earlier calls,
# by the pids it recorded.
for pids in "$WORK"/*/logs/pids; do
  [ -f "$pids" ] || continue
  while read -r pid name; do kill -TERM -- "-$pid" 2>/dev/null && log "stopped leftover $name ($pid)"; done < "$pids"
  rm -f "$pids"
done

unpack() {  # unpack an archive once per machine
  local archive=$1 mark=$SITE/.unpacked-$(basename "$1")
  [ -e "$mark" ] && return 0
  [ -f "$archive" ] || { log "missing $archive: carry its folder"; exit 3; }
  mkdir -p "$SITE" && xz -T0 -dc "$archive" | tar xf - -C "$SITE" && touch "$mark" || { log "unpack of $archive failed"; exit 3; }
  log "unpacked $archive into $SITE ($(du -sh "$SITE" | cut -f1))"
}

unpack_peers() {  # the peer routers' wheels of .gpu/a3 (pack.sh OUT a3): plain wheels, unzipped into the site
  local whl
  if [ "${REHEARSAL:-0}" = 1 ]; then
    [ -e "$PEER_SITE/.installed" ] && return 0
    ls .gpu/a3/*.whl >/dev/null 2>&1 || { log "missing .gpu/a3/*.whl: run hack/gpu/pack.sh .gpu a3"; exit 3; }
    $MODEL_PY -m pip install -q --target "$PEER_SITE" .gpu/a3/*.whl && touch "$PEER_SITE/.installed" || exit 3
    return 0
  fi
  for whl in .gpu/a3/*.whl; do
    [ -e "$SITE/.unpacked-$(basename "$whl")" ] && continue
    [ -f "$whl" ] || { log "missing .gpu/a3/*.whl: carry .gpu/a3"; exit 3; }
    mkdir -p "$SITE" && python3 -m zipfile -e "$whl" "$SITE" && touch "$SITE/.unpacked-$(basename "$whl")" || exit 3
    log "unpacked $whl into $SITE"
  done
}

peers_ready() {  # the peer router's wheels, unpacked by an earlier call (unpack-a3) or now
  if [ "${REHEARSAL:-0}" = 1 ]; then unpack_peers; return; fi
  ls "$SITE"/.unpacked-vllm_router-* >/dev/null 2>&1 || unpack_peers
  $PY -c 'import vllm_router, vllm_router_rs; from importlib.metadata import version; print("vllm-router", version("vllm-router"))' || exit 3
}

prepare() {  # everything but the compiled kernels, the byte code, the model folder
  if [ "${REHEARSAL:-0}" != 1 ]; then
    unpack .gpu/a2/rest.tar.xz
    unpack .gpu/a2/fa3.tar.xz
    [ -e "$SITE/vllm/_C_stable_libtorch.abi3.so" ] || { log "the kernels of a1 are not in $SITE: run unpack-a1 on this machine first"; exit 3; }
    [ -e "$SITE/.compiled" ] || { $PY -m compileall -q -j 16 "$SITE/vllm" >/dev/null 2>&1; touch "$SITE/.compiled"; log "byte-compiled vLLM"; }
    $PY -c 'import vllm, nixl, torch; print("vllm", vllm.__version__, "torch", torch.__version__, "gpus", torch.cuda.device_count())' || exit 3
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  fi
  $MODEL_PY hack/gpu/make_model.py "$WORK/model" "${SHAPE:-qwen3-0.6b}" || exit 3
}

# One sweep with disagg-localrun; $1 = results folder name, the rest = its options.
# One disagg_bench.localrun command (bench, migrate) on the model within a budget (seconds); its <results>.json/.md
# and its logs into $OUT, named after the run.
localrun() {
  local cmd=$1 name=$2 budget=$3 results=$4; shift 4
  log "$cmd $name: $*"
  timeout -s INT -k 40 "$budget" $PY -m disagg_bench.localrun "$cmd" -f "${MODEL_YAML:-hack/gpu/qwen3-0.6b-h200.yaml}" \
    --vllm "$VLLM" --model-path "$WORK/model" --load-format dummy --enforce-eager \
    --env VLLM_USE_FLASHINFER_SAMPLER=0 --env HF_HUB_OFFLINE=1 --env TRANSFORMERS_OFFLINE=1 \
    --out "$WORK/$name" --startup-timeout 300 "$@"
  log "$cmd $name exited with $?"
  for f in "$results.json" "$results.md"; do [ -f "$WORK/$name/$f" ] && cp "$WORK/$name/$f" "$OUT/$name-$f"; done
  tar cf - -C "$WORK/$name" logs 2>/dev/null | xz -T0 > "$OUT/$name-logs.tar.xz"
}

bench() {
  local name=$1; shift
  localrun bench "$name" "$BUDGET" results "$@" $QUICK
}

ONE_GPU="--gpus 0 --colocate --kv-cache-memory-bytes 30064771072 --gpu-memory-utilization 0.35"
case "$stage" in
  unpack-a1)
    unpack .gpu/a1/a1.tar.xz
    ;;
  unpack-a3)
    unpack_peers
    ;;
  push)
    prepare
    bench push $ONE_GPU --modes router-push,direct-push --prompts 1024,4096,16384 --rates 1,4,8 \
      --cell-seconds 10 --min-requests 12 --drain-timeout 30
    ;;
  pull-1gpu)
    prepare
    bench pull-1gpu $ONE_GPU --modes router-pull,direct-pull --prompts 1024,4096,16384 --rates 1 \
      --cell-seconds 8 --min-requests 8 --drain-timeout 30
    ;;
  issue20-1gpu)
    # Issue 20's one-GPU comparison, one repetition per call (REP=1, 2, 3: run it three times, then
    # `disagg-localrun report` the three results.json): push concurrent and sequential and pull, through the
    # router and direct, pull made fair by localrun's shared-GPU UCX settings.
    prepare
    bench "issue20-1gpu-r${REP:-1}" $ONE_GPU \
      --modes router-push,router-push-sequential,router-pull,direct-push,direct-pull \
      --prompts 1024,4096,16384 --rates 2,8 --cell-seconds 5 --min-requests 8 --drain-timeout 20
    ;;
  issue20-peers)
    # Issue 20 item 5: vllm-router 0.1.17 (vllm-project/router) as a peer of our router on the same real engines,
    # push and pull, in one run; every cell with vLLM's own KV-transfer counters (bench.py). vllm-router turns a
    # prefill URL to concurrent push only after an answer with transfer_mode "push" (vLLM 0.33.0 sends it, 0.26.0
    # does not): its counters at the end of the group (results.md) say which path it took.
    prepare
    peers_ready
    if [ "${SHAPE:-qwen3-0.6b}" = qwen3-8b ]; then MODEL_YAML=hack/gpu/qwen3-8b-h200.yaml; fi
    MODEL_YAML=${MODEL_YAML:-hack/gpu/qwen3-0.6b-h200.yaml} \
      bench "issue20-peers${SHAPE:+-${SHAPE#qwen3-}}${REP:+-r$REP}" $ONE_GPU --peer-router-command "$PEER_ROUTER" \
      --modes "${MODES:-router-push,vllmrouter-push,router-pull,vllmrouter-pull}" --prompts "${PROMPTS:-1024,4096,16384}" \
      --rates "${RATES:-2,8}" --cell-seconds 5 --min-requests 8 --drain-timeout 20
    ;;
  issue19-routing)
    # Issue 19: KV-aware routing on real engines. Three routers that differ only in the prefill policy on the same
    # engines (2 prefill + 1 decode sharing the GPU, prefix caching on, push), in one run: ours with least-outstanding
    # (the baseline: today's pick) and with prefix-and-load, and vllm-router with cache_aware (its prefix tree; decode
    # round robin). Multi-turn conversations (a shared 2048-token system prompt, 4 turns of 256 user tokens and
    # 64-token answers resent as history, 1 s mean think time); every cell records each engine's
    # vllm:prefix_cache_{hits,queries}_total and vllm:request_success_total before and after (the hit ratio and
    # the prefill engines' shares). Session rates, from bench/results/h200-issue20-peers.md: one shared GPU
    # prefills 16k x 2/s (33k tokens/s) at 0.27 s (0.6B) but not 16k x 8/s (131k/s, TTFT 2.4 s); the 8B does
    # 4k x 2/s (8k/s, 0.37 s) but not 16k x 2/s (33k/s, 2.2 s). A turn averages 2784 prompt tokens; at the
    # least-outstanding baseline's hit ratio (~0.65) about 1000 of them are computed. 0.6B at 4 and 8 sessions/s
    # (16 and 32 turns/s): 16k and 32k computed tokens/s, busy but below the 33k/s seen unsaturated; 8B at 1 and 2
    # sessions/s (4 and 8 turns/s): 4k and 8k tokens/s, at and below the 8k/s seen unsaturated.
    # Then the no-reuse workload (random 2048-token prompts, nothing to reuse) at two cells on fresh engines, both
    # of our policies, at the lower session rate's turns per second and 3/4 of it (12 and 16/s 0.6B, 3 and 4/s 8B;
    # two cells so that each policy runs first once, bench.cell_order): prefix-and-load must cost nothing where
    # there is nothing to gain.
    # KV per engine: 24 GiB (0.6B: 219k tokens; the decode holds ~50 streams of ~2.8k at 8 sessions/s), 16 GiB (8B).
    prepare
    peers_ready
    if [ "${SHAPE:-qwen3-0.6b}" = qwen3-8b ]; then
      MODEL19=hack/gpu/qwen3-8b-2p1d.yaml RATES19=${RATES:-1,2} NOREUSE19=3,4 ENGINES19="--kv-cache-memory-bytes 17179869184 --gpu-memory-utilization 0.27"
    else
      MODEL19=hack/gpu/qwen3-0.6b-2p1d.yaml RATES19=${RATES:-4,8} NOREUSE19=12,16 ENGINES19="--kv-cache-memory-bytes 25769803776 --gpu-memory-utilization 0.22"
    fi
    name19="issue19-routing${SHAPE:+-${SHAPE#qwen3-}}${REP:+-r$REP}"
    MODEL_YAML=$MODEL19 BUDGET=${BUDGET:-270} bench "$name19" --gpus 0 --colocate $ENGINES19 --peer-router-command "$PEER_ROUTER" \
      --workload multi-turn --modes "${MODES:-router-push:least-outstanding,router-push:prefix-and-load,vllmrouter-push:cache_aware}" \
      --system-tokens 2048 --turns 4 --user-tokens 256 --max-tokens 64 --think-time 1 --rates "$RATES19" \
      --cell-seconds 8 --min-requests 12 --drain-timeout 20
    # QUICK's --prompts would replace the cell's prompt length: rehearse it at the same 2048 tokens
    QUICK=${QUICK:+--cell-seconds 2 --min-requests 4 --drain-timeout 10} MODEL_YAML=$MODEL19 BUDGET=${BUDGET_NOREUSE:-150} \
      bench "$name19-noreuse" --gpus 0 --colocate $ENGINES19 \
      --modes "${NOREUSE_MODES:-router-push:least-outstanding,router-push:prefix-and-load}" --prompts 2048 --rates "$NOREUSE19" --max-tokens 64 \
      --cell-seconds 5 --min-requests 16 --drain-timeout 20
    ;;
  issue30-migration)
    # Issue 30: stream migration on real engines. One prefill and two decodes sharing the GPU (24 GiB of KV each),
    # push then pull, the router with its defaults (migration on); 16 greedy streams (every other one a chat),
    # 1024-token prompts, 160 tokens each; once every stream has 40 tokens the decode running the most is killed
    # (SIGKILL). Every stream is judged against an uninterrupted pass of the same requests on the same engines:
    # whole, exact (token ids and text), and for the migrated ones the gap against the inter-token time.
    # PROMPT_TOKENS=4096 STREAMS=32: longer prompts, more streams moving at once (the names say so).
    prepare
    for mode in ${MODES:-Push Pull}; do
      name30="issue30-migration-${mode,,}${PROMPT_TOKENS:+-$PROMPT_TOKENS}${STREAMS:+-x$STREAMS}"
      localrun migrate "$name30" "${BUDGET30:-240}" migration --transfer-mode "$mode" \
        --gpus 0 --colocate --kv-cache-memory-bytes 25769803776 --gpu-memory-utilization 0.22 \
        --streams "${STREAMS:-16}" --prompt-tokens "${PROMPT_TOKENS:-1024}" --chat
    done
    ;;
  issue31-cpu-tier)
    # Issue 31: a CPU tier on real engines. spec.prefill.kvCache.cpu renders --kv-transfer-config as a MultiConnector
    # of the NIXL push connector and vLLM's OffloadingConnector (8 GiB of host memory). The prefill's GPU KV is cut to
    # 128 blocks (16k tokens, --num-gpu-blocks-override in the model's prefill extraArgs) so that the multi-turn
    # workload (2048-token shared system prompt, 4 turns of 512 user tokens, 64-token answers resent as history, 2 s
    # mean think time) evicts a session's history between its turns: at 4 sessions/s ~16 turns/s insert ~80 blocks/s,
    # ~280 blocks in the ~3.5 s between a session's turns (think time, first token, 64 tokens at ~21 ms). Then the
    # same workload (same words: same mode name and seeds) on fresh engines from the same file without kvCache (the
    # baseline). Each cell records every engine's
    # vllm:prefix_cache_{hits,queries}_total, vllm:external_prefix_cache_hits_total (the connector's hits) and the
    # vllm:nixl_* series (bench.py); cpu_tier_report.py keeps every engine's whole /metrics page, first and last,
    # and compares the runs (issue31-cpu-tier-summary.{json,md}). If the tier's engines do not come up, the engine
    # logs' tails are printed and the baseline is not run.
    # CPU31=32Gi: another size of the tier (the names say so); REP=2: a repetition's names.
    prepare
    tier31=hack/gpu/qwen3-0.6b-cpu-tier.yaml base31=$WORK/qwen3-0.6b-cpu-tier-base.yaml sfx31="${CPU31:+-$CPU31}${REP:+-r$REP}"
    if [ -n "${CPU31:-}" ]; then
      tier31=$WORK/qwen3-0.6b-cpu-tier-$CPU31.yaml
      sed -e "s/^      cpu: 8Gi$/      cpu: $CPU31/" hack/gpu/qwen3-0.6b-cpu-tier.yaml > "$tier31"
      grep -q "^      cpu: $CPU31$" "$tier31" || { log "no cpu: $CPU31 in $tier31"; exit 3; }
    fi
    sed -e '/^    kvCache:$/,+1d' -e 's/^  name: qwen3-06b-cpu-tier$/  name: qwen3-06b-cpu-tier-base/' hack/gpu/qwen3-0.6b-cpu-tier.yaml > "$base31"
    grep -q "^ *kvCache:" "$base31" && { log "kvCache still in $base31"; exit 3; }
    ENGINES31="--gpus 0 --colocate --kv-cache-memory-bytes 25769803776 --gpu-memory-utilization 0.22"
    runs31=""
    for variant in tier base; do
      if [ $variant = tier ]; then yaml31=$tier31; name31=issue31-cpu-tier$sfx31; else yaml31=$base31; name31=issue31-cpu-tier-base$sfx31; fi
      rm -rf "${WORK:?}/$name31"; mkdir -p "$WORK/$name31"
      urls31=$($PY -m disagg_bench.localrun plan -f "$yaml31" $ENGINES31 --router-mode push | sed -n -E 's/^# (prefill|decode)-[0-9]+: .* http ([0-9]+),.*/http:\/\/127.0.0.1:\2/p')
      log "$variant: engines $urls31"
      $PY hack/gpu/cpu_tier_report.py watch "$WORK/$name31/metrics" $urls31 & watcher=$!
      QUICK=${QUICK:+--cell-seconds 4 --min-requests 4 --drain-timeout 10} MODEL_YAML=$yaml31 BUDGET=${BUDGET31:-230} \
        bench "$name31" $ENGINES31 --workload multi-turn --modes router-push --system-tokens 2048 --turns 4 \
        --user-tokens 512 --max-tokens 64 --think-time 2 --rates "${RATES:-4,8}" --cell-seconds "${CELL31:-24}" \
        --min-requests 12 --drain-timeout 20
      kill $watcher 2>/dev/null; wait $watcher 2>/dev/null
      tar cf - -C "$WORK/$name31" logs metrics 2>/dev/null | xz -T0 > "$OUT/$name31-logs.tar.xz"  # the pages with the logs
      runs31="$runs31 $variant=$WORK/$name31"
      if ! grep -q '"ttft"' "$WORK/$name31/results.json" 2>/dev/null; then
        log "$variant: no cell measured; the engine logs' ends:"
        for f in "$WORK/$name31"/logs/*; do
          [ -f "$f" ] || continue
          echo "== $f"; grep -n -E "Error|error|Traceback|raise|refus|Invalid|invalid" "$f" | tail -n 25; tail -n 15 "$f"
        done
        break
      fi
    done
    $PY hack/gpu/cpu_tier_report.py report "$OUT/issue31-cpu-tier$sfx31-summary.json" "$OUT/issue31-cpu-tier$sfx31-summary.md" $runs31
    log "cpu_tier_report exited with $?"
    ;;
  issue12-push)
    prepare
    BUDGET=${BUDGET12:-450}
    bench issue12-push --gpus 0,1 --kv-cache-memory-bytes 60129542144 \
      --modes router-push,router-push-sequential,direct-push --prompts 1024,4096,16384 --rates 1,2,4,8 \
      --cell-seconds 6 --min-requests 8 --drain-timeout 20
    if [ "${REHEARSAL:-0}" = 1 ]; then kv="--device cpu --tokens 256,1024"; else kv="--device cuda --tokens 1024,4096,16384"; fi
    # the KV shape of the model above: 28 layers x 8 KV heads x 128 dims, bf16, 128-token blocks
    timeout 100 $PY -m disagg_bench.kvbench $kv --model qwen3-32b --num-layers 28 --num-kv-heads 8 --head-dim 128 \
      --requests 8 --warmup 2 --rate 4 --json "$OUT/issue12-kvbench.json" | tail -30
    ;;
  issue12-pull)
    prepare
    bench issue12-pull --gpus 0,1 --kv-cache-memory-bytes 60129542144 \
      --modes router-pull,direct-pull --prompts 1024,4096,16384 --rates 1,2,4,8 \
      --cell-seconds 6 --min-requests 8 --drain-timeout 20
    ;;
  issue18-dp2)
    # Issue 18: engines that span pods. Both roles data parallel 2 over two one-GPU "pods" each (4 vLLM
    # processes on one GPU: 8 GiB of KV each), every pod started from the rendered LWS template through its
    # /bin/sh wrapper with LWS_WORKER_INDEX 0/1; push through the router, which pins each prefill rank on its pod.
    prepare
    rm -rf "${WORK:?}/issue18-dp2"
    # vLLM 0.26.0 needed one fault worked around for a dense model at one
    # rank per pod (VLLM_PATCH=0: plain vLLM, whose API servers then die; hack/gpu/vllm_dense_xlb.py says why).
    # Since admission asks for parallelism.expert, the dense 0.6B model is refused by vLLM before that point.
    if [ "${REHEARSAL:-0}" != 1 ] && [ "${VLLM_PATCH:-1}" = 1 ]; then VLLM="python3 hack/gpu/vllm_dense_xlb.py"; fi
    QUICK="" MODEL_YAML=hack/gpu/qwen3-0.6b-dp2.yaml BUDGET=${BUDGET18:-420} \
      bench issue18-dp2 --gpus 0 --colocate --kv-cache-memory-bytes 8589934592 --gpu-memory-utilization 0.2 \
      --modes router-push --prompts 1024 --rates 4 --cell-seconds 10 --min-requests 40 --drain-timeout 30
    $PY hack/gpu/dp_report.py "$WORK/issue18-dp2" "$OUT/issue18-dp2-dp.json" "$OUT/issue18-dp2-dp.md"
    log "dp_report exited with $?"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
ls -la "$OUT"
