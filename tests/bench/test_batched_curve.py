"""bench/batched_curve.py: llama-batched-bench's table parsed, and one tiny tokenmill-only curve through the
subprocess path (peers.run_system with this module's worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import batched_curve

# llama-batched-bench's output (llama.cpp in llama-cpp-python 0.3.36), as printed on this project's CPU.
OUTPUT = """
main: n_kv_max = 12288, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     64 |    1 |    192 |    0.569 |   224.89 |    0.532 |   120.35 |    1.101 |   174.42 |
|   128 |     64 |   64 |  12288 |   36.683 |   223.31 |   29.406 |   139.29 |   66.089 |   185.93 |

llama_perf_context_print:        load time =     112.61 ms
"""


def test_the_batched_bench_table_is_parsed() -> None:
    rows = batched_curve.parse_batched_bench(OUTPUT)
    assert [r["B"] for r in rows] == [1, 64]
    assert rows[1] == {"B": 64, "T_PP": 36.683, "S_PP": 223.31, "T_TG": 29.406, "S_TG": 139.29, "T": 66.089,
                       "S": 185.93}
    with pytest.raises(RuntimeError, match="no table"):
        batched_curve.parse_batched_bench("error: invalid argument: -npp")


@pytest.mark.slow
def test_a_tiny_curve_runs_our_engine_in_its_own_process(tmp_path: Path) -> None:
    out = tmp_path / "curve.json"
    results = batched_curve.main(["--systems", "tokenmill", "--npl", "1,2", "--npp", "16", "--ntg", "3",
                                  "--json", str(out)])
    res = results["tokenmill"]
    assert res["status"] == "ok", res
    assert [r["B"] for r in res["rows"]] == [1, 2]
    assert all(r["T_PP"] > 0 and r["T"] > 0 for r in res["rows"])  # each generate made B x max_tokens tokens (checked)
    assert json.loads(out.read_text())["results"]["tokenmill"]["rows"] == res["rows"]
