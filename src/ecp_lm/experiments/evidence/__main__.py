"""``python -m ecp_lm.experiments.evidence``."""

from ecp_lm.experiments.evidence import main

if __name__ == "__main__":
    raise SystemExit(main())
