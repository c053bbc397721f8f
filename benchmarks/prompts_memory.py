"""Driver peak RSS of the prompts phase for 10k vs 100k synthetic rows (must not grow with rows).

    .venv/bin/python benchmarks/prompts_memory.py [--rows 10000 100000]

Each size runs in its own process (a fresh local Ray instance); the figure is that
process's peak RSS (ru_maxrss), i.e. the driver's, not the Ray workers'.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def write_rows(path: Path, n: int) -> None:
    rng = random.Random(0)
    words = "the a of to and in is it you that he was for on are with as his they be at one".split()
    sources = ["math", "code", "chat", "writing", "science"]
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(8, 60)))
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"{i}: {text}?"},
                                                  {"from": "gpt", "value": "ok"}],
                                "source": sources[i % 5]}) + "\n")


def child(n: int) -> None:
    import ray

    from support import extract_tokenizer
    from eagle_data.config import load_config
    from eagle_data.job.phases.run import run

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_rows(tmp / "rows.jsonl", n)
        tok = extract_tokenizer("qwen-3", tmp / "qwen3")
        cfg = load_config(None, [f"source.dataset={tmp / 'rows.jsonl'}", f"model.path={tok}",
                                 f"output.path={tmp / 'out'}", "engine.max_model_len=4096",
                                 "sampling.max_tokens=1024", "output.rows_per_shard=5000"])
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        start = time.perf_counter()
        counts = run(cfg, phase="prompts")["prompts"]
        wall = time.perf_counter() - start
        ray.shutdown()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": n, "prompts": counts["prompts"], "wall_s": round(wall, 1),
                      "driver_peak_rss_mib": round(peak_mib, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--child", type=int)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    results = []
    for n in args.rows:
        out = subprocess.run([sys.executable, __file__, "--child", str(n)], check=True,
                             capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    base = results[0]
    for r in results[1:]:
        print(f"rows x{r['rows'] / base['rows']:.0f}: driver peak RSS {base['driver_peak_rss_mib']:.0f} -> "
              f"{r['driver_peak_rss_mib']:.0f} MiB (ratio {r['driver_peak_rss_mib'] / base['driver_peak_rss_mib']:.2f}), "
              f"{r['rows'] / r['wall_s']:.0f} rows/s")


if __name__ == "__main__":
    main()
