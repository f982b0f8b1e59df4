"""How the cascade reaches a ranking instance that is not in its process: one set of messages
for the two legs (``messages``, ``payload``), the instance's end of them (``instance_end``), and
instances in worker processes of their own (``processes``, ``process_instance``, ``host_link``,
``host``), kept alive (``liveness``, ``supervisor``). A Ray Serve replica (``distributed``) speaks
the same messages through the same end.

The cascade's policy stays above: which instance a leg goes to (``routing``, ``cascade.fleet``),
when a leg is shed (``cascade.fleet``, ``cascade.instance_end.SheddingEnd``) and how a mode's
instance is built (``cascade.instances.build_instance``, passed in to ``InstanceProcesses``).
"""
