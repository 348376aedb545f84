from dataio.cli import main

raise SystemExit(main())
