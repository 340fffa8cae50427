"""``megatron-gtpo config``: every field of a recipe with its type, default and documentation.

The field docstrings next to each config dataclass are the single place a default is documented;
this command prints them (optionally only keys under a prefix, or as a commented YAML reference).
"""

from __future__ import annotations

import argparse
import textwrap

from megatron_gtpo.config import RunConfig
from megatron_gtpo.utils.configuration import describe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-gtpo config", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", nargs="?", default="", help="only keys starting with this (e.g. algo)")
    parser.add_argument("--yaml", action="store_true", help="print a commented YAML reference instead of a table")
    args = parser.parse_args(argv)

    rows = [r for r in describe(RunConfig) if r[0].startswith(args.prefix)]
    for key, type_name, default, doc in rows:
        if args.yaml:
            print("\n".join(f"# {line}" for line in textwrap.wrap(doc, 100)))
            print(f"{key}: {default!r}")
        else:
            print(f"{key} ({type_name}, default {default!r})")
            print(textwrap.indent(textwrap.fill(doc, 100), "    "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
