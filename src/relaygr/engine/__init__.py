"""A ranking instance: one device, its KV pool and its scheduler; and its transports
(``engine.transport``: an instance in a worker process, the legs' messages).

Import rule: ``engine`` imports only the layers below it (docs/architecture.md); nothing below
imports ``engine``, and the cascade above drives it.
"""
