"""Pipeline parallelism: layers, stages, per-stage shard plans, schedules and the driver."""
