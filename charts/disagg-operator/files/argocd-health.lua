-- Argo CD health check for disagg.dev/DisaggregatedModel, from the status the operator writes.
-- argocd-cm: resource.customizations.health.disagg.dev_DisaggregatedModel (docs/gitops.md).
-- Argo CD runs it without Lua's standard libraries (base and table only), so it uses neither string nor math.
--
-- First match wins:
--   Progressing  no status yet (or the CRD's default, observedGeneration 0), or status.observedGeneration
--                below metadata.generation (this spec not judged yet)
--   Degraded     Ready=False for a reason that needs a change to clear (an invalid spec, a refused child,
--                missing capacity, a crash loop, a failed fabric preflight, ...): every reason but the few
--                that clear by themselves, so a reason the operator learns later shows as Degraded, not
--                as a rollout that never ends
--   Progressing  Progressing=True (a rollout, pods coming up), or pods of an older revision still counted
--                (status.<role>.replicas above updatedReplicas: as Argo CD's own Deployment check, old pods
--                pending termination keep a rollout Progressing)
--   Degraded     Degraded=True (serving, but short of its size or with a failing pod), or KVTransferHealthy=False
--                (the routers see KV transfers fail, time out or mismatch protocols)
--   Suspended    Ready=True because a role is scaled to 0 as asked (nothing serves until it scales up)
--   Healthy      Ready=True, judged at metadata.generation
--   Progressing  otherwise

-- Ready=False reasons that clear without anyone changing anything (class "transient" in the operator's
-- vocabulary, operator/disagg_operator/api/vocabulary.py; a test keeps this table equal to it).
local passing = {
  WaitingForPods = true,  -- pods of the current revision are starting
  ApiUnavailable = true,  -- the API server did not answer the operator; it retries
  Conflict = true,        -- a write raced another writer; retried at once
  ApplyFailed = true,     -- another write failure, retried with backoff
}

local function conditions_by_type(status)
  local found = {}
  for _, c in ipairs(status.conditions or {}) do
    if c.type ~= nil then
      found[c.type] = c
    end
  end
  return found
end

local function older_pods(status)
  local n = 0
  for _, role in ipairs({"prefill", "decode"}) do
    local counts = status[role]
    if counts ~= nil and (counts.replicas or 0) > (counts.updatedReplicas or 0) then
      n = n + counts.replicas - (counts.updatedReplicas or 0)
    end
  end
  return n
end

local function say(c)
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason
end

local function verdict(o)
  local status = o.status
  local generation = o.metadata.generation
  if status == nil or status.observedGeneration == nil or status.observedGeneration == 0 then
    return "Progressing", "waiting for the operator to judge this spec"
  end
  if generation ~= nil and status.observedGeneration < generation then
    return "Progressing", "the operator has not judged generation " .. generation ..
      " yet (status is of generation " .. status.observedGeneration .. ")"
  end
  local c = conditions_by_type(status)
  local ready, progressing, degraded, transfers = c.Ready, c.Progressing, c.Degraded, c.KVTransferHealthy
  if ready ~= nil and ready.status == "False" and ready.reason ~= nil and not passing[ready.reason] then
    return "Degraded", say(ready)
  end
  if progressing ~= nil and progressing.status == "True" then
    return "Progressing", say(progressing)
  end
  local older = older_pods(status)
  if older > 0 then
    return "Progressing", older .. " pod(s) of an older revision still running"
  end
  if degraded ~= nil and degraded.status == "True" then
    return "Degraded", say(degraded)
  end
  if transfers ~= nil and transfers.status == "False" then
    return "Degraded", say(transfers)
  end
  if ready ~= nil and ready.status == "True" and
      (ready.observedGeneration == nil or generation == nil or ready.observedGeneration == generation) then
    if ready.reason == "ScaledToZero" then
      return "Suspended", say(ready)
    end
    return "Healthy", ready.message or ""
  end
  if ready ~= nil then
    return "Progressing", say(ready)
  end
  return "Progressing", "no Ready condition yet"
end

local hs = {}
hs.status, hs.message = verdict(obj)
return hs
