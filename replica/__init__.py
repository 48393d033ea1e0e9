"""The replicas: what a draft or target replica process runs -- the session servicer both kinds
share (``servicer``: StartSession / Commit / Release, the batched engine calls, the process's
start and drain), the iteration loop that batches their works (``batcher``) on the one thread
that runs the model (``model_thread``)."""
