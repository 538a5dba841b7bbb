"""``python -m ecp_lm.experiments.evidence4``."""

from ecp_lm.experiments.evidence4 import main

if __name__ == "__main__":
    raise SystemExit(main())
