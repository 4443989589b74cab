"""Pipeline parallelism: layer construction (and, to come, stages, schedules, driver)."""
