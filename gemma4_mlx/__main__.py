"""`python -m gemma4_mlx COMMAND [ARGS]`: COMMAND is generate or convert (each also runs as
`python -m gemma4_mlx.COMMAND`)."""

import importlib
import sys

COMMANDS = ("generate", "convert")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: python -m gemma4_mlx {{{','.join(COMMANDS)}}} [ARGS]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        module = importlib.import_module(f"gemma4_mlx.{argv[0]}")
    except ModuleNotFoundError as e:
        if e.name != f"gemma4_mlx.{argv[0]}":
            raise
        print(f"error: the {argv[0]} command is not available in this version", file=sys.stderr)
        return 1
    sys.argv = [f"python -m gemma4_mlx {argv[0]}", *argv[1:]]
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
