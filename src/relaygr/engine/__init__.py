"""A ranking instance: one device, its KV pool and its scheduler.

Import rule: ``engine`` may import ``model`` and ``kvcache``; nothing below imports ``engine``.
"""
