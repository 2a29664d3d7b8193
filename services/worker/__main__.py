from services.worker.main import main

raise SystemExit(main())
