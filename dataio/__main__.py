from headrace.dataio.cli import main

raise SystemExit(main())
