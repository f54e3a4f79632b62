"""bench/peers.py: argument checks, and one tiny tokenmill-only run through the subprocess path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import peer_workers, peers


def test_parse_args_defaults_and_unknown_system() -> None:
    args = peers.parse_args([])
    assert args.workload == "both" and args.systems == peers.SYSTEMS and args.max_tokens == 64
    assert peers.parse_args(["--systems", "tokenmill, ct2-int8"]).systems == ["tokenmill", "ct2-int8"]
    with pytest.raises(SystemExit):
        peers.parse_args(["--systems", "vllm"])


@pytest.mark.slow
def test_tokenmill_subprocess_run_writes_positive_throughput(tmp_path: Path, gguf_path: str) -> None:
    out = tmp_path / "peers.json"
    peers.main(["--workload", "w1", "--systems", "tokenmill", "--num-prompts", "2", "--max-tokens", "4",
                "--model", gguf_path, "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok", row
    assert row["requests"] == 2 and row["output_tokens"] == 8
    assert row["tok_s"] > 0 and row["load_s"] > 0
    assert len(row["check_ids"]) == 2 and all(len(ids) == peer_workers.CHECK_TOKENS for ids in row["check_ids"])
