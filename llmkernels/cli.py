"""`llmkernels` command line: `llmkernels bench ...`, `llmkernels scaling ...`."""
from __future__ import annotations

import sys

USAGE = """usage: llmkernels <command> [options]

commands:
  bench     benchmark the kernels against every installed peer (python -m llmkernels.bench)
  scaling   scaling-law experiments built on the kernels (python -m llmkernels.scaling)

`llmkernels <command> --help` for each command's options."""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from .bench import main as run
    elif command == "scaling":
        from .scaling import main as run
    else:
        print(f"llmkernels: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
