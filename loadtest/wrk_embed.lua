-- wrk script for POST /v1/embed. Env: QS_NODES (ids per request), QS_NUM_NODES (id range),
-- QS_DELAY_MS (pause per connection between requests: paces the load below capacity).
local nodes = tonumber(os.getenv("QS_NODES") or "4")
local num_nodes = tonumber(os.getenv("QS_NUM_NODES") or "2708")
local delay_ms = tonumber(os.getenv("QS_DELAY_MS") or "0")

wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"

request = function()
  local ids = {}
  for i = 1, nodes do ids[i] = math.random(0, num_nodes - 1) end
  return wrk.format(nil, "/v1/embed", nil, '{"node_ids":[' .. table.concat(ids, ",") .. ']}')
end

delay = function()
  return delay_ms
end
