"""Jobs: specs, Dask orchestration and the `tokenmill` CLI. Wires pipeline/ (one shard) to a cluster."""
