"""Jobs: specs, Dask orchestration and the `tokenmill` CLI. Wires pipeline/ (one shard) to a cluster.

NOTE: importing it changes nothing in the process; a job's process settings (OpenMP's wait policy) are set where a
job's process starts its work (jobs.process_env).
"""
