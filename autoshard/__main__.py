"""``python -m autoshard`` — see :mod:`autoshard.cli`."""
import sys


def main(argv=None) -> int:
    from autoshard.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
