"""``python -m autoshard`` — see :mod:`autoshard.cli`."""
import sys

from autoshard.cli import main as cli_main


def main(argv=None) -> int:
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
