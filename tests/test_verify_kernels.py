"""``tools/verify_kernels.py`` as a machine without CUDA runs it: a subprocess on CPU (the
Triton kernels through Triton's interpreter, which the script switches on itself) on the
reduced grid. Its JSON must follow the documented schema, cover every op in ``KERNELS`` in
every dtype, and every check must pass; skipped records must say why."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from vllm_diffusion.kernels.dispatch import KERNELS

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "verify_kernels.py"
DTYPES = ("fp32", "bf16", "fp16")
CHECKED = ("triton", "torch_path")
EXACT_OPS = ("select_retained", "compact_rows")
TOP_LEVEL_KEYS = {"schema_version", "created_utc", "device", "torch_version",
                  "triton_version", "python_version", "mode", "grid", "dtypes", "ops",
                  "timing_method", "reference_precision", "tolerances",
                  "interpreter_dtype_skips", "loaded_modules", "results", "summary"}
RECORD_KEYS = ["op", "grid_point", "params", "dtype", "implementation", "status",
               "max_abs_error", "mismatched_elements", "atol", "rtol", "time_ms", "detail"]
STATUSES = {"pass", "fail", "skipped", "timing_only"}

# Runs the script with the Triton path of compact_rows returning hidden + 1.
BROKEN_COMPACTION = """
import runpy, sys
from vllm_diffusion.kernels import dispatch
resolve, broken = dispatch.resolve, dispatch.KERNELS["compact_rows"].triton
def off_by_one(hidden, residual, keep_rows):
    got_hidden, got_residual = resolve(broken)(hidden, residual, keep_rows)
    return got_hidden + 1, got_residual
dispatch.resolve = lambda path: off_by_one if path == broken else resolve(path)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_script(out: pathlib.Path, *options: str, code: str | None = None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The script's directory holds its grids (a script run finds them; ``-c`` does not).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(SCRIPT.parent),
                                                      env.get("PYTHONPATH")]))
    launcher = [sys.executable] if code is None else [sys.executable, "-c", code]
    result = subprocess.run([*launcher, str(SCRIPT), "--device", "cpu", "--out", str(out),
                             *options], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    return result, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    result, results = run_script(tmp_path_factory.mktemp("verify") / "results.json",
                                 "--grid", "reduced", "--dtypes", ",".join(DTYPES),
                                 "--no-timing")
    assert results is not None, result.stderr[-3000:]
    return result, results


def test_every_check_passes_and_the_exit_status_says_so(verified):
    result, results = verified
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert results["summary"]["fail"] == 0 and results["summary"]["all_checks_passed"]
    assert not [r for r in results["results"] if r["status"] == "fail"]


def test_results_follow_the_schema(verified):
    _, results = verified
    assert set(results) == TOP_LEVEL_KEYS
    assert results["schema_version"] == 1
    assert results["mode"] == "interpreter" and results["device"]["type"] == "cpu"
    assert results["grid"] == "reduced" and results["dtypes"] == list(DTYPES)
    assert results["timing_method"] is None
    summary = results["summary"]
    assert summary["records"] == len(results["results"])
    assert sum(summary[s] for s in STATUSES) == summary["records"]
    for record in results["results"]:
        assert list(record) == RECORD_KEYS
        assert record["status"] in STATUSES and record["implementation"] in CHECKED
        assert record["time_ms"] is None
        if record["status"] == "pass":
            assert record["mismatched_elements"] == 0
            assert isinstance(record["max_abs_error"], (int, float))
            tolerance = results["tolerances"][record["op"]][record["dtype"]]
            assert (record["atol"], record["rtol"]) == (tolerance["atol"], tolerance["rtol"])
            if record["op"] in EXACT_OPS:
                assert record["atol"] == record["rtol"] == record["max_abs_error"] == 0


def test_every_op_is_covered_in_every_dtype(verified):
    _, results = verified
    assert results["ops"] == list(KERNELS)
    records = results["results"]
    for op in KERNELS:
        for dtype in DTYPES:
            for implementation in CHECKED:
                mine = [r for r in records if (r["op"], r["dtype"], r["implementation"])
                        == (op, dtype, implementation)]
                assert mine, (op, dtype, implementation)
                if implementation == "torch_path" or dtype == "fp32":
                    assert all(r["status"] == "pass" for r in mine), mine


def test_skipped_records_say_why(verified):
    _, results = verified
    interpreter_skips = results["interpreter_dtype_skips"]
    for record in results["results"]:
        if record["status"] == "skipped":
            assert record["detail"], record
            assert record["implementation"] == "triton"
            assert record["dtype"] in interpreter_skips
            assert record["detail"] == interpreter_skips[record["dtype"]]


def test_only_torch_triton_and_the_kernels_are_loaded(verified):
    _, results = verified
    loaded = results["loaded_modules"]
    assert not loaded["vllm_imported"]
    assert not {"vllm", "transformers"} & set(loaded["third_party"])
    kernel_modules = {f"vllm_diffusion.kernels.{p.stem}"
                      for p in (ROOT / "vllm_diffusion" / "kernels").glob("*.py")
                      if p.stem != "__init__"}
    assert kernel_modules <= set(loaded["vllm_diffusion"])


def test_timing_covers_every_implementation_and_sdpa(tmp_path):
    result, results = run_script(tmp_path / "timed.json", "--grid", "reduced", "--dtypes",
                                 "fp32", "--ops", "block_attention,compact_rows")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert results["timing_method"].startswith("time.perf_counter")
    records = results["results"]
    for op in ("block_attention", "compact_rows"):
        for implementation in (*CHECKED, "reference"):
            mine = [r for r in records if (r["op"], r["implementation"]) == (op, implementation)]
            assert mine and all(r["time_ms"] is not None and r["time_ms"] >= 0 for r in mine)
    dense = [r for r in records if r["implementation"] == "sdpa_dense"]
    assert dense and {r["op"] for r in dense} == {"block_attention"}
    for record in dense:
        assert record["detail"]
        if record["status"] == "timing_only":
            assert "scaled_dot_product_attention" in record["detail"]
            assert record["time_ms"] is not None
        else:
            assert record["status"] == "skipped" and record["time_ms"] is None


def test_a_wrong_kernel_fails_the_run(tmp_path):
    result, results = run_script(tmp_path / "broken.json", "--grid", "reduced", "--dtypes",
                                 "fp32", "--ops", "compact_rows", "--no-timing",
                                 code=BROKEN_COMPACTION)
    assert result.returncode == 1, result.stderr[-3000:]
    failed = [r for r in results["results"] if r["status"] == "fail"]
    assert failed and not results["summary"]["all_checks_passed"]
    assert {(r["op"], r["implementation"]) for r in failed} == {("compact_rows", "triton")}
    assert all(r["mismatched_elements"] > 0 and abs(r["max_abs_error"] - 1) < 1e-5
               for r in failed)


def test_an_unknown_op_is_refused(tmp_path):
    result, results = run_script(tmp_path / "unknown.json", "--ops", "no_such_op")
    assert result.returncode == 2 and results is None
    assert "no_such_op" in result.stderr
