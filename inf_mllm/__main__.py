"""`python -m inf_mllm policies` lists the registered eviction policies, one per line."""

import sys

from .policies import POLICIES


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["policies"]:
        print("\n".join(POLICIES))
        return 0
    print("usage: python -m inf_mllm policies", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
