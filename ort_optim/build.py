"""Builds (or finds) the native op library for the running torch: ``python -m ort_optim.build [--verbose]``.

The project's setup runs this once per environment; the library lands in a cache folder keyed by torch's version,
its C++ ABI, the sources and the CPU flags (see ort_optim.backends.native.build_dir), so a rebuild happens only when one of them changes.
A library whose stamp (size and sha256 recorded by its build) does not match it is rebuilt, never loaded. On a cache
that cannot be written, a verified library is reported as it is (exit 0). A failure prints one message, the
compiler's last meaningful lines and how to see the whole log (exit 1), never a traceback.
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
    native = backends.native
    try:
        path = native.build(verbose=args.verbose)
    except Exception as error:  # (a command-line tool: the reason in a few lines, not a traceback)
        message = str(error) if isinstance(error, native.BuildError) else f"{type(error).__name__}: {error}"
        print(f"ort_optim native ops: {message.splitlines()[0] if message.strip() else type(error).__name__}",
              file=sys.stderr)
        details = [] if args.verbose else getattr(error, "details", [])  # (--verbose printed the whole log)
        if details:
            print("the compiler's last lines:", file=sys.stderr)
        for line in details:
            print(f"  {line}", file=sys.stderr)
        if not args.verbose and getattr(error, "compiled", True):  # (a build's failure: its log)
            print("Run `python -m ort_optim.build --verbose` for the full log.", file=sys.stderr)
        return 1
    print(f"ort_optim native ops: {path} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
