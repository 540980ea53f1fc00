"""Verify every kernel in ``vllm_diffusion.kernels.dispatch.KERNELS`` against its reference.

For each op, on a named grid of shapes and in each dtype, the Triton kernel and the
vectorised torch path are compared with the plain PyTorch reference (max abs error,
elements outside tolerance, pass/fail) and, unless ``--no-timing``, the three are timed,
plus ``scaled_dot_product_attention`` on equivalent dense shapes for the attention ops.
Needs only torch, Triton and ``vllm_diffusion.kernels`` (no vLLM, no install, no network):

    PYTHONPATH=. python tools/verify_kernels.py --out results.json          # CUDA: native
    PYTHONPATH=. python tools/verify_kernels.py --device cpu --grid reduced --no-timing \\
        --out results.json                                                 # interpreter

On CPU the Triton kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set
here before Triton is first imported). Exit status: 0 when every check passed, 1 when any
failed, 2 on bad arguments. ``docs/kernels.md`` describes the JSON.

Precision: for bf16/fp16 inputs the reference runs on the same (already rounded) inputs
upcast to fp32, so errors measure each implementation against fp32 math. The Triton
kernels accumulate in fp32; the torch paths compute attention in the input dtype, which
the bf16/fp16 tolerances allow for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import zlib

import torch
import torch.nn.functional as F
from kernel_grids import BUILDERS, CUDA_ONLY, GRIDS, REDUCED_GRID

SCHEMA_VERSION = 1
PACKAGE = "vllm_diffusion"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RECORD_KEYS = ("op", "grid_point", "params", "dtype", "implementation", "status",
               "max_abs_error", "mismatched_elements", "atol", "rtol", "time_ms", "detail")
# (atol, rtol): |got - want| <= atol + rtol * |want|. Attention outputs are O(1); the bf16
# and fp16 margins are about 2.5 and 2 times the dtype's machine epsilon.
ATTENTION_TOLERANCE = {"fp32": (1e-4, 1e-4), "bf16": (2e-2, 2e-2), "fp16": (2e-3, 2e-3)}
IMPORTANCE_TOLERANCE = (1e-4, 1e-5)  # fp32 output from fp32 math whatever the input dtype
EXACT = (0.0, 0.0)
TOLERANCES = {"block_attention": ATTENTION_TOLERANCE,
              "sparse_prefix_attention": ATTENTION_TOLERANCE,
              "candidate_importance": dict.fromkeys(DTYPES, IMPORTANCE_TOLERANCE),
              "select_retained": dict.fromkeys(DTYPES, EXACT),
              "compact_rows": dict.fromkeys(DTYPES, EXACT)}

# Grids: point name -> parameters (named by the op's field tuple). CUDA_ONLY points are
# serving-sized timing shapes, skipped when the kernels run through the interpreter.
def dense_attention(op, args):
    """SDPA arguments on the dense shapes equivalent to a paged attention call, and what
    they are: query [R, H, Q, D], key/value [R, H, K, D] with the same keys per head (KV
    heads repeated), boolean mask [R, H, Q, K]; no paged gather."""
    from vllm_diffusion.kernels.block_attention import gather_kv

    query, kv_cache, positions, starts, kv_lens, table, block, scale = args[:8]
    requests = [r for r in range(len(kv_lens)) if starts[r + 1] > starts[r]]
    if not requests:
        return None, "no query rows"
    heads, dim = query.shape[1:]
    kv_heads = kv_cache.shape[1]
    group = heads // kv_heads

    def key_positions(r, kv_head):  # [K_r] the positions request r's rows may attend to
        if op == "block_attention":
            return torch.arange(kv_lens[r], device=query.device)
        kept = args[8][r, kv_head]
        return torch.cat([kept[kept >= 0], torch.arange(args[9][r], kv_lens[r],
                                                        device=query.device)])

    max_rows = max(starts[r + 1] - starts[r] for r in requests)
    max_keys = max(len(key_positions(r, h)) for r in requests for h in range(kv_heads))
    q = query.new_zeros(len(requests), heads, max_rows, dim)
    k = q.new_zeros(len(requests), heads, max_keys, dim)
    v = torch.zeros_like(k)
    mask = torch.ones(len(requests), heads, max_rows, max_keys, dtype=torch.bool,
                      device=query.device)  # padding rows see everything (discarded)
    for i, r in enumerate(requests):
        rows = slice(starts[r], starts[r + 1])
        n = rows.stop - rows.start
        q[i, :, :n] = query[rows].transpose(0, 1)
        keys, values = gather_kv(kv_cache, table[r], kv_lens[r])  # [L, H_kv, D]
        row_block = positions[rows] // block  # [n]
        for h in range(heads):
            picked = key_positions(r, h // group)
            k[i, h, :len(picked)] = keys[picked, h // group]
            v[i, h, :len(picked)] = values[picked, h // group]
            mask[i, h, :n] = False
            mask[i, h, :n, :len(picked)] = picked[None, :] // block <= row_block[:, None]
    shapes = (f"scaled_dot_product_attention on dense contiguous query {list(q.shape)}, "
              f"key/value {list(k.shape)} ([requests, heads, rows, keys], KV heads repeated "
              f"to {heads}, padded to the longest request), boolean mask {list(mask.shape)}; "
              "the same visible keys without the paged gather")
    return (q, k, v, mask, scale), shapes


def torch_side(op, args):
    """The arguments for the torch code: the paged-attention ops' cache, built interleaved
    as the Triton kernels read it, in the arrangement torch reads on its device
    (``kernels.kv_pages``: on CPU, under Triton's interpreter, the split copy)."""
    from vllm_diffusion.kernels.kv_pages import interleaved_as_read_here

    if op not in ("block_attention", "sparse_prefix_attention"):
        return args
    return (args[0], interleaved_as_read_here(args[1]), *args[2:])


def upcast(value):
    """Floating tensors (also inside lists) as fp32; everything else unchanged."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(upcast(v) for v in value)
    return value


def compare(got, want, atol, rtol):
    """(max abs error, elements outside atol + rtol * |want|, structural problem or None)."""
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    if len(got) != len(want):
        return None, None, f"{len(got)} outputs, reference has {len(want)}"
    worst, outside = 0.0, 0
    for i, (g, w) in enumerate(zip(got, want)):
        if (g is None) != (w is None):
            return None, None, f"output {i} is {'None' if g is None else 'a tensor'}"
        if g is None:
            continue
        if g.shape != w.shape:
            return None, None, f"output {i} shape {list(g.shape)}, reference {list(w.shape)}"
        g, w = g.detach().cpu().double(), w.detach().cpu().double()
        error = (g - w).abs()
        if error.numel():
            worst = max(worst, float(error.max()))
            outside += int((~(error <= atol + rtol * w.abs())).sum())  # NaN counts
    return worst, outside, None


def interpreter_dtype_problem(dtype):
    """None if Triton's interpreter loads, converts and stores ``dtype``, else why not."""
    import triton
    import triton.language as tl

    @triton.jit
    def round_trip(source, target, count, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        inside = offsets < count
        values = tl.load(source + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(target + offsets, (values * 2.0).to(target.dtype.element_ty), mask=inside)

    source = torch.linspace(-2, 2, 13).to(dtype)
    target = torch.empty_like(source)
    try:
        round_trip[(1,)](source, target, 13, BLOCK=16)
    except Exception as error:  # noqa: BLE001  (any failure means: cannot run this dtype)
        return f"Triton's interpreter cannot run {dtype}: {type(error).__name__}: {error}"
    if not torch.equal(target.float(), source.float() * 2):
        return f"Triton's interpreter computes {dtype} wrongly (load/store round trip)"
    return None


def make_timer(device):
    """(time_ms(fn), description): triton.testing.do_bench on CUDA, a median of
    perf_counter runs (after one warm-up run, within ~0.2 s, at most 20) on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return (lambda fn: float(do_bench(fn, warmup=25, rep=100, return_mode="median")),
                "triton.testing.do_bench, median ms (warmup 25 ms, rep 100 ms)")

    def cpu_time_ms(fn):
        fn()
        times, began = [], time.perf_counter()
        while len(times) < 20 and (not times or time.perf_counter() - began < 0.2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    return cpu_time_ms, "time.perf_counter, median ms of up to 20 runs after a warm-up run"


def timed(time_ms, fn):
    """(milliseconds or None, why not): a timing failure is reported, not fatal."""
    try:
        return time_ms(fn), None
    except Exception as error:  # noqa: BLE001
        return None, f"timing raised {type(error).__name__}: {error}"


def record(op, name, point, dtype, implementation, status, *, error=None, outside=None,
           tolerance=(None, None), time_ms=None, detail=None):
    values = (op, name, point, dtype, implementation, status,
              error if error is None or math.isfinite(error) else None, outside,
              *tolerance, time_ms, detail)
    return dict(zip(RECORD_KEYS, values))


def verify_point(op, name, point, dtype_name, device, interpreter, dtype_problem, time_ms):
    """Records of one (op, grid point, dtype): triton and torch_path checked against the
    reference, then (with ``time_ms``) the reference and SDPA timed."""
    from vllm_diffusion.kernels.dispatch import KERNELS, resolve

    dtype = DTYPES[dtype_name]
    tolerance = TOLERANCES[op][dtype_name]
    base = (op, name, point, dtype_name)
    checked = ("triton", "torch_path")
    if name in CUDA_ONLY and interpreter:
        return [record(*base, impl, "skipped",
                       detail="serving-sized shape: only with native Triton on CUDA")
                for impl in checked]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{op}/{name}".encode()))
    triton_args = BUILDERS[op](point, gen, dtype, device)
    args = torch_side(op, triton_args)
    reference_args = args if dtype == torch.float32 else upcast(args)
    reference = resolve(KERNELS[op].reference)
    try:
        want = reference(*reference_args)
    except Exception:  # noqa: BLE001
        return [record(*base, impl, "fail", detail="reference raised: "
                       + traceback.format_exc(limit=-2)) for impl in checked]
    records = []
    for implementation in checked:
        if implementation == "triton" and dtype_problem:
            records.append(record(*base, implementation, "skipped", detail=dtype_problem))
            continue
        try:
            function = resolve(getattr(KERNELS[op], implementation))
            call_args = triton_args if implementation == "triton" else args
            got = function(*call_args)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            records.append(record(*base, implementation, "fail", tolerance=tolerance,
                                  detail="raised: " + traceback.format_exc(limit=-2)))
            continue
        error, outside, problem = compare(got, want, *tolerance)
        passed = problem is None and outside == 0 and error is not None and math.isfinite(error)
        detail = problem or (None if passed else f"{outside} elements outside tolerance")
        if passed and getattr(KERNELS[op], implementation) == KERNELS[op].reference:
            detail = "the torch path is the reference function itself"
        timing, timing_problem = (timed(time_ms, lambda: function(*call_args))
                                  if time_ms and passed else (None, None))
        records.append(record(*base, implementation, "pass" if passed else "fail",
                              error=error, outside=outside, tolerance=tolerance,
                              time_ms=timing, detail=detail or timing_problem))
    if time_ms:
        timing, timing_problem = timed(time_ms, lambda: reference(*args))
        records.append(record(*base, "reference", "timing_only", time_ms=timing,
                              detail=timing_problem or "timed on the inputs in their own dtype"))
        if op in ("block_attention", "sparse_prefix_attention"):
            dense, description = dense_attention(op, args)
            timing, timing_problem = (timed(time_ms, lambda: F.scaled_dot_product_attention(
                *dense[:4], scale=dense[4])) if dense else (None, None))
            records.append(record(*base, "sdpa_dense", "timing_only" if dense else "skipped",
                                  time_ms=timing, detail=timing_problem or description))
    return records


def summarize(records):
    counts = {"pass": 0, "fail": 0, "skipped": 0, "timing_only": 0}
    by_op = {}
    for item in records:
        counts[item["status"]] += 1
        slot = by_op.setdefault(item["op"], {}).setdefault(item["dtype"], {}).setdefault(
            item["implementation"], dict.fromkeys(counts, 0))
        slot[item["status"]] += 1
    return {"records": len(records), **counts, "by_op": by_op,
            "all_checks_passed": counts["fail"] == 0}


def loaded_modules():
    """Non-stdlib top-level modules and this package's modules loaded by this run."""
    top = {name.split(".")[0] for name in sys.modules}
    return {"third_party": sorted(m for m in top - set(sys.stdlib_module_names)
                                  if not m.startswith("_") and m not in ("__main__", PACKAGE)),
            PACKAGE: sorted(m for m in sys.modules if m.split(".")[0] == PACKAGE),
            "vllm_imported": "vllm" in sys.modules}


def device_description(device):
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        name, capability = torch.cuda.get_device_name(), f"{major}.{minor}"
    else:
        name, capability = platform.processor() or platform.machine(), None
    return {"type": device, "name": name, "capability": capability,
            "cpu_count": os.cpu_count()}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--grid", choices=("full", "reduced"), default="full")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16",
                        help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--ops", default=None,
                        help="comma-separated op names (default: every op in KERNELS)")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available, else cpu (Triton's interpreter)")
    args = parser.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    if unknown := set(args.dtypes) - set(DTYPES):
        parser.error(f"unknown dtypes {sorted(unknown)}")
    return args, parser


def select_device(args):
    """The device; for CPU makes sure Triton is imported with TRITON_INTERPRET=1 (by
    setting it now, or by running this script again with it set)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton" in sys.modules:  # imported too early to switch: start over
            os.execv(sys.executable, [sys.executable, *sys.argv, "--device", "cpu"])
    return device


def main(argv=None):
    args, parser = parse_args(argv)
    device = select_device(args)
    import triton

    from vllm_diffusion.kernels.dispatch import KERNELS

    ops = list(KERNELS) if args.ops is None else args.ops.split(",")
    if unknown := set(ops) - set(KERNELS):
        parser.error(f"unknown ops {sorted(unknown)}; known: {', '.join(KERNELS)}")
    mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "native"
    dtype_problems = {d: interpreter_dtype_problem(DTYPES[d]) if mode == "interpreter"
                      else None for d in args.dtypes}
    torch.set_float32_matmul_precision("highest")  # fp32 references: no TF32 on CUDA
    time_ms, timing_method = (None, None) if args.no_timing else make_timer(device)
    records = []
    for op in ops:
        if op not in GRIDS:
            records += [record(op, None, None, d, "triton", "fail",
                               detail="no grid for this op") for d in args.dtypes]
            continue
        names = REDUCED_GRID[op] if args.grid == "reduced" else tuple(GRIDS[op])
        for name in names:
            for dtype_name in args.dtypes:
                began = time.perf_counter()
                point = verify_point(op, name, GRIDS[op][name], dtype_name, device,
                                     mode == "interpreter", dtype_problems[dtype_name], time_ms)
                records += point
                # The status of each point as it finishes: a run stopped early still tells.
                statuses = " ".join(f"{r['implementation']} {r['status']}" for r in point
                                    if r["implementation"] in ("triton", "torch_path"))
                print(f"{op:24} {name:34} {dtype_name}  {statuses}  "
                      f"{time.perf_counter() - began:6.2f} s", file=sys.stderr, flush=True)
    summary = summarize(records)
    results = {
        "schema_version": SCHEMA_VERSION,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": device_description(device),
        "torch_version": torch.__version__, "triton_version": triton.__version__,
        "python_version": platform.python_version(), "mode": mode, "grid": args.grid,
        "dtypes": args.dtypes, "ops": ops, "timing_method": timing_method,
        "reference_precision": "fp32: for bf16/fp16 the reference runs on the same rounded "
                               "inputs upcast to fp32; outputs are compared in float64",
        "tolerances": {op: {d: {"atol": a, "rtol": r} for d, (a, r) in TOLERANCES[op].items()}
                       for op in ops if op in TOLERANCES},
        "interpreter_dtype_skips": {d: p for d, p in dtype_problems.items() if p},
        "loaded_modules": loaded_modules(),
        "results": records,
        "summary": summary,
    }
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)
    for op, by_dtype in summary["by_op"].items():
        for dtype_name, by_impl in by_dtype.items():
            line = "  ".join(f"{impl} {c['pass']}/{c['pass'] + c['fail']}"
                             + (f" ({c['skipped']} skipped)" if c["skipped"] else "")
                             for impl, c in by_impl.items() if impl in ("triton", "torch_path"))
            print(f"{op:24} {dtype_name}  {line}")
    for item in records:
        if item["status"] == "fail":
            print(f"FAIL {item['op']} {item['grid_point']} {item['dtype']} "
                  f"{item['implementation']}: {item['detail']}")
    return 0 if summary["all_checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
