"""`python -m pipeline ...` is the same as the `gkd` console script."""

from pipeline.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
