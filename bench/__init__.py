"""tokenmill's benchmarks: run each as a module from the repository root, `python -m bench.NAME --help`
(bench/README.md)."""
