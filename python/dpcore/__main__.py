"""Command line: ``python -m dpcore demo`` (also the ``dpcore`` console script)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from . import __version__, demo

    parser = argparse.ArgumentParser(prog="dpcore", description="Differentially private training, accounted.")
    parser.add_argument("--version", action="version", version=f"dpcore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="DP logistic regression on the digits data, with a non-private baseline")
    demo.add_arguments(p_demo)
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo.run(demo.from_args(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
