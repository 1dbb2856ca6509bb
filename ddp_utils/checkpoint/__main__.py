from ddp_utils.checkpoint.export import main

raise SystemExit(main())
