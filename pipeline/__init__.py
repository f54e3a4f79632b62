"""One shard of Parquet rows through the engine: read, tokenize, generate, commit results and accounting.

Knows fsspec, Arrow and the engine; knows nothing of Dask.
"""
