"""``python -m ecp_lm.experiments.long_context``."""

from ecp_lm.experiments.long_context import main

if __name__ == "__main__":
    raise SystemExit(main())
