"""The coordinator: the public Coordinator API front, hosted on Ray actors (``specdec coordinator``)
or as a Ray Serve application (``serve_app``, what deploy/ runs), and its machinery: the request
path (``core``, configured by ``config``; requests validated by ``requests``), requests kept in
the session log -- resume, takeover -- (``durable``, over the Redis log ``output_log``), the
replicas' gRPC clients (``peers``), routing (``routing``, ``affinity``, ``replica_choice``)."""
