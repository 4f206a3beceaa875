"""Entry points for frameworks built on PyTorch, each in its own module, imported on demand.

* ``transformers`` (:mod:`gradient_scope.integrations.transformers`): Hugging Face transformers models,
  one scope per layer (``enable(model)`` / ``disable(model)``).

Importing ``gradient_scope`` imports none of them (nor the frameworks they need).
"""
