from services.embedder.main import main

raise SystemExit(main())
