"""``python -m ecp_lm.experiments.mqar``."""

from ecp_lm.experiments.mqar import main

if __name__ == "__main__":
    raise SystemExit(main())
