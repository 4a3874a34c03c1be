"""Schedule: the recorded execution order and the prefetch window (``prefetch.py``), issuing the gathers it
asks for (``gathers.py``), the module and autograd hooks that drive it all (``hooks.py``), and what stays
gathered between evaluation calls (``residency.py``).
Imports: ``memory``, ``comm``, ``shard``, ``grads`` (and the package's ``config``).
"""
