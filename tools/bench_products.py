"""The row products (entmtp_ray/model/products.py) against torch's own, per row count, over one model's layer shapes.

For each weight kind (fp32, bf16, int8, int4) the four products of every decoder layer (q/k/v, o, gate/up, down) of
the embedded model's shapes, with random weights, are timed through torch's kernel (oneDNN packed bf16 where the CPU
can pack, MKL fp32, ATen's weight-only int8/int4) and through the row products, the two in turn per round (medians
over --repeats rounds), at 1 to 64 rows; beside each, the floor: the layer weights' bytes read once at this thread
count. Ends with a JSON line.

    .venv/bin/python tools/bench_products.py --threads 2 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from entmtp_ray.model import kernels, products

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # SmolLM2-135M
LAYERS = 30
CASES = {"fp32": (torch.float32, "none"), "bf16": (torch.bfloat16, "none"), "int8": (torch.float32, "int8"),
         "int4": (torch.float32, "int4")}


def _layer_set(dtype, scheme, native: bool, layers: int):
    """`layers` copies of the four projections, each its own weights (so every call reads memory, not cache)."""
    g = torch.Generator().manual_seed(0)
    made = []
    for _ in range(layers):
        for out_features, in_features in SHAPES.values():
            weight = (torch.randn(out_features, in_features, generator=g) * 0.05).to(dtype)
            if native:
                made.append(kernels.Projection(weight, None, None, kernels.weight_key(weight),
                                               native=products.NativeWeight.of(weight, scheme)))
            else:
                with products.switched_off():
                    made.append(kernels.Projection.of(weight, None, scheme))
    return made


def _bytes(projections) -> int:
    total = 0
    for p in projections:
        held = p.native or p.quantized
        if held is None:
            total += (p.packed if p.packed is not None else p.weight).nbytes
        else:
            total += held.data.nbytes + held.scales.nbytes
    return total


def _bandwidth(repeats: int) -> float:
    """Bytes a second this thread count reads: 256 MB of fp32 summed (more than any cache), the median of repeats."""
    data = torch.ones(64 << 20)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.nbytes / statistics.median(times)


def _seconds(projections, x: dict) -> float:
    start = time.perf_counter()
    for p in projections:
        p(x[p.weight.shape[1]])
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--kinds", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not products.native_ready():
        raise SystemExit("the row products could not be built here (no C++ compiler?)")
    results, bandwidth = {}, _bandwidth(args.repeats)
    print("| kind | rows | torch ms | native ms | torch / native | floor ms |\n|---|---:|---:|---:|---:|---:|")
    for kind in args.kinds:
        dtype, scheme = CASES[kind]
        with torch.no_grad():
            sets = {"torch": _layer_set(dtype, scheme, False, args.layers),
                    "native": _layer_set(dtype, scheme, True, args.layers)}
        with torch.inference_mode():
            floor = _bytes(sets["native"]) / bandwidth
            for rows in args.rows:
                x = {k: torch.randn(rows, k).to(dtype) for k in {s[1] for s in SHAPES.values()}}
                times = {name: [] for name in sets}
                for _ in range(args.repeats + 1):  # the first round warms up
                    for name, made in sets.items():
                        times[name].append(_seconds(made, x))
                ms = {name: 1e3 * statistics.median(t[1:]) for name, t in times.items()}
                results[f"{kind}/{rows}"] = {**ms, "floor": 1e3 * floor}
                print(f"| {kind} | {rows} | {ms['torch']:.2f} | {ms['native']:.2f} | {ms['torch'] / ms['native']:.2f}x "
                      f"| {1e3 * floor:.2f} ({_bytes(sets['native']) / 1e6:.0f} MB) |")
    print(json.dumps({"ms": results, "read_gb_s": bandwidth / 1e9, "threads": torch.get_num_threads(), "repeats": args.repeats,
                      "layers": args.layers}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
