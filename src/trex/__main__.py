from trex.cli import main

raise SystemExit(main())
