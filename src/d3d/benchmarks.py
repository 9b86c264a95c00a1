"""`python -m d3d.benchmarks` (or `d3d-benchmarks`): list every benchmark, where it loads from here (and
why not from a source listed before it), and its item counts. A program above d3d.settings, outside
d3d.data: it binds the shipped benchmark files, which data/ takes from its callers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from d3d.config import compose
from d3d.configdir import config_dir
from d3d.data.benchmarks import BenchmarkUnavailable, iter_specs, load_records, seeded_subset
from d3d.settings import bind_config, shipped_benchmark


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-dir", default="data/cache", help="local cache root (default: data/cache)")
    args = parser.parse_args(argv)
    names = sorted(p.stem for p in (config_dir() / "benchmark").glob("*.yaml") if p.stem not in ("all", "all_plus"))
    suite = [spec.name for spec in iter_specs(bind_config(compose("eval", ["benchmark=all"]), "eval").benchmark)]
    print(f"{'benchmark':<15}{'in suite':<10}{'source':<10}{'items':>7}{'subset n':>10}  from")
    for name in names:
        spec = shipped_benchmark(name)
        try:
            records, source = load_records(spec, Path(args.cache_dir))
            n = len(seeded_subset(records, spec.n, spec.seed))
            origin = source.origin + (f"@{source.revision}" if source.revision else "")
            note = f"  (instead of {'; '.join(source.instead_of)})" if source.instead_of else ""
            print(f"{name:<15}{'yes' if name in suite else '':<10}{source.kind:<10}{len(records):>7}{n:>10}  {origin}{note}")
        except BenchmarkUnavailable as err:
            print(f"{name:<15}{'yes' if name in suite else '':<10}{'-':<10}{'-':>7}{'-':>10}  skipped: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
