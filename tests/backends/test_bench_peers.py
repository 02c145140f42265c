"""`kvlink bench --compare mooncake` end to end (real target and initiator
processes on loopback, data verified) and bench/report.py on its output.
NIXL lives in bench/.peers (make bench), so only Mooncake runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--buffer-mb", "64", "--iters", "2", "--warmup", "1", "--lat-iters", "5", "--mem-peers", "0"]


def test_bench_compare_mooncake_verified_and_reported(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvlink", "bench", *SMALL, "--workloads", "paged-32k,tiny-64b,lat-4k",
                        "--compare", "mooncake", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert {(x["workload"], x["system"]) for x in rows} == {
        (w, s) for w in ("paged-32k", "tiny-64b", "lat-4k") for s in ("kvlink", "mooncake")}
    assert all(x["verified"] is True and x["gbps_median"] > 0 for x in rows)
    assert [x["descriptors"] for x in rows if x["system"] == "mooncake" and x["workload"] == "paged-32k"] == [2048]

    src = tmp_path / "run.jsonl"
    src.write_text(r.stdout)
    out = tmp_path / "latest"
    rep = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), str(src), "--out", str(out),
                          "--no-chart", "--note", "test run"], capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0, rep.stderr
    md = (tmp_path / "latest.md").read_text()
    assert "| paged-32k | mooncake |" in md and "test run" in md
    k = next(x for x in rows if x["system"] == "kvlink" and x["workload"] == "paged-32k")
    m = next(x for x in rows if x["system"] == "mooncake" and x["workload"] == "paged-32k")
    assert f"{k['gbps_median'] / m['gbps_median']:.2f}x" in md
    saved = json.loads((tmp_path / "latest.json").read_text())
    assert saved["results"] == rows and saved["meta"]["note"] == "test run"


def test_report_refuses_input_without_records(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("not json\n")
    rep = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), str(src), "--out",
                          str(tmp_path / "x"), "--no-chart"], capture_output=True, text=True, timeout=60)
    assert rep.returncode != 0 and "no `kvlink bench --json` records" in rep.stderr
