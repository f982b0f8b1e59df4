"""The HTTP service (``relaygr serve``): a FastAPI app over a relay backend.

Layers (lower never imports upper): ``config``, ``schemas``, ``snapshot`` <- ``backend``,
``validation``, ``metrics``, ``admission``, ``middleware`` <- ``service`` <- ``app`` <- ``build``.
``relaygr.distributed`` (Ray Serve) sits above and reuses ``app``, ``service`` and ``snapshot``.

Public names: ``create_app``, ``RelayService``, ``EmbeddedBackend``, ``RelayBackend``,
``ServerConfig``, ``ModelSource``, ``build_embedded``, ``StateFingerprint``.
"""

from relaygr.server.app import create_app
from relaygr.server.backend import EmbeddedBackend, RelayBackend
from relaygr.server.build import build_embedded
from relaygr.server.config import ModelSource, ServerConfig
from relaygr.server.service import RelayService
from relaygr.server.snapshot import StateFingerprint

__all__ = ["EmbeddedBackend", "ModelSource", "RelayBackend", "RelayService", "ServerConfig",
           "StateFingerprint", "build_embedded", "create_app"]
