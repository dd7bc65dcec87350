"""`python -m inf_mllm policies` lists the named policies and the tested combinations;
`python -m inf_mllm calibrate OUT ...` writes a PrefixKV calibration; `python -m inf_mllm demo` runs the
text-stream demo."""

import sys

from .spec import COMBINATIONS, SCORERS


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["policies"]:
        print("\n".join([*SCORERS, *COMBINATIONS]))
        return 0
    if argv[:1] == ["calibrate"]:
        from .calibrate import main as calibrate  # lazy: `policies` lists names without loading torch

        return calibrate(argv[1:])
    if argv == ["demo"]:
        from .demo import main as demo  # lazy, as above

        return demo()
    print("usage: python -m inf_mllm policies | calibrate OUT [options] | demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
