"""`python -m models list` prints the available adapters, one per line: name and description."""

import sys

from . import ADAPTERS


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["list"]:
        for name, entry in ADAPTERS.items():
            print(f"{name}\t{entry.about}")
        return 0
    print("usage: python -m models list", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
