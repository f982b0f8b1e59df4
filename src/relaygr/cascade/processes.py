"""Moved: the worker-process transport is ``relaygr.engine.transport.processes``. This name
stays only until ``bench`` imports from there (the next commit), then goes."""

from relaygr.engine.transport.processes import InstanceProcesses, ProcessInstance

__all__ = ["InstanceProcesses", "ProcessInstance"]
