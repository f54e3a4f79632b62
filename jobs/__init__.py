"""Jobs: specs, Dask orchestration and the `tokenmill` CLI. Wires pipeline/ (one shard) to a cluster.

The run itself (spec, runner, cluster, task, plugins, lease, control, summary, metrics) is here; the CLI is jobs.cli,
the checks and forecast before a job jobs.plan, the other formats and the report jobs.formats.

NOTE: importing it changes nothing in the process; a job's process settings (OpenMP's wait policy) are set where a
job's process starts its work (jobs.process_env).
"""
