"""The draft and target replicas: their entry points (``draft``: ``specdec draft``; ``target``:
``specdec target``, ``--tp N`` with its rank ``supervisor``) over what both kinds share -- the
session servicer (``servicer``: StartSession / Commit / Release, the batched engine calls, the
process's start and drain), the iteration loop that batches their works (``batcher``) and the one
thread that runs the model (``model_thread``)."""
