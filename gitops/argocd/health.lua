-- Argo CD health check for EffectMQ's Queue and Schedule (effectmq.io): the value
-- of both argocd-cm keys resource.customizations.health.effectmq.io_Queue and
-- ..._Schedule (gitops/argocd/argocd-cm.yaml holds them; docs/gitops.md).
--
-- It reads the status as kstatus (what Flux and cli-utils judge health with) does, in the same
-- order, so that both tools say the same (tests/k8s/test_argocd_health.py runs
-- both on the same objects):
--   status.observedGeneration behind metadata.generation  Progressing
--   the first Reconciling=True or Stalled=True             Progressing / Degraded
--   the first Ready condition                              True: Healthy, else Progressing
--   none of these                                          Healthy
-- with the condition's message, and adds what only Argo CD can say:
--   no status at all (the operator has not seen it yet)   Progressing
--   Healthy, but the Queue is paused (spec.paused) or the
--   Schedule suspended (spec.suspend)                      Suspended
--   Healthy, and the Queue's stalls cluster
--   (Stalling=True)                                        Healthy, the message Stalling's
--   Healthy, and the Queue's rate limit holds tasks back
--   (RateLimited=True)                                     Healthy, the message RateLimited's
--   Healthy, and tasks wait for their group's cap or
--   resume (GroupCapped=True)                              Healthy, the message GroupCapped's
-- (a stalling Queue still works, its attempts are retried: not Degraded; its message
-- says what to fix; a rate-limited or group-capped one works as asked, its message says
-- why tasks wait).
-- Argo CD opens no string library for argocd-cm scripts: base, table and os only.

local SUSPENDED_BY = {
  Queue = {field = "paused", message = "paused (spec.paused): workers take no new tasks"},
  Schedule = {field = "suspend", message = "suspended (spec.suspend): no ticks are materialized"},
}

-- Healthy, unless the spec stops the resource's work on purpose; a warning condition
-- (Stalling=True, else RateLimited=True, else GroupCapped=True) is told in the message.
local function settled(message)
  local suspended = SUSPENDED_BY[obj.kind]
  if suspended ~= nil and obj.spec ~= nil and obj.spec[suspended.field] == true then
    return {status = "Suspended", message = suspended.message}
  end
  local limited, capped = nil, nil
  for _, condition in ipairs(obj.status.conditions or {}) do
    if condition.type == "Stalling" and condition.status == "True" and condition.message ~= nil then
      return {status = "Healthy", message = "stalling: " .. condition.message}
    end
    if condition.type == "RateLimited" and condition.status == "True" and condition.message ~= nil then
      limited = condition
    end
    if condition.type == "GroupCapped" and condition.status == "True" and condition.message ~= nil then
      capped = condition
    end
  end
  if limited ~= nil then
    return {status = "Healthy", message = "rate limited: " .. limited.message}
  end
  if capped ~= nil then
    return {status = "Healthy", message = "group capped: " .. capped.message}
  end
  return {status = "Healthy", message = message}
end

local status = obj.status
if status == nil or (status.observedGeneration == nil and (status.conditions == nil or #status.conditions == 0)) then
  return {status = "Progressing", message = "waiting for the EffectMQ operator to report a status"}
end

local generation = obj.metadata.generation
if generation ~= nil and status.observedGeneration ~= nil and status.observedGeneration ~= generation then
  return {status = "Progressing", message = obj.kind .. " generation is " .. generation ..
    ", but latest observed generation is " .. status.observedGeneration}
end

local ready = nil
for _, condition in ipairs(status.conditions or {}) do
  if condition.type == "Reconciling" and condition.status == "True" then
    return {status = "Progressing", message = condition.message}
  end
  if condition.type == "Stalled" and condition.status == "True" then
    return {status = "Degraded", message = condition.message}
  end
  if ready == nil and condition.type == "Ready" and (condition.status == "True" or
      condition.status == "False" or condition.status == "Unknown") then
    ready = condition
  end
end

if ready == nil then
  return settled("no Ready, Reconciling or Stalled condition")
end
if ready.status == "True" then
  return settled(ready.message)
end
return {status = "Progressing", message = ready.message}
