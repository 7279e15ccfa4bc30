"""``python -m labsupport <command>``. Commands: doctor (is this node ready for the labs?)."""
import sys

COMMANDS = {"doctor": "labsupport.doctor"}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m labsupport doctor [--ranks N] [--deadline S]", file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
