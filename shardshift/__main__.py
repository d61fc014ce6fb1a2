from shardshift.cli.main import main

raise SystemExit(main())
