from ecp_lm.cli import main

raise SystemExit(main())
