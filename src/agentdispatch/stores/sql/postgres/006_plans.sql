-- The acknowledgement's pruning of emptied fairness rows runs with generic
-- plans, as the fair claim does since 005: with "auto" the planner re-planned
-- its four statements (their arguments are arrays) at every call, which was
-- most of its cost (1.3 -> 0.5 ms a call on a small VM at light load, where
-- every acknowledgement empties its session's group). Its plans are index
-- probes either way.
ALTER FUNCTION dispatch_fair_prune(integer[], text[]) SET plan_cache_mode = force_generic_plan;
