"""Builds (or finds) the native op library for the running torch: ``python -m ort_optim.build [--verbose]``.

The project's setup runs this once per environment; the library lands in a cache folder keyed by torch's version,
its C++ ABI, the sources and the CPU flags (see ort_optim.backends.native.build_dir), so a rebuild happens only when one of them changes.
"""

import argparse
import sys
import time

from . import backends


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    path = backends.native.build(verbose=args.verbose)
    print(f"ort_optim native ops: {path} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
