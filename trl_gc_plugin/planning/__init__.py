"""Memory planning: the activation estimate (`memory`), the planner, the plan check, sharding, throughput advice.
Imports `model` and `core`."""
