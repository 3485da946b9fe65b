from ubep.cli import main

raise SystemExit(main())
