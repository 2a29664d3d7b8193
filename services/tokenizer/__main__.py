from services.tokenizer.main import main

raise SystemExit(main())
