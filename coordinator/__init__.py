"""The coordinator: the public Coordinator API front, hosted on Ray actors (``specdec coordinator``)
or as a Ray Serve application (``serve_app``, what deploy/ runs)."""
