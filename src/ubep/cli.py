"""The `ubep` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ubep", description=__doc__)
    parser.add_subparsers(dest="command", required=True)
    parser.parse_args(argv)
    return 0
