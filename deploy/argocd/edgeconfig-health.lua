-- Argo CD health check for EdgeConfig (iop.dev/v1alpha1): argocd-cm key
-- resource.customizations.health.iop.dev_EdgeConfig (deploy/argocd/README.md).
--
-- It reads the operator's status as kstatus does (Flux, Helm 4's --wait, kstatus-based CI), so
-- Argo CD and those tools agree on every status the operator writes:
--   Progressing  no status yet, or a generation the operator has not observed yet
--   Progressing  Reconciling=True: a new generation, a live apply, a rollout, waiting for the
--                Nodes, a failure it retries (Reconciling's message)
--   Degraded     Stalled=True: an invalid spec, a rollout past its progress deadline (Stalled's
--                message)
--   Healthy      Ready=True, written for the newest generation
--   Progressing  otherwise: Ready False or Unknown (Ready's message)
-- The operator never writes Reconciling and Stalled both True; were they, the first in the list
-- would win, as in kstatus. A health check from argocd-cm runs with the base, table and os
-- libraries only: no string or math functions here.

local hs = {}

local function verdict(status, message)
  hs.status = status
  hs.message = message
  return hs
end

-- A condition's message, else its reason, else `fallback`.
local function said(condition, fallback)
  if condition ~= nil and condition.message ~= nil and condition.message ~= "" then
    return condition.message
  end
  if condition ~= nil and condition.reason ~= nil and condition.reason ~= "" then
    return condition.reason
  end
  return fallback
end

local generation = obj.metadata.generation
if obj.metadata.deletionTimestamp ~= nil then
  return verdict("Progressing", "Pending deletion")
end
local status = obj.status
if status == nil or status.observedGeneration == nil then
  return verdict("Progressing", "Waiting for the operator to observe the EdgeConfig")
end
if generation ~= nil and status.observedGeneration ~= generation then
  return verdict("Progressing", "Waiting for the operator to observe generation "
    .. tostring(generation) .. " (the status is of generation "
    .. tostring(status.observedGeneration) .. ")")
end

local ready = nil
for _, condition in ipairs(status.conditions or {}) do
  if condition.type == "Reconciling" and condition.status == "True" then
    return verdict("Progressing", said(condition, "Reconciling"))
  end
  if condition.type == "Stalled" and condition.status == "True" then
    return verdict("Degraded", said(condition, "Stalled"))
  end
  if condition.type == "Ready" then
    ready = condition
  end
end

if ready ~= nil and ready.status == "True" then
  if generation == nil or ready.observedGeneration == generation then
    return verdict("Healthy", said(ready, "Ready"))
  end
  return verdict("Progressing", "Waiting for Ready of generation " .. tostring(generation)
    .. " (Ready=True is of generation " .. tostring(ready.observedGeneration) .. ")")
end
return verdict("Progressing", said(ready, "Waiting for the Ready condition"))
