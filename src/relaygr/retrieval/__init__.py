"""The cascade's trained retrieval (matching) stage: SCCDR cross-domain matching.

Layering (checked by ``tests/retrieval/test_layers.py``): this package imports only
``relaygr.errors`` and third-party packages, never ``model``, ``relay``, ``cascade`` or anything
above. Inside it::

    config, data  <-  splits, graph  <-  encoders, losses, curriculum  <-  model  <-  evaluate
                  <-  trainer  <-  checkpoint  <-  report

``RetrievalModel.item_vectors`` / ``user_vector`` are the serving API (FAISS rows and the
request-time user tower), served by ``relaygr.cascade.trained_retrieval``.
"""

from relaygr.retrieval.config import PRESETS, SCCDRConfig, preset
from relaygr.retrieval.model import RetrievalModel

__all__ = ["PRESETS", "RetrievalModel", "SCCDRConfig", "preset"]
