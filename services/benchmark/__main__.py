from services.benchmark.main import main

raise SystemExit(main())
