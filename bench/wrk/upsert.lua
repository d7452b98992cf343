-- wrk script: random-key upserts of a 180-byte JSON document into collection `w`.
-- Durability from the environment: DURABILITY=none|persist (default none).
local durability = os.getenv("DURABILITY") or "none"
local body = '{"name":"user","email":"user@example.com","age":42,"city":"Lisbon","tags":["a","b","c"],"bio":"' .. string.rep("x", 70) .. '"}'

function setup(thread)
  thread:set("seed", math.random(1, 1000000000))
end

function init(args)
  math.randomseed(seed)
end

request = function()
  local key = "k" .. math.random(0, 999999)
  return wrk.format("PUT", "/v1/collections/w/docs/" .. key .. "?durability=" .. durability,
    {["Content-Type"] = "application/json"}, body)
end
