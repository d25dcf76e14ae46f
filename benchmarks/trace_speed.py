"""Wall time and peak RSS of tracing + summarising each built-in model.

Each model runs in a fresh interpreter so that its peak RSS (getrusage
ru_maxrss) is its own, including the torch/transformers import. Target on a
2-core machine: llama-3-405b and gpt3-175b under 30 s and 4 GiB.

    .venv/bin/python benchmarks/trace_speed.py [--seq-len 4096] [names...]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = """
import json, resource, time, warnings
warnings.simplefilter("ignore")
t0 = time.perf_counter()
from planner.trace.workload_for import workload_for
t1 = time.perf_counter()
workload, graph = workload_for({name!r}, seq_len={seq})
t2 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "trace_s": t2 - t1, "nodes": graph.graph.number_of_nodes(),
                  "params": workload.params, "tflop": workload.forward_flops() / 1e12,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def measure(name: str, seq_len: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD.format(name=name, seq=seq_len)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from planner.trace.models.catalog import list_models

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=None)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    names = args.names or list_models()
    print(f"{'model':<14} {'import s':>8} {'trace s':>8} {'nodes':>6} {'params B':>9} {'fwd TFLOP/seq':>13} {'peak MiB':>9}")
    for name in names:
        seq = min(args.seq_len, 512) if name in ("bert-large", "gpt2") else args.seq_len  # absolute positions
        r = measure(name, seq)
        print(f"{name:<14} {r['import_s']:>8.2f} {r['trace_s']:>8.2f} {r['nodes']:>6} {r['params'] / 1e9:>9.2f} "
              f"{r['tflop']:>13.2f} {r['rss_mib']:>9.0f}")


if __name__ == "__main__":
    main()
