"""The predict port's front doors: one module per protocol (MindIE, OpenAI, TGI, Azure,
embeddings, MLflow) over :mod:`coordinator.api.common`, and :mod:`coordinator.api.app`, which
assembles them into the predict app. Each door parses a request, runs it through the
:class:`~coordinator.inference.InferenceService`, and shapes the answer — and its errors — in its
own protocol's format. Nothing outside this package and the app assembly speaks HTTP."""
