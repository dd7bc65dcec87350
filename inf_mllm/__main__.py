"""`python -m inf_mllm policies` lists the registered policies; `python -m inf_mllm demo` runs the text-stream demo."""

import sys

from .policies import POLICIES


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["policies"]:
        print("\n".join(POLICIES))
        return 0
    if argv == ["demo"]:
        from .demo import main as demo

        return demo()
    print("usage: python -m inf_mllm policies | demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
